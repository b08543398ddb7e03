"""The DFlash2 drafter's pieces against small cases worked by hand, its start as a DFlash drafter, and its
convolution's block boundary (packed training blocks leak nothing into each other and equal decoding one
block at a time)."""

from __future__ import annotations

import pytest
import torch
from test_model_blocks import MASK, B, H, V, batch, block_alone
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash.model.blocks import forward_blocks
from dflash.model.dflash2 import (
    CandidateSelector,
    DFlash2Config,
    DFlash2Drafter,
    GroupedDynamicCausalConv,
    settings_problem,
)
from dflash.model.drafter import DFlashDrafter, DrafterConfig

BASE = dict(hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=V, num_target_layers=6, target_layer_ids=[1, 3], mask_token_id=MASK,
            block_size=B, rope_theta=10000.0)


def dflash2(seed: int = 0, scramble: bool = True, **kw) -> DFlash2Drafter:
    """A DFlash2 drafter; ``scramble``: random convolution and codebooks (not their identity start)."""
    torch.manual_seed(seed)
    d = DFlash2Drafter(DFlash2Config(**{**BASE, "conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 6,
                                        "selector_top_k": 5, **kw})).double()
    if scramble:
        with torch.no_grad():
            for name, p in d.named_parameters():
                if "conv" in name or "codebook" in name:
                    p.add_(torch.randn_like(p) * 0.2)
    return d


def test_the_convolution_on_a_case_worked_by_hand():
    # hidden 4 in 2 groups of 2, kernel 2, one block of 3 tokens
    conv = GroupedDynamicCausalConv(4, 2, 2).double()
    with torch.no_grad():
        conv.base_kernel[0] = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, -1.0, -1.0]])
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], [100.0, 200.0, 300.0, 400.0]]]).double()
    # per-token kernels [B, Q, taps, groups]: token t's tap-o coefficient of each group
    d = torch.tensor([[[[0.0, 1.0], [0.0, 0.0]], [[1.0, 0.0], [2.0, 0.0]], [[0.0, 0.0], [0.0, 3.0]]]]).double()
    out = conv._convolve(x, d, 0, None)
    # out[t, c] = (base[0, c] + d[t, 0, g]) x[t, c] + (base[1, c] + d[t, 1, g]) x[t-1, c], x[-1] = 0
    expect = [[1 * 1, 2 * 2, (3 + 1) * 3, (4 + 1) * 4],
              [(1 + 1) * 10 + (0.5 + 2) * 1, (2 + 1) * 20 + (0.5 + 2) * 2, 3 * 30 - 1 * 3, 4 * 40 - 1 * 4],
              [1 * 100 + 0.5 * 10, 2 * 200 + 0.5 * 20, 3 * 300 + (-1 + 3) * 30, 4 * 400 + (-1 + 3) * 40]]
    assert out[0].tolist() == expect
    # the same three tokens in blocks of one: every token is its own block's first, tap 1 sees zeros
    alone = conv._convolve(x, d, 0, 1)
    assert alone[0, 1].tolist() == [(1 + 1) * 10, (2 + 1) * 20, 3 * 30, 4 * 40]


def test_the_predicted_kernels_are_read_in_the_reference_s_order():
    """kernel_projection's outputs are [side, tap, group] row-major: output s*K*G + o*G + g is side s's
    tap-o coefficient of group g (the reference's view(..., 2, kernel, groups))."""
    conv = GroupedDynamicCausalConv(4, 2, 2).double()
    with torch.no_grad():
        conv.kernel_projection.weight.zero_()
        conv.kernel_projection.weight[1 * 4 + 0 * 2 + 1, 0] = 1.0  # after-side, tap 0, group 1 <- channel 0
    x = torch.tensor([[[2.0, 0.0, 5.0, 7.0]]]).double()
    h, after = conv.before(x, None)
    assert h.tolist() == x.tolist()  # the before side is untouched
    assert after[0, 0].tolist() == [[0.0, 2.0], [0.0, 0.0]]
    assert conv.after(x, after, None)[0, 0].tolist() == [2.0, 0.0, 5.0 * 3, 7.0 * 3]


def test_the_selector_scores_on_a_case_worked_by_hand():
    cfg = DFlash2Config(**{**BASE, "selector_rank": 2, "selector_top_k": 2})
    sel = CandidateSelector(cfg).double()
    with torch.no_grad():
        sel.predecessor_codebook.zero_()
        sel.successor_codebook.zero_()
        sel.predecessor_codebook[7] = torch.tensor([1.0, 2.0])
        sel.successor_codebook[3] = torch.tensor([3.0, 0.0])
        sel.successor_codebook[4] = torch.tensor([0.0, -1.0])
    projected = torch.tensor([0.5, 4.0]).double()
    unary = torch.tensor([1.0, 2.0]).double()
    scores = sel.scores(projected, torch.tensor(7), unary, torch.tensor([3, 4]))
    # context = [1 * 0.5, 2 * 4] = [0.5, 8]; <context, succ[3]> = 1.5, <context, succ[4]> = -8
    assert scores.tolist() == [1.0 + 1.5, 2.0 - 8.0]


def test_the_greedy_walk_follows_the_chosen_predecessor():
    """Slot 2's choice flips with slot 1's: the walk feeds each chosen token forward."""
    cfg = DFlash2Config(**{**BASE, "selector_rank": 1, "selector_top_k": 2})
    sel = CandidateSelector(cfg).double()
    with torch.no_grad():
        sel.hidden_projection.weight.zero_()
        sel.hidden_projection.weight[0, 0] = 1.0  # projected state = h[0]
        sel.predecessor_codebook.zero_()
        sel.successor_codebook.zero_()
        sel.predecessor_codebook[11] = 10.0  # after token 11, candidate 21 gains 10
        sel.successor_codebook[21] = 1.0
    logits = torch.full((1, 2, V), -5.0).double()
    logits[0, 0, 10], logits[0, 0, 11] = 1.0, 0.5  # slot 1: 10 by unary, 11 by ...
    logits[0, 1, 20], logits[0, 1, 21] = 1.0, 0.0  # slot 2: 20 unless 11 came before
    hidden = torch.ones(1, 2, H).double()
    assert sel.walk(hidden, logits, torch.tensor([1])).tokens.tolist() == [[10, 20]]
    with torch.no_grad():
        sel.predecessor_codebook[1] = 1.0  # after the anchor 1, candidate 11 gains 1: it wins slot 1
        sel.successor_codebook[11] = 1.0
    assert sel.walk(hidden, logits, torch.tensor([1])).tokens.tolist() == [[11, 21]]


def test_the_sampled_walk_draws_from_the_softmax_of_the_scores():
    sel = dflash2().candidate_selector
    g = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(1, 1, H, generator=g).double(), torch.randn(1, 1, V, generator=g).double() * 2
    p = sel.walk(hidden, logits, torch.tensor([4]), temperature=0.7, generator=g)
    unary, cands = sel.candidates(logits.float())
    want = torch.softmax(sel.scores(sel.hidden_projection(hidden), torch.tensor([[4]]), unary, cands).float() / 0.7, -1)
    torch.testing.assert_close(p.probs, want)
    n = 3000  # the same slot 3000 times, as one batch
    draws = sel.walk(hidden.expand(n, 1, H), logits.expand(n, 1, V), torch.full((n,), 4), 0.7, g).tokens[:, 0]
    freq = torch.stack([(draws == c).double().mean() for c in cands[0, 0]])
    assert (freq - want[0, 0].double()).abs().max() < 0.035  # 3000 draws: 4 standard errors at p = 0.5


def test_a_new_dflash2_drafter_starts_as_the_dflash_drafter_and_its_selector_as_top_1():
    """Identity convolutions and a zero successor codebook: a fresh DFlash2 drafter computes what a
    DFlash drafter with the same other weights computes, and its greedy walk is plain top-1."""
    torch.manual_seed(0)
    fresh = DFlash2Drafter(DFlash2Config(**BASE)).double()
    plain = DFlashDrafter(DrafterConfig(**BASE)).double()
    missing = plain.load_state_dict(fresh.state_dict(), strict=False).unexpected_keys
    assert missing and all("conv" in k or "candidate_selector" in k for k in missing)
    ids, hidden = batch()
    anchors = torch.tensor([[1, 9, 20], [0, 4, 15]])
    embed = torch.nn.Embedding(V, H).double()
    torch.testing.assert_close(forward_blocks(fresh, embed, ids, hidden, anchors, attn_backend="sdpa"),
                               forward_blocks(plain, embed, ids, hidden, anchors, attn_backend="sdpa"), rtol=0, atol=0)
    logits = torch.randn(2, B - 1, V).double()
    walked = fresh.candidate_selector.walk(torch.randn(2, B - 1, H).double(), logits, torch.tensor([1, 2]))
    assert walked.tokens.tolist() == logits.argmax(-1).tolist()
    # ... and a scrambled one does not (the test can fail)
    assert not torch.equal(forward_blocks(dflash2(), embed, ids, hidden, anchors, attn_backend="sdpa"),
                           forward_blocks(plain, embed, ids, hidden, anchors, attn_backend="sdpa"))


def test_the_convolution_never_carries_a_value_across_packed_blocks():
    """Three packed blocks: changing every token of the middle block changes nothing of its
    neighbours, in one convolution and through the whole drafter (attention never crossed blocks
    already: this is the convolution's boundary)."""
    conv = dflash2().layers[0].attention_conv
    x = torch.randn(2, 3 * B, H).double()
    kernels = torch.randn(2, 3 * B, 3, H // 8).double()
    base = conv._convolve(x, kernels, 0, B)
    changed = x.clone()
    changed[:, B:2 * B] += 10
    out = conv._convolve(changed, kernels, 0, B)
    torch.testing.assert_close(out[:, :B], base[:, :B], rtol=0, atol=0)
    torch.testing.assert_close(out[:, 2 * B:], base[:, 2 * B:], rtol=0, atol=0)
    assert (out[:, B:2 * B] - base[:, B:2 * B]).abs().min() > 0
    # without the boundary the last block would feel the middle one's last tokens (the test can fail)
    unbounded = conv._convolve(changed, kernels, 0, None)
    assert (unbounded[:, 2 * B] - conv._convolve(x, kernels, 0, None)[:, 2 * B]).abs().max() > 0

    d = dflash2()
    ids, hidden = batch()
    anchors = torch.tensor([[5, 6, 30], [2, 14, 15]])  # neighbours overlap in position
    embed = torch.nn.Embedding(V, H).double()
    before = forward_blocks(d, embed, ids, hidden, anchors, attn_backend="sdpa")
    changed_ids = ids.clone()
    changed_ids[0, 6], changed_ids[1, 14] = (ids[0, 6] + 1) % MASK, (ids[1, 14] + 1) % MASK  # middle anchors
    after = forward_blocks(d, embed, changed_ids, hidden, anchors, attn_backend="sdpa")
    for n in (0, 2):
        torch.testing.assert_close(after[:, n], before[:, n], rtol=0, atol=0)
    assert (after[:, 1] - before[:, 1]).abs().max() > 1e-4


def test_packed_dflash2_blocks_equal_decoding_one_block_at_a_time():
    d = dflash2(seed=2)
    ids, hidden = batch()
    anchors = torch.tensor([[1, 9, 20, 33], [0, 4, 15, 16]])
    embed = torch.nn.Embedding(V, H).double()
    packed = forward_blocks(d, embed, ids, hidden, anchors, attn_backend="sdpa")
    for b in range(2):
        for n in range(4):
            alone = block_alone(d, embed, ids[b], hidden[b], int(anchors[b, n]))
            torch.testing.assert_close(packed[b, n], alone, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize(("kw", "says"), [
    ({"selector_rank": 0}, "selector_rank must be at least 1, got 0"),
    ({"selector_top_k": V + 1}, f"selector_top_k {V + 1} is more candidates than the vocabulary has ({V})"),
    ({"conv_group_size": 5}, f"conv_group_size 5 does not divide the hidden size {H}"),
    ({"conv_kernel_size": B + 1}, f"conv_kernel_size {B + 1} is longer than the block"),
])
def test_bad_settings_are_refused_in_one_line(kw, says):
    with pytest.raises(ValueError) as e:
        DFlash2Config(**{**BASE, **kw})
    assert says in str(e.value) and "\n" not in str(e.value)
    assert settings_problem(**{"kernel": 2, "group": 8, "rank": 4, "top_k": 4, **{
        {"selector_rank": "rank", "selector_top_k": "top_k", "conv_group_size": "group",
         "conv_kernel_size": "kernel"}[k]: v for k, v in kw.items()}}, block_size=B, hidden_size=H,
        vocab_size=V) is not None
