"""The packed-block mask: the block-sparse form (CUDA) equals the dense one (CPU) tile for tile and
entry for entry, is built at the recipe's size without any Q x KV intermediate, and compiled
FlexAttention under it equals SDPA under the dense mask, compiling a bounded number of times."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.model import masks
from dflash.model.masks import block_attention_mask, flex_block_mask, flex_or_sdpa


def _cases():
    """Small layouts covering block sizes that do and do not divide the tile, right padding, several
    anchors sharing a tile, anchors exactly on a tile boundary and one block per tile or less."""
    g = torch.Generator().manual_seed(0)
    for i in range(30):
        tile = (4, 8, 16)[i % 3]
        bs = (2, 3, 4, 6, 8)[i % 5]
        t = int(torch.randint(bs + 1, 70, (), generator=g))
        n = int(torch.randint(1, 10, (), generator=g))
        anchors = torch.randint(0, t - bs + 1, (2, n), generator=g).sort(-1).values
        if i % 4 == 0 and t - bs >= tile:
            anchors[0, 0] = tile  # context tile 0 fully visible, tile 1 not at all
        if i % 5 == 1 and n > 1:
            anchors[1, n // 2:] = -1  # padding blocks (a row with fewer anchors): see nothing of the context
        valid = None
        if i % 2:
            valid = torch.ones(2, t, dtype=torch.long)
            valid[1, t - int(torch.randint(1, t // 2 + 1, (), generator=g)):] = 0
        yield tile, bs, t, anchors, valid


def _padded_reference(anchors, bs, t, valid, lengths):
    dense = block_attention_mask(anchors, bs, t, valid)
    q_pad, kv_pad = lengths
    return F.pad(dense, (0, kv_pad - dense.shape[-1], 0, q_pad - dense.shape[-2]))


def _materialise(bm) -> torch.Tensor:
    """Dense mask as the kernel sees it: full tiles all visible, partial tiles as mask_mod says,
    every other tile skipped."""
    q_pad, kv_pad = bm.seq_lengths
    qt, kt = bm.BLOCK_SIZE
    bsz = bm.kv_num_blocks.shape[0]

    def tiles(num, idx):
        grid = torch.zeros(bsz, 1, q_pad // qt, kv_pad // kt, dtype=torch.bool)
        for b in range(bsz):
            for r in range(grid.shape[2]):
                grid[b, 0, r, idx[b, 0, r, : num[b, 0, r]].long()] = True
        return grid.repeat_interleave(qt, 2).repeat_interleave(kt, 3)

    partial = tiles(bm.kv_num_blocks, bm.kv_indices)
    full = tiles(bm.full_kv_num_blocks, bm.full_kv_indices)
    assert not (partial & full).any()
    return full | (partial & create_mask(bm.mask_mod, bsz, None, q_pad, kv_pad, "cpu"))


def test_block_mask_equals_dense_reference_tile_for_tile():
    for tile, bs, t, anchors, valid in _cases():
        bm = flex_block_mask(anchors, bs, t, valid, tile=tile)
        ref = _padded_reference(anchors, bs, t, valid, bm.seq_lengths)
        # the same tiles as torch's own derivation from the dense mask ...
        want = create_block_mask(lambda b, h, q, k, ref=ref: ref[b, 0, q, k], 2, None, *bm.seq_lengths,
                                 device="cpu", BLOCK_SIZE=tile)
        case = (tile, bs, t, anchors.tolist(), valid is not None)
        assert torch.equal(bm.kv_num_blocks, want.kv_num_blocks), case
        assert torch.equal(bm.full_kv_num_blocks, want.full_kv_num_blocks), case
        assert torch.equal(bm.to_dense(), want.to_dense()), case
        # ... and entry for entry, with partial tiles resolved by the mask_mod
        assert torch.equal(_materialise(bm), ref), case


# aten ops that read a tensor's value on the host (or size an output by it): a sync on CUDA
_SYNCING = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "_unique2", "repeat_interleave.Tensor"}


class _LargestOutput(TorchDispatchMode):
    """Records the element count of every tensor any aten op produces, and every op that syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op = 0, None
        self.syncing: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if (name in _SYNCING or name.split(".")[0] in _SYNCING) and "output_size" not in (kwargs or {}):
            self.syncing.append(name)
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.numel() > self.largest:
                self.largest, self.op = o.numel(), str(func)
        return out


def test_recipe_size_mask_has_no_q_by_kv_intermediate():
    """512 anchors x block 16 over 4096 tokens: Q x KV is 100M entries per sequence. The block mask's
    metadata must stay near Q + KV; the dense mask (what the CUDA path used to build, and what
    create_block_mask evaluates) is shown to hit Q x KV under the same recorder."""
    n, bs, t = 512, 16, 4096
    q, kv = n * bs, t + n * bs
    g = torch.Generator().manual_seed(0)
    anchors = torch.randperm(t - bs, generator=g)[:n].sort().values.expand(2, n).contiguous()
    valid = torch.ones(2, t, dtype=torch.long)
    valid[1, 3000:] = 0
    flex_block_mask(anchors, bs, t, valid)  # warm-up (lazy imports)
    with _LargestOutput() as rec:
        bm = flex_block_mask(anchors, bs, t, valid)
    t0 = time.perf_counter()
    flex_block_mask(anchors, bs, t, valid)
    build_s = time.perf_counter() - t0
    assert bm.seq_lengths == (q, kv)
    assert rec.largest <= 2 * kv, (rec.largest, rec.op)  # the key lookup table is the biggest
    assert rec.syncing == [], rec.syncing  # nothing that would wait for the GPU
    with _LargestOutput() as dense:
        block_attention_mask(anchors[:, :64], bs, t, valid)  # an eighth of the anchors is enough
        valid.bool().nonzero()  # (the recorder sees a syncing op)
    assert dense.largest >= 2 * 64 * bs * (t + 64 * bs)
    assert dense.syncing == ["nonzero.default"]
    print(f"recipe-size mask: largest intermediate {rec.largest} elements (dense mask: {2 * q * kv}), "
          f"built in {build_s * 1e3:.1f} ms on CPU")
    assert build_s < 5.0


def test_compiled_flex_on_cpu_equals_sdpa_and_compiles_at_most_twice():
    """torch compiles FlexAttention for CPU too (forward only): under the block mask it must equal SDPA
    under the dense mask, and varying anchor counts and lengths must not recompile per shape."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    bs, heads, kv_heads, d = 4, 4, 2, 16
    # (Shapes whose padded key length is 2 tiles are avoided: torch 2.13's CPU code generator
    # miscompiles dynamic flex there; CUDA uses other kernels, and the SDPA fallback covers it.)
    for n, t in [(4, 300), (70, 300), (17, 411)]:  # the second changes every tile count
        anchors = torch.randint(0, t - bs + 1, (2, n)).sort(-1).values
        valid = torch.ones(2, t, dtype=torch.long)
        valid[1, t - 7:] = 0
        q = torch.randn(2, heads, n * bs, d)
        k, v = torch.randn(2, kv_heads, t + n * bs, d), torch.randn(2, kv_heads, t + n * bs, d)
        with warnings.catch_warnings():
            # a fallback to SDPA would be a silent pass otherwise
            warnings.filterwarnings("error", message="compiled FlexAttention failed")
            out = flex_or_sdpa(q, k, v, flex_block_mask(anchors, bs, t, valid), compiled=True)
        dense = block_attention_mask(anchors, bs, t, valid)
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


def test_failed_compiled_flex_falls_back_to_sdpa_with_one_warning(monkeypatch: pytest.MonkeyPatch):
    """A real failure: torch's compiled flex has no backward on CPU. Training must go on with SDPA
    (same numbers, gradients flowing) after exactly one warning."""
    monkeypatch.setattr(masks, "_flex_failed", None)
    bs, t, n = 4, 30, 3
    anchors = torch.tensor([[0, 9, 20], [3, 4, 25]])
    bm = flex_block_mask(anchors, bs, t)
    dense = block_attention_mask(anchors, bs, t)
    q = torch.randn(2, 2, n * bs, 8, requires_grad=True)
    k, v = torch.randn(2, 2, t + n * bs, 8), torch.randn(2, 2, t + n * bs, 8)
    with pytest.warns(RuntimeWarning, match="compiled FlexAttention failed"):
        out = flex_or_sdpa(q, k, v, bm, compiled=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=dense))
    out.sum().backward()
    assert q.grad is not None and q.grad.abs().sum() > 0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="compiled FlexAttention failed")
        again = flex_or_sdpa(q, k, v, bm, compiled=True)
    torch.testing.assert_close(again, out)
    assert masks._flex_failed and "backward" in masks._flex_failed


def test_a_compiled_flex_whose_backward_fails_falls_back_to_sdpa_in_that_backward(monkeypatch: pytest.MonkeyPatch):
    """With dynamic shapes torch compiles flex's backward lazily, at the first backward; a failure there
    (no GPU here, so a compiled stand-in with a working forward raises it) must not end the step: its
    gradients come from SDPA, after one warning, and every later call runs SDPA."""
    from torch.nn.attention.flex_attention import flex_attention

    class BackwardFails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, out, *inputs):
            return out.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("compiling the backward graph failed (stand-in)")

    def compiled_stand_in(q, k, v, block_mask, enable_gqa):
        out = flex_attention(q.detach(), k.detach(), v.detach(), block_mask=block_mask, enable_gqa=enable_gqa)
        return BackwardFails.apply(out, q, k, v)

    monkeypatch.setattr(masks, "_flex_failed", None)
    monkeypatch.setattr(masks, "compiled_flex", lambda: compiled_stand_in)
    torch.manual_seed(0)
    bs, t, n = 4, 30, 3
    anchors = torch.tensor([[0, 9, 20], [3, 4, 25]])
    bm = flex_block_mask(anchors, bs, t)
    dense = block_attention_mask(anchors, bs, t)
    q = torch.randn(2, 4, n * bs, 8, requires_grad=True)
    k = torch.randn(2, 2, t + n * bs, 8, requires_grad=True)
    v = torch.randn(2, 2, t + n * bs, 8)  # one input without a gradient
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="compiled FlexAttention failed")
        out = flex_or_sdpa(q, k, v, bm, compiled=True)  # the forward compiles and runs
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=dense)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(out)
    with pytest.warns(RuntimeWarning, match="compiled FlexAttention failed"):
        out.backward(g)
    dq, dk = torch.autograd.grad(ref, (q, k), g)
    torch.testing.assert_close(q.grad, dq, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(k.grad, dk, rtol=1e-4, atol=1e-5)
    assert "compiling the backward graph failed" in masks._flex_failed
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="compiled FlexAttention failed")
        again = flex_or_sdpa(q, k, v, bm, compiled=True)
    torch.testing.assert_close(again, ref)
    assert again.grad_fn is not None and "Flex" not in type(again.grad_fn).__name__
