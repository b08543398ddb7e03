"""DSpark's pass through the LM head, shared by its three terms (the token term's cross-entropy, tv.py,
confidence.py): each chunk of supervised rows goes through the target's head once, gets the Markov
head's bias for its previous token, and yields all three per-row losses together.

Why not head.py's row gradients: the Markov bias ``markov_w2(markov_w1[prev])`` is trained, and the
gradient of ``markov_w2`` needs every row's logit gradient (``[rows, vocab]``) at once with the row's
weight in the sum, which head.py's trick (row gradients scaled afterwards) does not keep. So each chunk
runs under activation checkpointing instead, as the DFlash2 selector's does (selector.py): autograd
keeps only the chunk's inputs, and backward recomputes the chunk's logits (and the target's, which are
not kept either) once. Chunks follow the head's one policy (``head.chunk_rows``).

Per supervised slot (plan slot k of the block at anchor a is the drafter's slot k - 1, labelled
x[a + k]; its previous token is x[a + k - 1], the data's: teacher forcing):

* ``ce``: ``-log q(x[a + k])``, q the drafter's distribution (backbone logits + Markov bias);
* ``tv``: ``1/2 ||q - p||_1``, p the target's distribution at position a + k - 1 (what it predicts x[a + k]
  with); ``1 - tv`` is the chance rejection sampling keeps a draft drawn from q;
* ``bce``: the confidence head's binary cross-entropy against ``1 - tv`` (detached: the head learns to
  predict survival, the drafter is not pulled towards what the head predicts).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash.model.blocks import predecessors
from dflash.objectives.head import chunk_rows

KEY = "dspark"


def _chunk(drafter: nn.Module, lm_head: nn.Module, verifier_head: nn.Module, h: torch.Tensor, states: torch.Tensor,
           prev: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    base = lm_head(h.to(lm_head.weight.dtype))
    logits, confidence = drafter.logits_and_confidence(base, h, prev)
    logq = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        p = torch.softmax(verifier_head(states.to(verifier_head.weight.dtype)).float(), dim=-1)
    ce = -logq.gather(1, labels[:, None]).squeeze(1)
    tv = 0.5 * (logq.exp() - p).abs().sum(-1)
    bce = F.binary_cross_entropy_with_logits(confidence, (1.0 - tv).detach().clamp(0.0, 1.0), reduction="none")
    with torch.no_grad():
        extras = torch.stack([logits.argmax(-1).float(), torch.sigmoid(confidence)], 0)
    return ce, tv, bce, extras


def dspark_rows(fwd: Any) -> dict[str, torch.Tensor]:
    """The per-row ``ce``, ``tv``, ``bce`` [S] (differentiable), ``pred`` [S] (the drafter's top-1 token)
    and ``predicted`` [S] (the confidence head's sigmoid) of this pass, computed once and shared. ``fwd``
    is a base.Forward, typed loosely: base calls into this module, and importing it back would circle."""
    if KEY in fwd.shared:
        return fwd.shared[KEY]
    if fwd.verifier is None or fwd.verifier_head is None or fwd.input_ids is None or fwd.drafter is None:
        raise ValueError("DSpark's objective needs the verifier's final states and head, the batch's tokens "
                         "and the drafter")
    drafter = getattr(fwd.drafter, "module", fwd.drafter)  # DDP holds the drafter as .module
    plan = fwd.plan
    prev = predecessors(fwd.input_ids, plan.anchors, plan.sel, plan.slot, fwd.block_size)
    row, pos = fwd.verifier_positions()
    chunk = chunk_rows(int(fwd.lm_head.weight.shape[0]))
    parts = []
    for i in range(0, fwd.h.shape[0], chunk):
        rows = slice(i, i + chunk)
        args = (drafter, fwd.lm_head, fwd.verifier_head, fwd.h[rows], fwd.verifier[row[rows], pos[rows]],
                prev[rows], plan.labels[rows])
        if torch.is_grad_enabled() and fwd.h.shape[0] > chunk:
            parts.append(checkpoint(_chunk, *args, use_reentrant=False))
        else:
            parts.append(_chunk(*args))
    if parts:
        ce, tv, bce, extras = (torch.cat([p[j] for p in parts], dim=-1) for j in range(4))
    else:
        ce = tv = bce = fwd.h.sum(-1) * 0.0
        extras = torch.zeros(2, 0, device=fwd.h.device)
    out = {"ce": ce, "tv": tv, "bce": bce, "pred": extras[0].long(), "predicted": extras[1]}
    fwd.shared[KEY] = out
    return out


def uses_dspark_pass(fwd: Any) -> bool:
    """Whether the drafter's logits carry a bias of its own (a DSpark drafter's Markov head): its token
    term then reads this pass, not the plain head."""
    return hasattr(getattr(fwd.drafter, "module", fwd.drafter), "logits_and_confidence")
