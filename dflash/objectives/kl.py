"""KL divergence to the verifier's distribution: slot k of the block at anchor a learns the target's own
next-token distribution at position a + k - 1 (what it predicts x[a + k] from), not just the data's
token. That distribution is the target's final hidden state there through its final norm and LM head,
computed chunk by chunk beside the drafter's logits (never [slots, vocab] at once), once per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.objectives import register
from dflash.objectives.base import LABELS, VERIFIER, Forward, TokenTerm


@register
class KLToVerifier(TokenTerm):
    """Forward KL, ``sum_v p_v (log p_v - log q_v)``: p the verifier's, q the drafter's distribution."""

    name = "kl"
    needs = frozenset({LABELS, VERIFIER})
    head_passes = 3  # the token term's two, and the verifier's logits

    def chunk_loss(self, fwd: Forward):
        states, (row, pos) = fwd.verifier, fwd.verifier_positions()
        head = fwd.verifier_head

        def reference(rows: slice) -> torch.Tensor:
            logits = head(states[row[rows], pos[rows]].to(head.weight.dtype))
            return torch.softmax(logits.float(), dim=-1)

        def loss(logits: torch.Tensor, rows: slice, p: torch.Tensor):
            # xlogy form: a token the verifier gives probability 0 adds 0, not 0 * log 0
            kl = F.kl_div(torch.log_softmax(logits, dim=-1), p, reduction="none").sum(-1)
            with torch.no_grad():
                extras = {"pred": logits.argmax(-1)}
            return kl, extras

        return loss, reference
