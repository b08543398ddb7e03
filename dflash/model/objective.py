"""The DFlash training objective: random anchors, packed blocks, the block attention mask, weighted CE.

One training sequence of T tokens (with the target's tap-layer hidden states for every position) yields
up to ``num_anchors`` blocks. For an anchor at position ``a``:

    block tokens  [x[a], MASK, MASK, ..., MASK]          (B slots, positions a .. a+B-1)
    labels        slot k (1 <= k < B) predicts x[a+k]    (slot 0 is the given anchor token)
    visible       context positions j < a (target hidden states strictly *before* the anchor),
                  every slot of the same block (bidirectional), nothing of any other block

This mirrors decoding exactly: after the target has verified up to position a-1 and produced token x[a]
from its last logits, the drafter gets the target's hidden states for positions < a and the block
[x[a], MASK, ...] at positions a.., and must fill x[a+1], x[a+2], ... The two bugs public trainers had
(a label offset of one; context at or after the anchor leaking in) both yield near-perfect *training*
accuracy and useless drafts; tests/test_model_objective.py pins both.

All blocks of a sequence are packed into one drafter pass: queries are the N*B block slots, keys are
[T context positions ; N*B block slots], and the mask above is built explicitly (SDPA, CPU) or as a
FlexAttention BlockMask from tile metadata (CUDA; masks.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dflash.model.drafter import DFlashDrafter
from dflash.model.masks import block_attention_mask, flex_block_mask, use_flex


@dataclass
class LossOutput:
    """Loss plus the metrics the trainer streams.

    per_position_acc[k-1]: top-1 accuracy of slot k over supervised slots (k = 1..B-1).
    sim_tau: simulated acceptance length ``1 + sum_k prod_{j<=k} acc_j`` (the expected tokens per
        verify round if slot errors were independent; the leading 1 is the target's own bonus token).
        Teacher-forced and optimistic: real decoding (dflash eval) is the number to trust.
    block_tau: ``1 + mean over blocks of the run of leading correct slots``: the acceptance each
        training block would actually have had, with no independence assumption.
    """

    loss: torch.Tensor
    num_tokens: int
    accuracy: float
    per_position_acc: list[float]
    sim_tau: float
    block_tau: float
    num_blocks: int
    per_position_count: list[int] = field(default_factory=list)


def loss_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """Weight of slot k = exp(-(k-1)/gamma) for k = 1..B-1: early slots matter most, since a draft is
    only accepted up to its first wrong token."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors per sequence: positions a with loss_mask[a] on and a + B - 1 < T (a full block
    fits), drawn without replacement, up to ``num_anchors`` (all valid positions if fewer), sorted.

    Returns (anchors [Bsz, N] long, keep [Bsz, N] bool) on loss_mask's device; N is the largest count in
    the batch and rows with fewer anchors are padded (keep False). Sampling runs on the CPU so one
    ``torch.Generator`` makes it reproducible on any device.
    """
    bsz, t = loss_mask.shape
    valid = loss_mask.detach().to("cpu").bool().clone()
    valid[:, max(0, t - block_size + 1):] = False
    picks = []
    for row in valid:
        idx = row.nonzero().flatten()
        if len(idx) > num_anchors:
            idx = idx[torch.randperm(len(idx), generator=generator)[:num_anchors]].sort().values
        picks.append(idx)
    n = max((len(p) for p in picks), default=0)
    anchors = torch.zeros(bsz, n, dtype=torch.long)
    keep = torch.zeros(bsz, n, dtype=torch.bool)
    for b, p in enumerate(picks):
        anchors[b, : len(p)] = p
        keep[b, : len(p)] = True
    return anchors.to(loss_mask.device), keep.to(loss_mask.device)


def build_blocks(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tokens, positions and label positions for packed blocks.

    Returns block_ids [Bsz, N*B] (anchor token then MASKs), positions [Bsz, N*B] (a + k), and
    label_pos [Bsz, N, B-1]: slot k of the block at anchor a is labelled with input_ids[a + k].
    """
    bsz, n = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    positions = anchors[:, :, None] + offsets  # [Bsz, N, B]
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return block_ids.view(bsz, n * block_size), positions.view(bsz, n * block_size), positions[:, :, 1:]


def _head_ce(lm_head: torch.nn.Module, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(h.to(lm_head.weight.dtype)).float()
    return F.cross_entropy(logits, y, reduction="none"), logits.argmax(-1)


def head_cross_entropy(
    lm_head: torch.nn.Module, h: torch.Tensor, y: torch.Tensor, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row CE and argmax of ``lm_head(h)`` without keeping [rows, vocab] logits for backward.

    512 anchors x 15 slots x a 152K vocabulary is ~4.7 GB of float32 logits per sequence; in chunks
    under activation checkpointing only one chunk's logits exist at a time (recomputed in backward).
    """
    if not h.requires_grad or h.shape[0] <= chunk:
        return _head_ce(lm_head, h, y)
    from torch.utils.checkpoint import checkpoint

    parts = [checkpoint(_head_ce, lm_head, h[i : i + chunk], y[i : i + chunk], use_reentrant=False)
             for i in range(0, h.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def forward_blocks(
    drafter: DFlashDrafter,
    embed_tokens: torch.nn.Module,
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    anchors: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    attn_backend: str = "auto",
) -> torch.Tensor:
    """Drafter hidden states [Bsz, N, B, H] for the blocks at ``anchors`` [Bsz, N], all in one pass."""
    bs = drafter.config.block_size
    bsz, t = input_ids.shape
    n = anchors.shape[1]
    device = input_ids.device
    block_ids, positions, _ = build_blocks(input_ids, anchors, bs, drafter.config.mask_token_id)
    backend = attn_backend if attn_backend != "auto" else ("flex" if use_flex(device) else "sdpa")
    if backend == "flex":
        mask = flex_block_mask(anchors, bs, t, attention_mask)
    elif backend == "sdpa":
        mask = block_attention_mask(anchors, bs, t, attention_mask)
    else:
        raise ValueError(f"attn_backend must be auto, sdpa or flex (got {attn_backend!r})")
    with torch.no_grad():
        noise = embed_tokens(block_ids)
    ctx_positions = torch.arange(t, device=device).expand(bsz, t)
    hidden = drafter(noise, target_hidden, positions, ctx_positions, mask)  # [Bsz, N*B, H]
    return hidden.view(bsz, n, bs, -1)


def dflash_loss(
    drafter: DFlashDrafter,
    embed_tokens: torch.nn.Module,
    lm_head: torch.nn.Module,
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    loss_mask: torch.Tensor,
    num_anchors: int = 512,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    attn_backend: str = "auto",
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> LossOutput:
    """Weighted block cross-entropy of the drafter on one batch.

    input_ids [Bsz, T]; target_hidden [Bsz, T, L*H] (the target's tap states for the same tokens);
    loss_mask [Bsz, T] marks tokens the drafter should learn to predict (the response). A slot is
    supervised iff its block was sampled and its label position has loss_mask on. ``attention_mask``
    (1 = real token) additionally hides padded context; padding is expected at the right.
    ``attn_backend``: "auto" (flex on CUDA, else sdpa), "sdpa" or "flex". ``anchors`` overrides the
    sampling with given (anchors, keep) — for tests and debugging.

    The loss is sum(w_k * CE) / sum(w_k) over supervised slots, w_k = exp(-(k-1)/gamma).
    """
    cfg = drafter.config
    bs = cfg.block_size
    bsz = input_ids.shape[0]
    device = input_ids.device
    loss_mask = loss_mask.bool()
    if anchors is None:
        anchors, keep = sample_anchors(loss_mask, bs, num_anchors, generator)
    else:
        anchors, keep = anchors[0].to(device), anchors[1].to(device).bool()
    n = anchors.shape[1]
    _, _, label_pos = build_blocks(input_ids, anchors, bs, cfg.mask_token_id)
    labels = torch.gather(input_ids, 1, label_pos.reshape(bsz, -1)).view(bsz, n, bs - 1)
    supervised = keep[:, :, None] & torch.gather(loss_mask, 1, label_pos.reshape(bsz, -1)).view(bsz, n, bs - 1)
    if not supervised.any():  # nothing to learn from (e.g. responses shorter than two tokens)
        zero = sum(p.sum() for p in drafter.parameters()) * 0.0
        return LossOutput(zero, 0, 0.0, [0.0] * (bs - 1), 1.0, 1.0, 0, [0] * (bs - 1))
    hidden = forward_blocks(drafter, embed_tokens, input_ids, target_hidden, anchors, attention_mask, attn_backend)
    hidden = hidden[:, :, 1:]  # drop the anchor slot: it predicts nothing

    # Only supervised slots go through the (large) LM head.
    sel = supervised.nonzero(as_tuple=True)
    y = labels[sel]
    w = loss_weights(bs, cfg.gamma, device)[sel[2]]
    ce, pred = head_cross_entropy(lm_head, hidden[sel], y)
    loss = (ce * w).sum() / w.sum()

    with torch.no_grad():
        correct = torch.zeros(bsz, n, bs - 1, dtype=torch.bool, device=device)
        correct[sel] = pred == y
        counts = supervised.sum(dim=(0, 1))
        per_pos = (correct.sum(dim=(0, 1)).float() / counts.clamp(min=1)).tolist()
        run = (correct & supervised).int().cumprod(dim=-1).sum(-1).float()  # leading correct slots
        block_tau = 1.0 + run[keep].mean().item()
        sim_tau = 1.0 + sum(math.prod(per_pos[: k + 1]) for k in range(bs - 1))
        num_tokens = int(counts.sum().item())
        accuracy = float(correct.sum().item()) / max(1, num_tokens)
    return LossOutput(loss, num_tokens, accuracy, per_pos, sim_tau, block_tau, int(keep.sum().item()),
                      counts.tolist())
