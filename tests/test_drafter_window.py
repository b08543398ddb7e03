"""Sliding-window drafter layers: what a block query sees, in training (dense and tile-sparse masks) and
in decoding (the incremental cache), against a reference built here position by position.

The reference is the engines' rule written out with loops: slot s of the block at anchor a sits at
p = a+s and, in a sliding layer with window W, sees a key at position k iff k <= p and k > p-W, on top
of DFlash's own rule (valid context strictly before the anchor, its own block, no other block).
"""

from __future__ import annotations

import pytest
import torch
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)
from test_model_masks import _LargestOutput, _materialise
from torch.nn.attention.flex_attention import create_block_mask

from dflash.model.blocks import forward_blocks
from dflash.model.drafter import FULL, SLIDING, DFlashDrafter, DrafterConfig
from dflash.model.masks import block_attention_mask, flex_block_mask


def reference_mask(anchors, bs, t, valid, window, lengths=None) -> torch.Tensor:
    """[Bsz, 1, Q(+pad), KV(+pad)] from the rule above, one entry at a time."""
    bsz, n = anchors.shape
    q_len, kv_len = lengths or (n * bs, t + n * bs)
    out = torch.zeros(bsz, 1, q_len, kv_len, dtype=torch.bool)
    for b in range(bsz):
        for blk in range(n):
            a = int(anchors[b, blk])
            for s in range(bs):
                p = a + s

                def in_window(k, p=p):
                    return window is None or (k <= p and k > p - window)

                for j in range(t):
                    ok = j < a and (valid is None or bool(valid[b, j]))
                    out[b, 0, blk * bs + s, j] = ok and in_window(j)
                for u in range(bs):  # the block's own keys, at positions a+u
                    out[b, 0, blk * bs + s, t + blk * bs + u] = in_window(a + u)
    return out


def _cases():
    """Tiles of 4/8/16, blocks that do and do not divide them, windows of one position, below a block,
    below / at / above a tile, and above the whole context; anchors on tile edges; padded context."""
    g = torch.Generator().manual_seed(1)
    for i in range(24):
        tile = (4, 8, 16)[i % 3]
        bs = (2, 3, 4, 6)[i % 4]
        t = int(torch.randint(bs + 2, 48, (), generator=g))
        window = (1, 2, bs - 1, bs + 1, tile - 1, tile, tile + 1, 2 * tile + 3, t + 5)[i % 9]
        n = int(torch.randint(1, 7, (), generator=g))
        anchors = torch.randint(0, t - bs + 1, (2, n), generator=g).sort(-1).values
        if t - bs >= tile:
            anchors[0, 0] = tile  # anchor exactly on a tile edge
        valid = None
        if i % 2:
            valid = torch.ones(2, t, dtype=torch.long)
            valid[1, t - int(torch.randint(1, t // 2 + 1, (), generator=g)):] = 0
        yield tile, bs, t, max(1, window), anchors, valid


def test_dense_training_mask_is_the_window_rule():
    for tile, bs, t, w, anchors, valid in _cases():
        assert torch.equal(block_attention_mask(anchors, bs, t, valid, window=w),
                           reference_mask(anchors, bs, t, valid, w)), (tile, bs, t, w, anchors.tolist())
    anchors = torch.tensor([[3, 9]])
    assert torch.equal(block_attention_mask(anchors, 4, 14), reference_mask(anchors, 4, 14, None, None))


def test_tile_mask_is_the_window_rule_and_skips_tiles_outside_it():
    """Entry for entry the rule; full tiles exactly torch's own derivation from the dense mask; every tile
    torch would visit is visited, and for sorted, dense anchors no other."""
    for tile, bs, t, w, anchors, valid in _cases():
        case = (tile, bs, t, w, anchors.tolist(), valid is not None)
        bm = flex_block_mask(anchors, bs, t, valid, tile=tile, window=w)
        ref = reference_mask(anchors, bs, t, valid, w, bm.seq_lengths)
        assert torch.equal(_materialise(bm), ref), case
        want = create_block_mask(lambda b, h, q, k, ref=ref: ref[b, 0, q, k], 2, None, *bm.seq_lengths,
                                 device="cpu", BLOCK_SIZE=tile)
        assert torch.equal(bm.full_kv_num_blocks, want.full_kv_num_blocks), case
        visited, needed = bm.to_dense().bool(), want.to_dense().bool()
        assert not (needed & ~visited).any(), case
    # one anchor every other position (the recipe's density): exactly the tiles torch would visit
    anchors = torch.arange(0, 120, 2)[None].expand(2, -1).contiguous()
    for w in (3, 8, 40):
        bm = flex_block_mask(anchors, 4, 128, tile=16, window=w)
        ref = reference_mask(anchors, 4, 128, None, w, bm.seq_lengths)
        want = create_block_mask(lambda b, h, q, k, ref=ref: ref[b, 0, q, k], 2, None, *bm.seq_lengths,
                                 device="cpu", BLOCK_SIZE=16)
        assert torch.equal(bm.to_dense(), want.to_dense()), w
        assert bm.to_dense().sum() < flex_block_mask(anchors, 4, 128, tile=16).to_dense().sum()


def _config(layer_types, window, **kw) -> DrafterConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_layers=len(layer_types), num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=50, num_target_layers=8, target_layer_ids=[1, 5],
                mask_token_id=49, block_size=4, layer_types=layer_types, sliding_window=window)
    base.update(kw)
    return DrafterConfig(**base)


def _reference_decode_mask(q_pos: list[int], k_pos: list[int], window: int | None) -> torch.Tensor:
    return torch.tensor([[window is None or (k <= p and k > p - window) for k in k_pos] for p in q_pos])[None, None]


@pytest.mark.parametrize("window", [1, 3, 4, 6, 64])
def test_decoding_cache_sees_the_window_and_keeps_only_what_it_can_see_again(window):
    """Rounds of decoding through the cache equal one pass over the whole context under the reference
    mask; a sliding layer's cache holds at most W-1 positions, a full layer's all of them. Windows
    below, at and above the block (4), and one longer than the context."""
    torch.manual_seed(0)
    cfg = _config([SLIDING, FULL, SLIDING], window)
    d = DFlashDrafter(cfg).double().eval()
    ctx = torch.randn(1, 30, 64, dtype=torch.float64)
    cache, fed = d.new_cache(), 0
    for anchor in (9, 10, 15, 22, 29):  # accepted runs of 0, 4, 6 and 6 tokens
        block = torch.randn(1, 4, 32, dtype=torch.float64)
        pos = torch.arange(anchor, anchor + 4)[None]
        inc = d(block, ctx[:, fed:anchor], pos, torch.arange(fed, anchor)[None], cache=cache)
        fed = anchor
        k_pos = list(range(anchor)) + pos[0].tolist()
        masks = {SLIDING: _reference_decode_mask(pos[0].tolist(), k_pos, window),
                 FULL: _reference_decode_mask(pos[0].tolist(), k_pos, None)}
        whole = d(block, ctx[:, :anchor], pos, torch.arange(anchor)[None], masks)
        torch.testing.assert_close(inc, whole, rtol=1e-10, atol=1e-12)
        kept = [c[0].positions[0].tolist() for c in cache]
        assert kept[1] == list(range(anchor))
        for sliding in (kept[0], kept[2]):
            assert sliding == list(range(max(0, anchor - window + 1), anchor))


@pytest.mark.parametrize("window", [2, 5, 16, 100])
def test_training_blocks_see_what_decoding_shows_the_drafter(window):
    """A packed training pass (dense SDPA masks, one per layer type) gives each block exactly the hidden
    states the decoding path computes for that anchor from the context before it."""
    torch.manual_seed(1)
    cfg = _config([SLIDING, FULL], window, block_size=5)
    d = DFlashDrafter(cfg).double().eval()
    embed = torch.nn.Embedding(50, 32).double()
    t = 40
    ids = torch.randint(0, 48, (1, t))
    hidden = torch.randn(1, t, 64, dtype=torch.float64)
    anchors = torch.tensor([[0, 3, 17, 18, 30, 35]])
    packed = forward_blocks(d, embed, ids, hidden, anchors, attn_backend="sdpa")
    for n, a in enumerate(anchors[0].tolist()):
        block = torch.full((1, 5), cfg.mask_token_id)
        block[0, 0] = ids[0, a]
        one = d(embed(block), hidden[:, :a], torch.arange(a, a + 5)[None], torch.arange(a)[None])
        torch.testing.assert_close(packed[:, n], one, rtol=1e-9, atol=1e-11)


def test_layer_settings_are_checked():
    with pytest.raises(ValueError, match="sliding_window of at least 1"):
        _config([SLIDING], None)
    with pytest.raises(ValueError, match="not one of"):
        _config(["chunked_attention"], 8)
    with pytest.raises(ValueError, match="2 entries for 3"):
        _config([FULL, SLIDING], 8, num_layers=3)
    assert _config([FULL, SLIDING], 8).describe_layers() == "2 layers, 1 sliding (window 8)"


def test_flex_attention_under_the_window_equals_sdpa():
    """The tile-sparse masks drive FlexAttention (uncompiled on CPU) to SDPA's result under the dense ones."""
    torch.manual_seed(2)
    cfg = _config([SLIDING, FULL, SLIDING], 6, block_size=4)
    d = DFlashDrafter(cfg).double().eval()
    embed = torch.nn.Embedding(50, 32).double()
    ids = torch.randint(0, 48, (2, 70))
    hidden = torch.randn(2, 70, 64, dtype=torch.float64)
    anchors = torch.tensor([[0, 5, 31, 33, 60], [2, 3, 40, 41, 66]])
    with torch.no_grad():
        sdpa = forward_blocks(d, embed, ids, hidden, anchors, attn_backend="sdpa")
        flex = forward_blocks(d, embed, ids, hidden, anchors, attn_backend="flex")
    torch.testing.assert_close(flex, sdpa, rtol=1e-9, atol=1e-11)


def test_recipe_size_window_mask_has_no_q_by_kv_intermediate_and_no_sync():
    """512 anchors x block 16 over 4096 tokens with the reference's 2048 window: the build stays near
    Q + KV elements (the key tables are the biggest), reads nothing back, and visits fewer tiles."""
    n, bs, t = 512, 16, 4096
    kv = t + n * bs
    g = torch.Generator().manual_seed(0)
    anchors = torch.randperm(t - bs, generator=g)[:n].sort().values.expand(2, n).contiguous()
    valid = torch.ones(2, t, dtype=torch.long)
    valid[1, 3000:] = 0
    flex_block_mask(anchors, bs, t, valid, window=2048)  # warm-up (lazy imports)
    with _LargestOutput() as rec:
        bm = flex_block_mask(anchors, bs, t, valid, window=2048)
    assert rec.largest <= 2 * kv, (rec.largest, rec.op)
    assert rec.syncing == [], rec.syncing
    assert bm.to_dense().sum() < flex_block_mask(anchors, bs, t, valid).to_dense().sum()


def test_the_sdpa_fallback_keeps_one_dense_mask_per_kind_of_layer(monkeypatch):
    """After compiled flex has failed, layers alternating full and sliding masks each get their own
    dense mask, built once per forward, not once per layer."""
    import torch.nn.attention.flex_attention as fa
    import torch.nn.functional as F

    from dflash.model import masks

    monkeypatch.setattr(masks, "_flex_failed", "failed before")
    built = []
    real = fa.create_mask
    monkeypatch.setattr(fa, "create_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    anchors, bs, t = torch.tensor([[0, 9, 20], [3, 4, 25]]), 4, 30
    q, k, v = torch.randn(2, 2, 12, 8), torch.randn(2, 2, t + 12, 8), torch.randn(2, 2, t + 12, 8)
    kinds = [(flex_block_mask(anchors, bs, t, window=w), block_attention_mask(anchors, bs, t, window=w))
             for w in (None, 5)]
    for _layer in range(3):
        for bm, dense in kinds:
            out = masks.flex_or_sdpa(q, k, v, bm, compiled=True)
            torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=dense))
    assert len(built) == 2


def test_compiled_flex_under_both_kinds_equals_sdpa_and_compiles_at_most_twice_per_kind():
    """Compiled FlexAttention on CPU (forward only), layers alternating the full and the windowed mask
    as a mixed drafter's forward does: each equals SDPA under its dense mask, and varying anchor counts
    and lengths compile at most two graphs per kind (the window is a constant of its mask_mod)."""
    import warnings

    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from dflash.model.masks import flex_or_sdpa

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    bs = 4
    for n, t in [(4, 300), (70, 300), (17, 411)]:  # (padded key lengths of 2 tiles avoided: see test_model_masks)
        anchors = torch.randint(0, t - bs + 1, (2, n)).sort(-1).values
        valid = torch.ones(2, t, dtype=torch.long)
        valid[1, t - 7:] = 0
        q = torch.randn(2, 4, n * bs, 16)
        k, v = torch.randn(2, 2, t + n * bs, 16), torch.randn(2, 2, t + n * bs, 16)
        for window in (None, 64):
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message="compiled FlexAttention failed")
                out = flex_or_sdpa(q, k, v, flex_block_mask(anchors, bs, t, valid, window=window), compiled=True)
            dense = block_attention_mask(anchors, bs, t, valid, window=window)
            ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                 attn_mask=dense)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert 2 <= counters["stats"]["unique_graphs"] <= 4, dict(counters["stats"])
