"""The DSpark drafter: the DFlash backbone with two small heads, a Markov head and a confidence head, and
drafting that starts at the anchor slot.

* **Drafting from the anchor** (``sample_from_anchor``). The block is DFlash's ``[anchor, MASK, ...]`` of
  ``block_size`` slots, but every slot drafts: slot j's state predicts token ``a + j + 1`` (slot 0, the
  anchor's own slot, predicts the token after the anchor). A block of B slots therefore drafts B tokens,
  where a DFlash block drafts B - 1. Training supervises slot j with ``x[a + j + 1]``: the block plan of
  a DSpark drafter is one slot longer than its block (``plan_block_size``), so that the plan's slot k
  (labelled ``x[a + k]``) is the drafter's slot k - 1.
* **Markov head** (``markov_head``): a low-rank bigram bias on the logits, ``markov_w2(markov_w1[prev])``,
  where ``prev`` is the token before the one being drafted (``x[a + j]`` for slot j: the anchor for slot
  0, the draft of slot j - 1 after it). ``markov_w1`` is an embedding [V, r], ``markov_w2`` a linear map
  r -> V. Drafting walks the block left to right, but only this head is sequential: the backbone fills
  every slot's state in one pass, as DFlash's does. Training is teacher-forced (``prev`` is the data's
  token), so every slot trains at once.
* **Confidence head** (``confidence_head.proj``, a Linear with bias on ``[h ; markov_w1[prev]]``): one
  logit per slot, the predicted chance that the slot's draft survives verification. It is trained
  towards ``1 - TV(p_draft, p_target)`` (dflash/objectives/confidence.py), the acceptance probability
  of rejection sampling; a serving engine uses it to cut a draft's unlikely tail.

Only the vanilla Markov head is built; the gated and recurrent variants of the public trainers are
refused in one line (``settings_problem``), as is drafting without the anchor slot.

Parameter names are the public checkpoints' (``markov_head.markov_w1.weight``,
``markov_head.markov_w2.weight``, ``confidence_head.proj.weight`` / ``.bias``), so ``state_dict()`` is
what export.py writes beside the backbone's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from dflash.model.drafter import NOT_FOR_MUON, DFlashDrafter, DrafterConfig

#: the published recipe: rank 256, block 7, decay 4 (exp(-(k-1)/4) over the 7 drafting slots)
DEFAULT_RANK, DEFAULT_BLOCK, DEFAULT_GAMMA = 256, 7, 4.0
MARKOV_HEAD_TYPES = ("vanilla",)  # built here; the public trainers also have "gated" and "rnn"
KNOWN_HEAD_TYPES = ("vanilla", "gated", "rnn")


def settings_problem(rank: int, head_type: str = "vanilla", sample_from_anchor: bool = True,
                     confidence_head: bool = True, confidence_with_markov: bool = True) -> str | None:
    """The first thing wrong with these DSpark settings, in one line, or None."""
    if rank < 1:
        return f"markov_rank must be at least 1, got {rank} (a DSpark drafter without its Markov head is a " \
               "DFlash drafter: use --drafter-type dflash)"
    if head_type not in KNOWN_HEAD_TYPES:
        return f"markov_head_type {head_type!r} is not a DSpark head; the known ones: {', '.join(KNOWN_HEAD_TYPES)}"
    if head_type not in MARKOV_HEAD_TYPES:
        return f"markov_head_type {head_type!r} is not built here (only {', '.join(MARKOV_HEAD_TYPES)})"
    if not sample_from_anchor:
        return "sample_from_anchor false (only the masked slots draft) is not built here: DSpark drafts from " \
               "the anchor slot"
    if not confidence_head:
        return "a DSpark drafter without its confidence head is not built here (enable_confidence_head false)"
    if not confidence_with_markov:
        return "a confidence head that reads the hidden state alone is not built here " \
               "(confidence_head_with_markov false)"
    return None


@dataclass
class DSparkConfig(DrafterConfig):
    """A DFlash drafter's config and DSpark's settings (block 7 and decay 4 unless given)."""

    block_size: int = DEFAULT_BLOCK
    markov_rank: int = DEFAULT_RANK
    markov_head_type: str = "vanilla"

    drafter_type: ClassVar[str] = "dspark"

    def __post_init__(self) -> None:
        if self.gamma is None:
            self.gamma = DEFAULT_GAMMA
        super().__post_init__()
        problem = settings_problem(self.markov_rank, self.markov_head_type)
        if problem:
            raise ValueError(problem)

    @property
    def plan_block_size(self) -> int:
        """Every slot drafts (the anchor's too): the plan covers labels x[a + 1] .. x[a + B]."""
        return self.block_size + 1

    @property
    def drafts_per_block(self) -> int:
        return self.block_size

    def describe_layers(self) -> str:
        return f"{super().describe_layers()}; DSpark: Markov head rank {self.markov_rank}, confidence head"


class MarkovHead(nn.Module):
    """The bigram bias ``markov_w2(markov_w1[prev])`` on the draft logits (vanilla variant)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        # The public trainers' scale for the embedding; the projection as every other linear here. The
        # starting bias is then ~1e-3 per logit: the drafter begins as its backbone alone, and both
        # factors have a gradient from the first step (a zero factor would hold the other still).
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        nn.init.normal_(self.markov_w2.weight, std=cfg.initializer_range)
        # a table scored per vocabulary entry, not a hidden map: Muon leaves it to AdamW (at Muon's rate)
        setattr(self.markov_w2, NOT_FOR_MUON, True)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def bias(self, embedded: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(embedded.to(self.markov_w2.weight.dtype))


class ConfidenceHead(nn.Module):
    """One logit per slot from ``[h ; markov embedding]``: the predicted chance the slot's draft is kept."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size + cfg.markov_rank, 1)

    def forward(self, h: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([h, embedded.to(h.dtype)], dim=-1)).squeeze(-1)


@dataclass
class Draft:
    """A block's drafts [B, L], their logits with the Markov bias [B, L, V], and the confidence head's
    logits [B, L] (sigmoid: the predicted chance each slot's draft is kept)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor


class DSparkDrafter(DFlashDrafter):
    """A DFlash drafter with a Markov head and a confidence head; the forward is DFlashDrafter's (the
    heads run on its output, in the objective and in ``walk``)."""

    config: DSparkConfig
    #: the objective's terms and weights (dflash/objectives/): 0.1 x the token term, 0.9 x total
    #: variation to the target, 1.0 x the confidence head's cross-entropy
    token_term_weight = 0.1
    objective_terms = {"tv": 0.9, "confidence": 1.0}

    def __init__(self, config: DSparkConfig):
        super().__init__(config)  # its init pass runs before the heads exist: they initialise themselves
        self.markov_head = MarkovHead(config)
        self.confidence_head = ConfidenceHead(config)
        nn.init.normal_(self.confidence_head.proj.weight, std=config.initializer_range)
        nn.init.zeros_(self.confidence_head.proj.bias)

    def logits_and_confidence(self, base_logits: torch.Tensor, h: torch.Tensor,
                              prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The biased logits [..., V] (float32) and confidence logits [...] of slots whose states are
        ``h`` [..., H], whose backbone logits (the target's head over h) are ``base_logits``, and whose
        previous tokens are ``prev`` [...]."""
        embedded = self.markov_head.embed(prev)
        logits = base_logits.float() + self.markov_head.bias(embedded).float()
        return logits, self.confidence_head(h.to(self.confidence_head.proj.weight.dtype), embedded).float()

    def walk(self, hidden: torch.Tensor, base: torch.Tensor, anchor: torch.Tensor, choose=None) -> Draft:
        """Drafts for every slot of a block, left to right: ``hidden`` [B, L, H] the slots' states,
        ``base`` [B, L, V] their backbone logits (the target's head over them, as the target applies it),
        ``anchor`` [B] the verified token before slot 0. ``choose(logits [B, V]) -> tokens [B]`` picks
        each draft (default: argmax); slot j's previous token is the draft of slot j - 1."""
        h = hidden.to(self.fc.weight.dtype)
        previous, tokens, logits, confidence = anchor, [], [], []
        for i in range(hidden.shape[1]):
            step, conf = self.logits_and_confidence(base[:, i], h[:, i], previous)
            previous = step.argmax(-1) if choose is None else choose(step)
            tokens.append(previous)
            logits.append(step)
            confidence.append(conf)
        return Draft(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(confidence, 1))
