"""The candidate selector's training loss (DFlash2), beside the token loss every drafter trains on.

z-lab has not published how it trains the selector; this follows the design SpecForge documents for
its DFlash2 trainer (docs/concepts/DFlash2.md there), because it trains the selector on exactly what
it sees when serving:

* **Teacher forcing.** Slot k's predecessor is the data's token before its label, x[a + k - 1] (the
  anchor's own token for k = 1), not the drafter's guess: every slot trains at once, in one pass.
* **The serving candidates.** The candidates are the unary top-k of the target's head over the drafter's
  state (``selector_top_k``), and the loss is a K-way cross-entropy of the selector's scores with the
  gold token's place among them. A slot whose gold token is not among its candidates adds nothing: no
  re-ranking could have drafted it (a miss of the backbone, counted as recall, not a selector error).
* **The token loss's weighting.** Each slot is weighted as the token term weighed it (``--position-weight``:
  the exponential decay exp(-(k-1)/gamma), or D-PACE's), over the token term's denominator, so the two
  are on one scale: ``loss = (sum w ce + alpha sum w [covered] ce_sel) / den`` (``Forward.position_weights``).
* **Ramped in.** ``alpha`` is 0 for the first ``warmup`` fraction of the run, rises linearly over the
  next ``ramp`` fraction, then stays at the weight set. The selector stays in the graph meanwhile (its
  gradient is 0, not absent), which multi-rank gradient reduction needs.
* The selector's loss reaches the unary logits and the drafter's states too (no stop-gradient), as in
  that design's default.

What the log reports: **recall**, the share of supervised slots whose gold token is among the top-k,
and **accuracy**, the share of those where the selector's best-scoring candidate is the gold token
(teacher-forced). Both are summed on the device with the step's other metrics and read once per interval.

The head is not applied again: the token term takes each slot's top-k token ids inside its own chunks,
while their logits exist (``Forward.candidates``; head.py ``top_k_loss``), and the unary scores here are
those K columns of the head alone (``head.candidate_logits``: K rows of its weight per slot, 2 x hidden x K
FLOPs, not x vocabulary). Their values and gradients are the full head's at those columns. The rest (the
gathered weights, the codebook rows, the scores) runs chunk by chunk, the head's chunks
(``head.chunk_rows``: one policy), each recomputed in backward when there are several, so autograd keeps
the chunk's inputs only. It is its own span of the step (``selector``).

A DFlash2 drafter asks for this term (``objective_terms``); its weight and schedule are the run's
``--selector-loss-weight``, ``--selector-warmup`` and ``--selector-ramp``. It reaches the selector
through the Forward (``CANDIDATES``), not the drafter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.blocks import predecessors
from dflash.objectives import register
from dflash.objectives.base import CANDIDATES, LABELS, Forward, Term, TermValue
from dflash.objectives.head import candidate_logits, chunk_rows
from dflash.telemetry.wire.vocab import SELECTOR


def ramp_weight(progress: float, weight: float, warmup: float, ramp: float) -> float:
    """The selector loss's weight at ``progress`` (the run's fraction done): 0 during warmup, then a
    linear rise over ``ramp``, then ``weight``."""
    if progress < warmup:
        return 0.0
    if ramp <= 0:
        return weight
    return weight * min(1.0, (progress - warmup) / ramp)


def _chunk_terms(selector: nn.Module, lm_head: nn.Module, h: torch.Tensor, labels: torch.Tensor,
                 before: torch.Tensor, weights: torch.Tensor,
                 candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    unary = candidate_logits(lm_head, h, candidates)
    match = candidates == labels[:, None]
    covered = match.any(-1)
    gold = match.int().argmax(-1)  # the gold token's place among the candidates (0 where it is absent)
    scores = selector.scores(selector.hidden_projection(h), before, unary, candidates).float()
    ce = F.cross_entropy(scores, gold, reduction="none")
    num = (ce * weights * covered).sum()
    with torch.no_grad():
        right = candidates.gather(-1, scores.argmax(-1, keepdim=True))[:, 0] == labels
        counts = torch.stack([covered.sum(), (right & covered).sum()]).float()
    return num, counts


def selector_terms(selector: nn.Module, lm_head: nn.Module, h: torch.Tensor, labels: torch.Tensor,
                   before: torch.Tensor, weights: torch.Tensor, candidates: torch.Tensor,
                   chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over the covered slots of weight x the selector's cross-entropy, differentiable; float32
    [covered, correct] counts) for the supervised slots' drafter states ``h`` [S, H], their ``labels``,
    the tokens ``before`` them, their position ``weights`` and their ``candidates`` [S, K] (the unary
    top-k of ``lm_head(h)``, in descending order, as the token term's chunks took them). ``selector`` is
    a CandidateSelector, ``lm_head`` the target's frozen head as the target applies it. Chunks of
    ``chunk`` rows (default: the head's policy, ``chunk_rows``), each recomputed in backward when there
    are several."""
    if h.shape[0] == 0:
        return h.sum() * 0.0, torch.zeros(2, device=h.device)
    chunk = chunk or chunk_rows(int(lm_head.weight.shape[0]))
    parts = []
    for i in range(0, h.shape[0], chunk):
        args = (h[i:i + chunk], labels[i:i + chunk], before[i:i + chunk], weights[i:i + chunk],
                candidates[i:i + chunk])
        if torch.is_grad_enabled() and h.shape[0] > chunk:
            from torch.utils.checkpoint import checkpoint

            parts.append(checkpoint(_chunk_terms, selector, lm_head, *args, use_reentrant=False))
        else:
            parts.append(_chunk_terms(selector, lm_head, *args))
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


@register
class SelectorLoss(Term):
    """The candidate selector's K-way cross-entropy (module docstring), weighed as the token term weighs
    its slots, over its denominator: on its scale. Reports the selector's recall and teacher-forced
    accuracy on each step."""

    name = "selector"
    needs = frozenset({LABELS, CANDIDATES})
    metrics = ("selector_recall", "selector_accuracy")
    # none: the candidates come from the token term's pass, their K columns are counted with the selector's
    # scores (dflash/train/device/flops.py)
    head_passes = 0

    def __init__(self, weight: float = 1.0, warmup: float = 0.0, ramp: float = 0.0) -> None:
        super().__init__(weight)
        self.full_weight, self.warmup, self.ramp = weight, warmup, ramp

    @classmethod
    def made(cls, weight: float, settings: Any) -> SelectorLoss:
        return cls(weight * settings.selector_loss_weight, settings.selector_warmup, settings.selector_ramp)

    def at(self, progress: float) -> None:
        self.weight = ramp_weight(progress, self.full_weight, self.warmup, self.ramp)

    def __call__(self, fwd: Forward) -> TermValue:
        if fwd.input_ids is None or fwd.selector is None:
            raise ValueError("the selector's loss needs the batch's tokens and the drafter's candidate selector")
        if fwd.position_weights is None or fwd.candidates is None:
            raise ValueError("the selector's loss reads the token term's position weights and candidates; "
                             "the token term left none")
        plan = fwd.plan
        w, den = fwd.position_weights
        with fwd.span(SELECTOR):
            before = predecessors(fwd.input_ids, plan.anchors, plan.sel, plan.slot, fwd.block_size)
            num, (covered, correct) = selector_terms(fwd.selector, fwd.lm_head, fwd.h, plan.labels, before, w,
                                                     fwd.candidates)
            value = num / den  # the token term's denominator (the objective runs no term on an empty plan)
            supervised = float(max(plan.num_tokens, 1))
            metrics = {"selector_recall": covered / supervised, "selector_accuracy": correct / covered.clamp(min=1)}
        return TermValue(value, metrics=metrics)
