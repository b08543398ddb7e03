"""Cross-entropy to the data's next tokens: slot k of the block at anchor a learns x[a + k]."""

from __future__ import annotations

import torch

from dflash.objectives import register
from dflash.objectives.base import LABELS, Forward, TokenTerm


@register
class CrossEntropy(TokenTerm):
    name = "ce"
    needs = frozenset({LABELS})

    def chunk_loss(self, fwd: Forward):
        labels = fwd.plan.labels

        def loss(logits: torch.Tensor, rows: slice, _reference: None):
            y = labels[rows]
            ce = torch.logsumexp(logits, dim=-1) - logits.gather(1, y[:, None]).squeeze(1)
            with torch.no_grad():
                extras = {"pred": logits.argmax(-1), "confidence": torch.exp(-ce.detach())}
            return ce, extras

        return loss, None
