"""How a token term weighs a block's slots: a fixed exponential decay, or D-PACE.

A draft is accepted up to its first wrong token, so slot k only pays off when slots 1..k-1 were right:
both weightings make the early slots count most, one by a fixed schedule, one by the drafter's own
confidence on the batch at hand.
"""

from __future__ import annotations

import torch

from dflash.model.blocks import BlockPlan
from dflash.objectives.base import PositionWeight


def exp_weights(block_size: int, gamma: float, device: torch.device | str | None = None) -> torch.Tensor:
    """Weight of slot k = exp(-(k-1)/gamma) for k = 1..B-1 (the reference recipe; gamma 7 for B = 16)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


class ExpDecay(PositionWeight):
    """``exp(-(k-1)/gamma)``; the loss is the weighted mean, sum(w * loss) / sum(w)."""

    name = "exp"

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma

    def __call__(self, plan: BlockPlan, block_size: int, confidence: torch.Tensor | None):
        w = exp_weights(block_size, self.gamma, plan.slot.device)[plan.slot]
        return w, w.sum()


def dpace_grid(confidence: torch.Tensor, supervised: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights of whole blocks: ``confidence`` and ``supervised`` [blocks, B-1] (slots 1..B-1).

    Each supervised slot's confidence is smoothed, ``c = (1 - alpha) * q + alpha`` (an unsupervised
    slot counts as 1, as if certain); ``P_j = c_1 * ... * c_j`` is then the chance, slots taken as
    independent, that the draft is still right through slot j, and slot k's weight is
    ``sum_{j >= k, supervised} P_j``: how much of the expected accepted length depends on slot k being
    right. Unsupervised slots weigh 0.
    """
    mask = supervised.to(confidence.dtype)
    smooth = torch.where(supervised, (1.0 - alpha) * confidence + alpha, torch.ones_like(confidence))
    prefix = torch.cumprod(smooth, dim=-1) * mask
    return prefix.flip(-1).cumsum(-1).flip(-1) * mask


class DPace(PositionWeight):
    """D-PACE: each slot weighed by its share of the expected accepted length (``dpace_grid``), from the
    drafter's confidence in the label on this batch (detached: the weights steer, they are not
    trained); the loss is sum(w * loss) over the supervised slots, divided by their count."""

    name = "dpace"
    needs_confidence = True

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha

    def __call__(self, plan: BlockPlan, block_size: int, confidence: torch.Tensor | None):
        assert confidence is not None
        size = plan.shape[0] * plan.shape[1] * (block_size - 1)
        with torch.no_grad():
            q = torch.zeros(size, device=confidence.device).index_copy_(0, plan.sel, confidence.float())
            supervised = torch.zeros(size, dtype=torch.bool, device=confidence.device).index_fill_(0, plan.sel, True)
            grid = dpace_grid(q.view(-1, block_size - 1), supervised.view(-1, block_size - 1), self.alpha)
            w = grid.reshape(-1).index_select(0, plan.sel)
        return w, float(plan.num_tokens)
