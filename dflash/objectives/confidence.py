"""The confidence head's loss (a DSpark drafter's term): binary cross-entropy of its logit against the
soft label ``1 - 1/2 ||q - p||_1``, the chance that the slot's draft survives rejection sampling (tv.py).
The label is detached: the head learns to predict survival, the drafter's logits are not pulled towards
its guess. Slot k weighs exp(-(k-1)/gamma), over the weights' sum. Computed in DSpark's shared head pass
(dspark_pass.py); reports the head's mean absolute error against the label (``confidence_error``).
"""

from __future__ import annotations

from dflash.objectives import register
from dflash.objectives.base import LABELS, VERIFIER, Forward, Term, TermValue
from dflash.objectives.dspark_pass import dspark_rows
from dflash.objectives.tv import decayed_mean


@register
class ConfidenceLoss(Term):
    name = "confidence"
    needs = frozenset({LABELS, VERIFIER})
    metrics = ("confidence_error",)
    head_passes = 1  # the drafter's logits recomputed in the chunk's backward

    def __call__(self, fwd: Forward) -> TermValue:
        if fwd.gamma is None:
            raise ValueError("the confidence loss's position decay needs the drafter's gamma")
        rows = dspark_rows(fwd)
        label = 1.0 - rows["tv"].detach()
        error = (rows["predicted"] - label).abs().sum() / max(label.shape[0], 1)
        return TermValue(decayed_mean(fwd, rows["bce"]), metrics={"confidence_error": error})
