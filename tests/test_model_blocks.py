"""The training objective. These pin the two bugs that gave public trainers "99% train accuracy,
acceptance 1.3": a label offset, and context at/after the anchor leaking into the block."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash.model.blocks import block_attention_mask, build_blocks, forward_blocks, sample_anchors
from dflash.model.drafter import DFlashDrafter, DrafterConfig, default_gamma
from dflash.objectives import build
from dflash.objectives.head import head_rows
from dflash.objectives.positions import exp_weights as loss_weights
from dflash.train.config import ObjectiveSettings

H, V, TAPS, T, B = 32, 50, 2, 40, 6
MASK = V - 1


def make_parts(seed: int = 0, layers: int = 2, block: int = B):
    """A drafter plus a frozen embedding and LM head standing in for the target's (real modules)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_layers=layers, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=V, num_target_layers=6,
                        target_layer_ids=[1, 3], mask_token_id=MASK, block_size=block, rope_theta=10000.0)
    drafter = DFlashDrafter(cfg).double()
    embed = torch.nn.Embedding(V, H).double().requires_grad_(False)
    head = torch.nn.Linear(H, V, bias=False).double().requires_grad_(False)
    return drafter, embed, head


def dflash_loss(drafter, embed, head, ids, hidden, loss_mask, **kw):
    """CE with exponential position weights (what these hand computations weigh by) with the plan built
    from loss_mask."""
    objective = build(ObjectiveSettings(position_weight="exp"), drafter.config.gamma)
    return objective.on_batch(drafter, embed, head, ids, hidden, loss_mask, **kw)


def batch(bsz: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 1, (bsz, T), generator=g)
    hidden = torch.randn(bsz, T, TAPS * H, generator=g, dtype=torch.float64)
    return ids, hidden


def block_alone(drafter, embed, ids_row, hidden_row, a: int) -> torch.Tensor:
    """The inference path for one block: context = hidden states at positions < a, no mask at all."""
    bs = drafter.config.block_size
    block = torch.full((bs,), MASK)
    block[0] = ids_row[a]
    return drafter(embed(block)[None], hidden_row[None, :a], torch.arange(a, a + bs)[None],
                   torch.arange(a)[None])[0]


def test_labels_are_anchor_plus_k_on_a_hand_built_example():
    ids = torch.arange(100, 100 + T)[None]  # token at position p is 100 + p
    anchors = torch.tensor([[0, 7, 30]])
    block_ids, positions, label_pos = build_blocks(ids, anchors, 4, MASK)
    assert block_ids.tolist() == [[100, MASK, MASK, MASK, 107, MASK, MASK, MASK, 130, MASK, MASK, MASK]]
    assert positions.tolist() == [[0, 1, 2, 3, 7, 8, 9, 10, 30, 31, 32, 33]]
    labels = torch.gather(ids, 1, label_pos.reshape(1, -1)).view(1, 3, 3)
    assert labels.tolist() == [[[101, 102, 103], [108, 109, 110], [131, 132, 133]]]


def test_loss_weights_match_the_formula():
    for bs, gamma in [(16, 7.0), (10, 5.0), (8, 4.0)]:
        assert default_gamma(bs) == gamma
        w = loss_weights(bs, gamma)
        assert len(w) == bs - 1
        for k in range(1, bs):
            assert w[k - 1].item() == pytest.approx(math.exp(-(k - 1) / gamma), rel=1e-6)
    assert loss_weights(16, 7.0)[0].item() == 1.0


def test_loss_equals_hand_computation_through_the_inference_path():
    """The packed training loss equals, block by block, the inference-path forward with labels x[a+k],
    weights exp(-(k-1)/gamma), and slots whose label is outside the loss mask left out."""
    drafter, embed, head = make_parts()
    ids, hidden = batch()
    loss_mask = torch.zeros(2, T, dtype=torch.bool)
    loss_mask[0, 5:] = True
    loss_mask[1, 10:27] = True  # the response ends at 26: later labels are not supervised
    anchors = torch.tensor([[5, 6, 20, 34], [10, 18, 23, 0]])
    keep = torch.tensor([[True, True, True, True], [True, True, True, False]])
    out = dflash_loss(drafter, embed, head, ids, hidden, loss_mask, anchors=(anchors, keep), attn_backend="sdpa")

    gamma = drafter.config.gamma
    num = den = 0.0
    count = 0
    for b in range(2):
        for n in range(4):
            if not keep[b, n]:
                continue
            a = int(anchors[b, n])
            logits = head(block_alone(drafter, embed, ids[b], hidden[b], a))
            for k in range(1, B):
                if not loss_mask[b, a + k]:
                    continue
                w = math.exp(-(k - 1) / gamma)
                num += w * F.cross_entropy(logits[k][None], ids[b, a + k][None]).item()
                den += w
                count += 1
    assert out.num_tokens == count
    assert out.loss.item() == pytest.approx(num / den, rel=1e-6)  # CE runs in float32
    assert out.num_blocks == 7


def test_context_at_or_after_the_anchor_does_not_reach_the_block():
    drafter, embed, head = make_parts()
    ids, hidden = batch()
    anchors = torch.tensor([[12, 25], [3, 30]])
    base = forward_blocks(drafter, embed, ids, hidden, anchors, attn_backend="sdpa")
    for b, n in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        a = int(anchors[b, n])
        changed = hidden.clone()
        changed[b, a:] += torch.randn_like(changed[b, a:]) * 5  # at and after the anchor
        out = forward_blocks(drafter, embed, ids, changed, anchors, attn_backend="sdpa")
        torch.testing.assert_close(out[b, n], base[b, n], rtol=0, atol=1e-12)
        # ... while the position just before the anchor does reach it (the test can fail).
        changed = hidden.clone()
        changed[b, a - 1] += 5
        out = forward_blocks(drafter, embed, ids, changed, anchors, attn_backend="sdpa")
        assert (out[b, n] - base[b, n]).abs().max() > 1e-4


def test_a_block_never_sees_another_block():
    drafter, embed, head = make_parts()
    ids, hidden = batch(1)
    anchors = torch.tensor([[10, 12, 30]])  # blocks 0 and 1 overlap in position
    base = forward_blocks(drafter, embed, ids, hidden, anchors, attn_backend="sdpa")
    changed_ids = ids.clone()
    changed_ids[0, 12] = (ids[0, 12] + 1) % (V - 1)  # the anchor token of block 1 only
    out = forward_blocks(drafter, embed, changed_ids, hidden, anchors, attn_backend="sdpa")
    torch.testing.assert_close(out[0, 0], base[0, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[0, 2], base[0, 2], rtol=0, atol=1e-12)
    assert (out[0, 1] - base[0, 1]).abs().max() > 1e-4


def test_packed_blocks_equal_decoding_one_block_at_a_time():
    drafter, embed, head = make_parts(layers=3)
    ids, hidden = batch()
    anchors = torch.tensor([[1, 9, 20, 33], [0, 4, 15, 16]])
    packed = forward_blocks(drafter, embed, ids, hidden, anchors, attn_backend="sdpa")
    for b in range(2):
        for n in range(4):
            alone = block_alone(drafter, embed, ids[b], hidden[b], int(anchors[b, n]))
            torch.testing.assert_close(packed[b, n], alone, rtol=1e-9, atol=1e-10)


def test_mask_layout():
    m = block_attention_mask(torch.tensor([[2, 3]]), 2, 5)[0, 0].int()
    assert m.tolist() == [
        # ctx 0..4      | block0 | block1
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 1],
        [1, 1, 1, 0, 0, 0, 0, 1, 1],
    ]


def test_padded_context_is_hidden_by_attention_mask():
    drafter, embed, head = make_parts()
    ids, hidden = batch(1)
    attn = torch.ones(1, T, dtype=torch.long)
    attn[0, :4] = 0  # left padding
    anchors = torch.tensor([[10]])
    base = forward_blocks(drafter, embed, ids, hidden, anchors, attention_mask=attn, attn_backend="sdpa")
    changed = hidden.clone()
    changed[0, :4] += 3
    out = forward_blocks(drafter, embed, ids, changed, anchors, attention_mask=attn, attn_backend="sdpa")
    torch.testing.assert_close(out, base, rtol=0, atol=1e-12)


def test_anchor_sampling_respects_loss_mask_block_fit_and_count():
    loss_mask = torch.zeros(3, T, dtype=torch.bool)
    loss_mask[0, 10:] = True  # valid anchors 10..T-B
    loss_mask[1, 2:5] = True  # a short response: 3 anchors only
    g = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(loss_mask, B, num_anchors=8, generator=g)
    assert anchors.shape == (3, 8)
    assert keep.sum(1).tolist() == [8, 3, 0]
    a0 = anchors[0][keep[0]].tolist()
    assert a0 == sorted(set(a0)) and all(10 <= a <= T - B for a in a0)
    assert anchors[1][keep[1]].tolist() == [2, 3, 4]
    # The last valid anchor leaves room for a full block; one more would not.
    lm = torch.zeros(1, T, dtype=torch.bool)
    lm[0, T - B:] = True
    anchors, keep = sample_anchors(lm, B, num_anchors=8)
    assert anchors[keep].tolist() == [T - B]
    # Same generator seed, same anchors.
    a1, _ = sample_anchors(loss_mask, B, 8, torch.Generator().manual_seed(5))
    a2, _ = sample_anchors(loss_mask, B, 8, torch.Generator().manual_seed(5))
    assert torch.equal(a1, a2)


def test_gradients_reach_every_drafter_parameter_and_nothing_frozen():
    drafter, embed, head = make_parts()
    ids, hidden = batch()
    loss_mask = torch.ones(2, T, dtype=torch.bool)
    out = dflash_loss(drafter, embed, head, ids, hidden, loss_mask, num_anchors=4,
                      generator=torch.Generator().manual_seed(0), attn_backend="sdpa")
    out.loss.backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert embed.weight.grad is None and head.weight.grad is None
    assert len(out.per_position_acc) == B - 1
    assert out.sim_tau == pytest.approx(1 + sum(math.prod(out.per_position_acc[: k + 1]) for k in range(B - 1)))
    assert 1.0 <= out.block_tau <= B and 0.0 <= out.accuracy <= 1.0


def test_no_valid_anchor_gives_zero_loss_that_backpropagates():
    drafter, embed, head = make_parts()
    ids, hidden = batch()
    out = dflash_loss(drafter, embed, head, ids, hidden, torch.zeros(2, T, dtype=torch.bool))
    assert out.num_tokens == 0 and out.loss.item() == 0.0
    out.loss.backward()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_path_equals_sdpa_path():
    """FlexAttention runs (uncompiled, forward only) on CPU in this torch: prove its mask equals ours."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    assert flex is not None
    drafter, embed, head = make_parts()
    drafter.float()
    embed.float()
    ids, hidden = batch()
    hidden = hidden.float()
    attn = torch.ones(2, T, dtype=torch.long)
    attn[1, :2] = 0
    anchors = torch.tensor([[3, 9, 20, 33, 34], [2, 4, 5, 18, 30]])
    with torch.no_grad():
        ref = forward_blocks(drafter, embed, ids, hidden, anchors, attention_mask=attn, attn_backend="sdpa")
        out = forward_blocks(drafter, embed, ids, hidden, anchors, attention_mask=attn, attn_backend="flex")
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_chunked_head_rows_equal_plain_autograd():
    torch.manual_seed(0)
    head = torch.nn.Linear(H, V, bias=False).double().requires_grad_(False)
    h = torch.randn(11, H, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (11,))
    def loss(logits, rows, _ref):
        ce = F.cross_entropy(logits, y[rows], reduction="none")
        return ce, {"pred": logits.argmax(-1)}

    ce, extras = head_rows(head, h, loss, chunk=4)
    pred = extras["pred"]
    (ce * torch.arange(11)).sum().backward()
    g_chunked = h.grad.clone()
    h.grad = None
    logits = head(h).float()
    ref = F.cross_entropy(logits, y, reduction="none")
    (ref * torch.arange(11)).sum().backward()
    torch.testing.assert_close(ce, ref)
    assert torch.equal(pred, logits.argmax(-1))
    torch.testing.assert_close(h.grad, g_chunked)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_mixed_precision_autocast_runs_both_attention_paths():
    """Training on CUDA runs under bf16 autocast with float32 weights; the CPU autocast stands in for it
    here: q/k/v dtypes must agree for the attention kernels, and both paths must agree."""
    drafter, embed, head = make_parts()
    drafter.float()
    embed.float()
    ids, hidden = batch()
    anchors = torch.tensor([[3, 20], [5, 30]])
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        ref = forward_blocks(drafter, embed, ids, hidden.float(), anchors, attn_backend="sdpa")
        out = forward_blocks(drafter, embed, ids, hidden.float(), anchors, attn_backend="flex")
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled FlexAttention with backward)")
def test_cuda_flex_equals_sdpa_forward_and_backward():
    drafter, embed, head = make_parts()
    drafter, embed, head = drafter.float().cuda(), embed.float().cuda(), head.float().cuda()
    ids, hidden = batch()
    ids, hidden = ids.cuda(), hidden.float().cuda()
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    anchors = (torch.tensor([[3, 9, 20, 33], [2, 5, 18, 30]]).cuda(), torch.ones(2, 4, dtype=torch.bool).cuda())
    grads = {}
    for backend in ("sdpa", "flex"):
        drafter.zero_grad()
        with torch.autocast("cuda", torch.bfloat16):
            out = dflash_loss(drafter, embed, head, ids, hidden, loss_mask, anchors=anchors, attn_backend=backend)
        out.loss.backward()
        grads[backend] = (out.loss.item(), [p.grad.float().clone() for p in drafter.parameters()])
    assert grads["flex"][0] == pytest.approx(grads["sdpa"][0], rel=2e-2)
    for a, b in zip(grads["flex"][1], grads["sdpa"][1], strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-3)


def test_step_metrics_summed_on_the_device_equal_the_pooled_figures():
    """The trainer adds each step's device-side stats to a running sum and reads it once per interval:
    that read must give the mean loss and the acceptance figures pooled over every supervised slot."""
    from dflash.model.blocks import metrics_of
    from dflash.train.device.metrics import StepMetrics

    drafter, embed, head = make_parts()
    acc, outs = StepMetrics(), []
    for seed in (1, 2, 3):
        ids, hidden = batch(seed=seed)
        loss_mask = torch.ones(2, T, dtype=torch.bool)
        loss_mask[1, 25:] = False
        out = dflash_loss(drafter, embed, head, ids, hidden, loss_mask, num_anchors=5,
                          generator=torch.Generator().manual_seed(seed), attn_backend="sdpa")
        acc.add(out.stats, torch.tensor(0.5 * seed), out.per_position_count, out.num_blocks, out.term_names)
        outs.append(out)
    t = acc.collect()
    assert acc.collect() is None  # taken: the next interval starts from zero
    s = t.summary()
    assert t.steps == 3 and s["loss"] == pytest.approx(sum(o.loss.item() for o in outs) / 3)
    assert s["grad_norm"] == pytest.approx(1.0)
    counts = [sum(c) for c in zip(*(o.per_position_count for o in outs), strict=True)]
    correct = [sum(o.per_position_acc[k] * o.per_position_count[k] for o in outs) for k in range(B - 1)]
    runs = sum((o.block_tau - 1) * o.num_blocks for o in outs)
    ref = metrics_of(runs, correct, counts, sum(o.num_blocks for o in outs))
    for key in ("accuracy", "sim_tau", "block_tau"):
        assert s[key] == pytest.approx(ref[key]), key
    assert s["per_position_acc"] == pytest.approx(ref["per_position_acc"])
    assert s["supervised_tokens"] == sum(o.num_tokens for o in outs) > 0
    assert s["terms"] == {"ce": pytest.approx(sum(o.terms()["ce"] for o in outs) / 3)}
