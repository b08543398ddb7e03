"""Total variation to the target's distribution, ``1/2 ||q - p||_1`` per slot (a DSpark drafter's term).

``1 - TV`` is exactly the chance that rejection sampling keeps a draft drawn from q when the target
samples from p, so this term trains what sampled verification accepts, where cross-entropy to the
data's token trains it only indirectly. Each slot weighs what the token term's position weights give it
(the recipe's exp(-(k-1)/gamma), or D-PACE's), over the same denominator, read from the Forward the token
term filled: the terms stay on one scale whichever weighting the run uses. Computed in DSpark's shared head pass
(dspark_pass.py); also reports the mean acceptance rate 1 - TV of the step (``accept_rate``).
"""

from __future__ import annotations

from dflash.objectives import register
from dflash.objectives.base import LABELS, VERIFIER, Forward, Term, TermValue
from dflash.objectives.dspark_pass import dspark_rows


def decayed_mean(fwd: Forward, per_slot):
    """``sum w * per_slot / den`` with the token term's position weights and denominator (it runs first)."""
    if fwd.position_weights is None:
        raise ValueError("a DSpark term reads the token term's position weights: the token term runs first")
    w, den = fwd.position_weights
    return (per_slot * w).sum() / den


@register
class TotalVariation(Term):
    name = "tv"
    needs = frozenset({LABELS, VERIFIER})
    metrics = ("accept_rate",)
    head_passes = 2  # the target's logits (with no gradient), once more in the chunk's recompute

    def __call__(self, fwd: Forward) -> TermValue:
        if fwd.gamma is None:
            raise ValueError("total variation's position decay needs the drafter's gamma")
        tv = dspark_rows(fwd)["tv"]
        accept = 1.0 - tv.detach().sum() / max(tv.shape[0], 1)
        return TermValue(decayed_mean(fwd, tv), metrics={"accept_rate": accept})
