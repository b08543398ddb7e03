"""Per-row losses through the (large, frozen) LM head, chunked so that [rows, vocab] never exists whole.

512 anchors x 15 slots x a 152K vocabulary is ~4.7 GB of float32 logits per sequence, and a loss to the
verifier's distribution needs its logits beside them. So the rows go through the head one chunk at a
time, and each chunk's gradient with respect to its input rows is taken right there, while its logits
exist: backward then only scales those saved row gradients (``[rows, hidden]``, the size of the rows
themselves) by the upstream gradient of each row's loss. No chunk's logits are computed twice, and
what autograd keeps for backward is the row gradients alone.

This is exact because the head is frozen and each row's loss depends on its own row only: the
gradient of ``sum_r c_r * loss_r`` is ``c_r * grad(loss_r)`` for any per-row coefficients ``c_r`` the
caller applies afterwards (position weights, normalisation), so they need not be known here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from dflash.targets.heads import SoftCappedHead
from dflash.telemetry.wire.vocab import OBJECTIVE_CATEGORIES

#: the float32 [chunk, vocab] logits of one chunk stay under this many bytes (a few such tensors live
#: at once: logits, softmax, the verifier's own); a small vocabulary takes every row in one chunk
CHUNK_BYTES = 1 << 28
MIN_CHUNK = 256

#: what a loss does with one chunk: given its drafter logits (float32 [c, vocab]), its row range and
#: what ``reference`` gave for those rows, the per-row loss [c] (differentiable through the logits)
#: and any per-row extras (detached)
ChunkLoss = Callable[[torch.Tensor, slice, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]
Span = Callable[[str], Any]
#: the span category of the verifier's side of a chunk (its logits), timed apart from the drafter's
VERIFIER_CATEGORY = OBJECTIVE_CATEGORIES[0]


#: float32 [chunk, vocab] tensors one chunk has alive at its peak, at most: its logits, their softmax (or
#: log-softmax), the gradient with respect to them, and a loss to the verifier's distribution needs the
#: verifier's logits and log-probabilities beside them
CHUNK_LIVE = 5


def chunk_rows(vocab: int) -> int:
    """Rows per chunk for a head of ``vocab`` outputs (see CHUNK_BYTES): every pass of the LM head over
    many rows (the token loss, the selector's) takes them this many at a time."""
    return max(MIN_CHUNK, CHUNK_BYTES // (4 * max(1, vocab)))


def chunk_peak_bytes(vocab: int, rows: int | None = None) -> int:
    """The most one chunk through a head of ``vocab`` outputs holds at once, beyond what autograd keeps:
    what a step's memory plan adds for the head whatever its batch (one chunk at a time; ``rows``: a
    step with fewer rows than a chunk)."""
    chunk = chunk_rows(vocab) if rows is None else min(rows, chunk_rows(vocab))
    return CHUNK_LIVE * chunk * vocab * 4


class _RowGradients(torch.autograd.Function):
    """Connects per-row losses computed outside autograd to their input rows ``h``; backward is
    ``upstream[:, None] * grad_rows``, the row gradients taken while the logits existed."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, losses: torch.Tensor, grad_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad_rows)
        return losses.clone()

    @staticmethod
    def backward(ctx, upstream: torch.Tensor):
        (grad_rows,) = ctx.saved_tensors
        return upstream[:, None].to(grad_rows.dtype) * grad_rows, None, None


def head_rows(lm_head: nn.Module, h: torch.Tensor, loss: ChunkLoss, reference: Callable[[slice], Any] | None = None,
              chunk: int | None = None, span: Span | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-row ``loss`` of ``lm_head(h)`` for rows ``h`` [S, H], chunk by chunk, and its extras
    concatenated. The head's weight must be frozen. ``reference(rows)``: what the loss compares a
    chunk with beyond the data (the verifier's log-probabilities), computed without gradient.
    ``span(category)``, when given, times each chunk's drafter side as ``drafter_forward`` and its
    reference as ``verifier_logits``, one after the other (spans that do not nest add up)."""
    weight = lm_head.weight
    if weight.requires_grad:
        raise ValueError("head_rows needs a frozen LM head: its weight gradient is not computed")
    chunk = chunk or chunk_rows(int(weight.shape[0]))
    span = span or (lambda _category: nullcontext())
    grad = h.requires_grad and torch.is_grad_enabled()
    losses, grads, extras = [], [], []
    for i in range(0, h.shape[0], chunk):
        rows = slice(i, min(i + chunk, h.shape[0]))
        ref = None
        if reference is not None:
            with span(VERIFIER_CATEGORY), torch.no_grad():
                ref = reference(rows)
        with span("drafter_forward"):
            part = h[rows].detach().requires_grad_(grad)
            with torch.enable_grad() if grad else torch.no_grad():
                value, extra = loss(lm_head(part.to(weight.dtype)).float(), rows, ref)
            if grad:
                (g,) = torch.autograd.grad(value.sum(), part)
                grads.append(g)
            losses.append(value.detach())
            extras.append(extra)
    value = torch.cat(losses) if losses else h.new_zeros(0, dtype=torch.float32)
    out = {k: torch.cat([e[k] for e in extras]) for k in (extras[0] if extras else {})}
    if grad:
        value = _RowGradients.apply(h, value, torch.cat(grads))
    return value, out


def top_k_loss(loss: ChunkLoss, k: int) -> ChunkLoss:
    """``loss`` that also returns each row's ``k`` largest logits' token ids as the extra ``candidates``
    ([c, k], detached): taken while the chunk's logits exist, so a term that reads only those columns
    (the DFlash2 selector's) needs no pass of its own over the head (``candidate_logits``)."""

    def with_candidates(logits: torch.Tensor, rows: slice, reference: Any):
        value, extras = loss(logits, rows, reference)
        with torch.no_grad():
            extras = {**extras, "candidates": torch.topk(logits, k, dim=-1).indices}
        return value, extras

    return with_candidates


def candidate_logits(lm_head: nn.Module, h: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """float32 [S, K]: the logits ``lm_head(h)`` [S, V] would hold at the columns ``candidates`` [S, K],
    from those K rows of the head's weight alone (2 x hidden x K FLOPs a row, not x vocabulary),
    differentiable with respect to ``h``. The head as the target applies it: a bias-free linear map,
    soft-capped where the target caps its logits. The gathered weights are [S, K, hidden]: callers pass
    a chunk of rows at a time (``chunk_rows``; K x hidden is far below the vocabulary's columns a
    token chunk holds, so the memory plan's one chunk covers it)."""
    cap = lm_head.cap if isinstance(lm_head, SoftCappedHead) else None
    linear = lm_head.inner if cap is not None else lm_head
    if not isinstance(linear, nn.Linear) or linear.bias is not None:
        raise ValueError(f"candidate logits need the head as a bias-free linear map (soft-capped or not), "
                         f"not {type(lm_head).__name__}")
    weight = linear.weight
    logits = torch.matmul(weight[candidates], h.to(weight.dtype).unsqueeze(-1)).squeeze(-1)
    if cap is not None:  # as SoftCappedHead applies it, in the head's dtype
        logits = torch.tanh(logits / cap) * cap
    return logits.float()
