"""The packed-block attention mask, in two forms: dense (SDPA, CPU) and block-sparse (FlexAttention, CUDA).

Layout (see blocks.py): queries are the N*B slots of N packed blocks; keys are ``[T context positions ;
N*B block slots]``. Query slot of block n sees context position j iff ``j < anchors[n]`` (and
``ctx_valid[j]``), and the block keys of block n itself; nothing of any other block.

Sliding-window layers (``window`` W) see what vLLM and SGLang compute when they serve such a drafter:
the layer runs as a *causal* window of W positions, its own included (SGLang's ``window_left = W-1``,
vLLM's ``(W-1, 0)``). Slot s of the block at anchor a sits at position p = a+s and sees, of the above,
only the keys at positions p-W+1 .. p: context positions a+s-W+1 .. a-1 and the block's slots
max(0, s-W+1) .. s. For W=4, B=4, anchor a (``#`` seen, ``.`` not, ``-`` never: after the anchor)::

    key position   a-4 a-3 a-2 a-1 | a  a+1 a+2 a+3
    slot 0 (a)      .   #   #   #  | #   -   -   -
    slot 1 (a+1)    .   .   #   #  | #   #   -   -
    slot 2 (a+2)    .   .   .   #  | #   #   #   -
    slot 3 (a+3)    .   .   .   .  | .   #   #   #

Full-attention layers keep the bidirectional block above. (The reference's transformers code passes
``sliding_window`` to flash-attention as a symmetric, non-causal window and its SDPA path ignores it:
neither is what the engines serve.) A context shorter than the window changes nothing: the window
only ever hides positions, never adds any.

At the recipe's size (512 anchors x block 16 over 4096 tokens) the dense mask has Q x KV = 8192 x 12288
= 100M entries per sequence (and SDPA's float bias from it is 4x that), rebuilt every step. The CUDA
path therefore never builds it: ``flex_block_mask`` derives FlexAttention's tile metadata (which
128 x 128 tiles are empty, partial or fully visible) arithmetically from the anchors, in O(Q + KV)
per-position tensors plus O(Q/128 x KV/128) tile tensors, and the partial tiles are resolved in the
kernel by a ``mask_mod`` that reads two O(Q + KV) lookup tables. ``block_attention_mask`` (dense) stays
for the CPU path, where sequences are tiny and SDPA is the fast kernel.

Compilation: ``flex_attention`` is compiled with dynamic shapes (``compiled_flex``), q/k/v padded to
whole tiles, and the ``mask_mod`` captures only tensors and the block size (no sequence length or
anchor count as a Python int), so new lengths and anchor counts reuse the graph: measured on CPU, at
most one recompilation (when a tile count that happened to equal another dimension stops doing so).
If compilation fails, attention falls back to SDPA with a dense mask evaluated from the same
``mask_mod``, with one warning.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

TILE = 128  # FlexAttention's default sparse block: the granularity at which empty tiles are skipped


def block_attention_mask(
    anchors: torch.Tensor, block_size: int, ctx_len: int, ctx_valid: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Dense boolean mask [Bsz, 1, N*B, ctx_len + N*B] (True = may attend): the CPU/SDPA form.

    ``window``: a sliding layer's W (see the module docstring), None for full attention. Allocates
    Q x KV booleans, which is fine at the CPU path's sizes and is exactly what the CUDA path avoids
    (see ``flex_block_mask``).
    """
    bsz, n = anchors.shape
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [Bsz, Q]
    ctx_pos = torch.arange(ctx_len, device=dev)[None, None, :]
    sees_ctx = ctx_pos < q_anchor[:, :, None]  # [Bsz, Q, T]
    if ctx_valid is not None:
        sees_ctx = sees_ctx & ctx_valid.bool()[:, None, :]
    block_of = torch.arange(n, device=dev).repeat_interleave(block_size)
    sees_block = (block_of[:, None] == block_of[None, :]).expand(bsz, -1, -1)  # [Bsz, Q, Q]
    if window is not None:
        slot = torch.arange(block_size, device=dev).repeat(n)
        sees_ctx = sees_ctx & (ctx_pos > (q_anchor + slot)[:, :, None] - window)
        lag = slot[:, None] - slot[None, :]  # query slot - key slot
        sees_block = sees_block & (lag >= 0) & (lag < window)
    return torch.cat([sees_ctx, sees_block], dim=-1)[:, None]


def _ceil(x: int, m: int) -> int:
    return -(-x // m)


def _tiles(q_len: int, kv_len: int, tile: int) -> tuple[int, int]:
    """Query and key tile counts, at least 2 each: a count of 1 is a size the compiler specialises on
    (and, on CPU, miscompiles), so short inputs get one empty padding tile instead."""
    return max(2, _ceil(q_len, tile)), max(2, _ceil(kv_len, tile))


def block_mask_mod(
    anchors: torch.Tensor, block_size: int, ctx_len: int, ctx_valid: torch.Tensor | None = None,
    tile: int = TILE, window: int | None = None,
) -> Callable:
    """The mask as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` reading two small lookup tables.

    ``key_code[b, k]``: for a context key its position (or ``ctx_len`` if padded, which no anchor
    exceeds), for block key k of block m ``-1 - m``. ``q_anchor[b, n]``: the anchor of block n. A query
    of block n then sees key k iff ``0 <= code < anchor[n]`` or ``code == -1 - n``. Both tables are
    padded to whole tiles so the kernel's out-of-range indices in a ragged last tile stay in bounds
    without a clamp (a clamp bound would be a Python int, recompiling per length). With a ``window``
    a third table, ``key_pos``, holds every key's position (a context key's own, block key t of block
    m at ``anchor[m] + t``) for the window test against the query's position.
    """
    bsz, n = anchors.shape
    dev = anchors.device
    q_len = n * block_size
    kv_len = ctx_len + q_len
    nq, nk = _tiles(q_len, kv_len, tile)
    kv_pad = nk * tile
    code = torch.full((bsz, kv_pad), ctx_len, dtype=torch.long, device=dev)
    pos = torch.arange(ctx_len, device=dev).expand(bsz, ctx_len)
    code[:, :ctx_len] = pos if ctx_valid is None else torch.where(ctx_valid.bool(), pos, ctx_len)
    code[:, ctx_len:kv_len] = -1 - torch.arange(n, device=dev).repeat_interleave(block_size)
    n_pad = _ceil(nq * tile, block_size)
    q_anchor = torch.full((bsz, n_pad), -1, dtype=torch.long, device=dev)
    q_anchor[:, :n] = anchors

    def mask_mod(b, h, q_idx, kv_idx):
        c = code[b, kv_idx]
        blk = q_idx // block_size
        return ((c >= 0) & (c < q_anchor[b, blk])) | (c == -1 - blk)

    if window is None:
        return mask_mod
    key_pos = torch.zeros((bsz, kv_pad), dtype=torch.long, device=dev)
    key_pos[:, :ctx_len] = torch.arange(ctx_len, device=dev)
    key_pos[:, ctx_len:kv_len] = (anchors.repeat_interleave(block_size, dim=1)
                                  + torch.arange(block_size, device=dev).repeat(n))

    def window_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        p = q_anchor[b, blk] + q_idx - blk * block_size
        k = key_pos[b, kv_idx]
        return mask_mod(b, h, q_idx, kv_idx) & (k <= p) & (k > p - window)

    return window_mod


def _ordered(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile grid [..., rows, cols] (bool) -> (count per row, column indices with the set ones first)."""
    g = grid.to(torch.int32)
    return g.sum(-1, dtype=torch.int32), torch.argsort(g, dim=-1, descending=True, stable=True).to(torch.int32)


def block_tiles(
    anchors: torch.Tensor, block_size: int, ctx_len: int, ctx_valid: torch.Tensor | None = None,
    tile: int = TILE, window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) bool grids [Bsz, 1, Q/tile, KV/tile] of the mask, computed from the anchors.

    A tile (query tile i, key tile j) is *full* when every query in it sees every key in it, *partial*
    when some but not all do (resolved by ``mask_mod`` in the kernel), else skipped. Every query sees
    an interval of context positions (those of them that are valid) and an interval of block keys:

        context  [lo, a)   a its anchor; lo = 0, or with a window a+s-W+1 (s its slot)
        block    [blo, bhi) in block-key index: its own block; with a window [max(block start, q-W+1), q+1)

    Block intervals only move forward with the query index, so a tile's queries reach exactly the
    union [blo(first), bhi(last)) and all see the intersection [blo(last), bhi(first)). A tile is full
    iff its key range lies inside what every query sees (largest lo, smallest anchor), so full tiles
    are exactly those ``create_block_mask`` derives from the dense mask (ragged last tiles are never
    full). Partial is exact without a window; with one a tile's context reach is taken as
    [smallest lo, largest anchor), which counts a key tile between two far-apart blocks of one query
    tile as partial (the kernel then skips it key by key): never wrong, and rare when anchors are dense.
    "Valid" questions over a key range are answered by a prefix count of ``ctx_valid``.
    """
    bsz, n = anchors.shape
    dev = anchors.device
    q_len = n * block_size
    kv_len = ctx_len + q_len
    nq, nk = _tiles(q_len, kv_len, tile)
    big = kv_len + 1

    # Per query: its context interval [lo, a); per query tile: the extremes over its real queries.
    q_anchor = anchors.repeat_interleave(block_size, dim=1)  # [Bsz, Q]
    slot = torch.arange(block_size, device=dev).repeat(n)
    lo = torch.zeros_like(q_anchor) if window is None else (q_anchor + slot - window + 1).clamp(min=0)
    sees = lo < q_anchor  # queries that see any context position at all
    pad = nq * tile - q_len

    def per_tile(x: torch.Tensor, fill: int, reduce: str) -> torch.Tensor:
        return getattr(F.pad(x, (0, pad), value=fill).view(bsz, nq, tile), reduce)(-1)

    a_min, a_max = per_tile(q_anchor, big, "amin"), per_tile(q_anchor, 0, "amax")
    lo_max, lo_min = per_tile(lo, 0, "amax"), per_tile(torch.where(sees, lo, big), big, "amin")

    # Per query tile: its first and last real query, and their block intervals.
    qi = torch.arange(nq, device=dev)
    q_first = qi * tile
    q_last = torch.clamp((qi + 1) * tile, max=q_len) - 1
    q_whole = ((qi + 1) * tile <= q_len)[:, None]

    def block_interval(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = q - q % block_size
        if window is None:
            return start, start + block_size
        return torch.maximum(start, q - window + 1), q + 1

    reach_lo, reach_hi = block_interval(q_first)[0], block_interval(q_last)[1]  # union over the tile
    all_lo, all_hi = block_interval(q_last)[0], block_interval(q_first)[1]  # seen by every query

    # Per key tile: its context part [ks, ke) and its block part [bs, be) (relative to the block keys).
    kj = torch.arange(nk, device=dev)
    k_lo, k_hi_raw = kj * tile, (kj + 1) * tile
    ks, ke = torch.clamp(k_lo, max=ctx_len), torch.clamp(k_hi_raw, max=ctx_len)
    bs = torch.clamp(k_lo, min=ctx_len, max=kv_len) - ctx_len
    be = torch.clamp(k_hi_raw, min=ctx_len, max=kv_len) - ctx_len
    has_ctx, has_blk = ke > ks, be > bs
    k_whole = (k_hi_raw <= kv_len)[None, :]

    # Context part: prefix counts of valid positions answer "any"/"all valid in a range" per tile pair.
    valid = torch.ones(bsz, ctx_len, dtype=torch.int32, device=dev) if ctx_valid is None else ctx_valid.to(torch.int32)
    cs = F.pad(valid.cumsum(-1, dtype=torch.int32), (1, 0))  # [Bsz, T+1]
    top = torch.minimum(ke[None, None, :], a_max[:, :, None])  # [Bsz, nq, nk] reachable ctx keys end here
    bottom = torch.clamp(torch.maximum(ks[None, None, :], lo_min[:, :, None]), max=ctx_len)
    top = torch.maximum(top, bottom)
    n_vis = (torch.gather(cs, 1, top.view(bsz, -1)) - torch.gather(cs, 1, bottom.view(bsz, -1))).view(bsz, nq, nk)
    ctx_any = has_ctx[None, None, :] & (n_vis > 0)
    all_valid = (cs[:, ke] - cs[:, ks]) == (ke - ks)[None, :]  # [Bsz, nk]
    ctx_all = ((ke[None, None, :] <= a_min[:, :, None]) & (ks[None, None, :] >= lo_max[:, :, None])
               & all_valid[:, None, :])

    # Block part: the key tile's range against the tile's reach and against what all its queries see.
    blk_any = has_blk[None, :] & (bs[None, :] < reach_hi[:, None]) & (be[None, :] > reach_lo[:, None])
    blk_all = (bs[None, :] >= all_lo[:, None]) & (be[None, :] <= all_hi[:, None])

    any_ = ctx_any | blk_any[None]
    full = (q_whole & k_whole)[None] & (ctx_all | ~has_ctx[None, None, :]) & (blk_all | ~has_blk[None, :])[None]
    full = full & any_
    return (any_ & ~full)[:, None], full[:, None]


def flex_block_mask(
    anchors: torch.Tensor, block_size: int, ctx_len: int, ctx_valid: torch.Tensor | None = None,
    tile: int = TILE, window: int | None = None,
):
    """The mask as a FlexAttention ``BlockMask`` built from tile metadata: no Q x KV tensor anywhere.

    Its sequence lengths are the query and key counts rounded up to whole tiles: attention pads q, k, v
    to them (padded keys are invisible, padded query rows are dropped), so the compiled kernel only
    ever sees tile multiples and does not specialise on ragged lengths. Everything runs on the anchors'
    device with no host synchronisation (the tile counts are only ever tensors). ``window``: a sliding
    layer's W (module docstring); whole tiles outside it are skipped.
    """
    from torch.nn.attention.flex_attention import BlockMask

    partial, full = block_tiles(anchors, block_size, ctx_len, ctx_valid, tile, window)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile,
        mask_mod=block_mask_mod(anchors, block_size, ctx_len, ctx_valid, tile, window),
        seq_lengths=(partial.shape[-2] * tile, partial.shape[-1] * tile),
    )


def use_flex(device: torch.device) -> bool:
    """FlexAttention where it is compiled (CUDA); the CPU path is SDPA with an explicit (small) mask."""
    if device.type != "cuda":
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# Running flex attention: compiled once, SDPA if compilation fails
# --------------------------------------------------------------------------------------------------

_compiled = None
_compile_lock = threading.Lock()
_flex_failed: str | None = None  # why compiled flex was given up (set once; later calls go to SDPA)
_dense = threading.local()  # the fallback's dense mask, kept for the layers of one forward


def compiled_flex() -> Callable:
    """``torch.compile(flex_attention, dynamic=True)``, built once per process.

    ``dynamic=True`` makes sequence length, anchor count and tile counts symbolic from the first call,
    so varying shapes reuse the graph instead of recompiling per length.
    """
    global _compiled
    with _compile_lock:
        if _compiled is None:
            from torch.nn.attention.flex_attention import flex_attention

            _compiled = torch.compile(flex_attention, dynamic=True)
        return _compiled


def _dense_from_block_mask(mask, bsz: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Dense [Bsz, 1, Q, KV] bool from a BlockMask's mask_mod (fallback only), reused across layers: one
    per kind of layer of the current forward (a drafter with sliding layers alternates two masks)."""
    from torch.nn.attention.flex_attention import create_mask

    kept = [(m, d) for m, d in getattr(_dense, "value", []) if m is not mask][-1:]  # the other kind's
    dense = next((d for m, d in getattr(_dense, "value", []) if m is mask), None)
    if dense is None:
        dense = create_mask(mask.mask_mod, bsz, None, q_len, kv_len, device)
    _dense.value = [*kept, (mask, dense)]
    return dense


def _pad_seq(x: torch.Tensor, length: int) -> torch.Tensor:
    """[B, H, S, D] zero-padded to ``length`` positions (no copy when already that long)."""
    return x if x.shape[2] == length else F.pad(x, (0, 0, 0, length - x.shape[2]))


def flex_or_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, compiled: bool) -> torch.Tensor:
    """FlexAttention of q [B, Hq, Q, D] over k, v [B, Hkv, K, D] under ``mask`` (a BlockMask).

    ``compiled``: use the compiled kernel (CUDA; on CPU torch runs flex uncompiled, forward only). If
    compiling or running it fails, forward or backward, warn once and answer every later call with SDPA
    and a dense mask.
    """
    from torch.nn.attention.flex_attention import flex_attention

    gqa = q.shape[1] != k.shape[1]
    if not compiled:
        return _padded(flex_attention, q, k, v, mask, gqa)
    if _flex_failed is None:
        try:
            if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
                return _FlexWithFallback.apply(q, k, v, mask, gqa)
            return _padded(compiled_flex(), q, k, v, mask, gqa)
        except Exception as e:  # compiler or kernel missing/broken on this machine: train on, slower
            _give_up_flex(e)
    return _sdpa(q, k, v, mask, gqa)


def _padded(flex: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool) -> torch.Tensor:
    """``flex`` over q, k, v padded to the BlockMask's tiled lengths, cut back to q's length."""
    q_pad, kv_pad = mask.seq_lengths
    out = flex(_pad_seq(q, q_pad), _pad_seq(k, kv_pad), _pad_seq(v, kv_pad), block_mask=mask, enable_gqa=gqa)
    return out[:, :, :q.shape[2]]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, gqa: bool) -> torch.Tensor:
    dense = _dense_from_block_mask(mask, q.shape[0], q.shape[2], k.shape[2], q.device)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)


def _give_up_flex(e: BaseException) -> None:
    global _flex_failed
    if _flex_failed is None:
        _flex_failed = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        warnings.warn(f"compiled FlexAttention failed ({_flex_failed}); using SDPA with a dense mask "
                      "from now on (slower, Q x KV memory per step)", RuntimeWarning, stacklevel=3)


class _FlexWithFallback(torch.autograd.Function):
    """Compiled flex whose backward falls back to SDPA too. With dynamic shapes torch compiles the
    backward lazily, at the first ``loss.backward()``: a failure there would end the drafter worker
    mid-step, long after the forward's fallback could help. So the compiled call keeps its own graph,
    and its backward, if that fails, is replaced by SDPA's over the same inputs (recomputed)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, gqa):
        inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in (q, k, v))
        with torch.enable_grad():
            out = _padded(compiled_flex(), *inputs, mask, gqa)
        ctx.inputs, ctx.out, ctx.mask, ctx.gqa = inputs, out, mask, gqa
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        inputs, out = ctx.inputs, ctx.out
        ctx.out = None  # the compiled graph goes with this call, whichever way it ends
        wanted = [x for x in inputs if x.requires_grad]
        if _flex_failed is None:
            try:
                return (*_place(inputs, torch.autograd.grad(out, wanted, grad)), None, None)
            except Exception as e:
                _give_up_flex(e)
        with torch.enable_grad():
            out = _sdpa(*inputs, ctx.mask, ctx.gqa)
        return (*_place(inputs, torch.autograd.grad(out, wanted, grad)), None, None)


def _place(inputs: tuple, grads: tuple) -> list:
    """Gradients for the inputs that want one, None for the others, in the inputs' order."""
    it = iter(grads)
    return [next(it) if x.requires_grad else None for x in inputs]
