"""The objective's seam: what one drafter pass hands the loss terms, what a term is, and how terms add up.

A training step runs the drafter once over a batch's packed blocks (dflash.model.blocks) and gives
every term the same ``Forward``: the drafter's states at the supervised slots, the block plan (labels,
slots, anchors), the frozen LM head, the verifier's final states when a term asked for them, and
whatever else the drafter's forward returned (``extras``: a drafter with more heads hands their
outputs there). A term turns that into one scalar; the objective sums the terms with their weights,
logs each one apart, and computes the acceptance metrics from the term that predicts tokens.

Terms declare what they need from the batch (``needs``): ``LABELS`` (the data's next tokens, always
there) or ``VERIFIER`` (the target's final hidden states, which the target stage then appends to the
tap states it sends, and the objective turns into the verifier's logits chunk by chunk), or from the
pass: ``CANDIDATES`` (the drafter's candidate selector, and each supervised slot's top-k tokens under the
head, which the token term takes inside its own chunks while their logits exist).

The token term runs first, and leaves on the Forward what the other terms share with it: the position
weights it weighed its slots with (so every term is on its scale, whatever ``--position-weight`` says)
and, when asked, the candidates.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from dflash.model.blocks import BlockPlan, LossOutput, plan_blocks, run_blocks
from dflash.objectives.head import ChunkLoss, Span, head_rows, top_k_loss

#: what a term may need from the batch
LABELS = "labels"  # the data's tokens at the label positions (in every BlockPlan)
VERIFIER = "verifier"  # the target's final hidden states at every position
CANDIDATES = "candidates"  # the drafter's candidate selector and the head's top-k tokens per supervised slot


@dataclass
class Forward:
    """One drafter pass over a batch's blocks, as every term sees it.

    hidden [Bsz, N, B, H]: the drafter's output at every block slot. h [S, H]: the supervised slots'
    rows of it, in the plan's order (``plan.sel``, ``plan.labels``, ``plan.slot`` index the same S).
    verifier [Bsz, T, Hv] and verifier_head (final norm + LM head, frozen) when a term needs VERIFIER.
    extras: the drafter's other outputs by name. span(category): times a part of the work.
    selector: the drafter's candidate selector when a term needs CANDIDATES. The token term fills in
    ``position_weights`` and ``candidates`` for the terms after it.
    """

    hidden: torch.Tensor
    h: torch.Tensor
    plan: BlockPlan
    lm_head: nn.Module
    block_size: int
    verifier: torch.Tensor | None = None
    verifier_head: nn.Module | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    span: Span = field(default=lambda _category: nullcontext())
    input_ids: torch.Tensor | None = None  # [Bsz, T] the batch's tokens (a label's predecessor, say)
    gamma: float | None = None  # the drafter's position decay, exp(-(k-1)/gamma)
    drafter: nn.Module | None = None  # the drafter itself (a term over a head of its own: DSpark's Markov head)
    selector: nn.Module | None = None  # DFlash2's CandidateSelector, when a term needs CANDIDATES
    #: (weight per supervised slot [S], the weighted sum's denominator) the token term weighed its slots with
    position_weights: tuple[torch.Tensor, torch.Tensor | float] | None = None
    #: [S, selector.top_k] the head's top-k token ids per supervised slot, from the token term's chunks
    candidates: torch.Tensor | None = None
    #: what several terms compute once per pass and share (DSpark's chunked head pass), by name
    shared: dict[str, Any] = field(default_factory=dict)

    def verifier_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row in the batch, position) [S] each of the verifier state whose logits predict each supervised
        slot's label: slot k of the block at anchor a is labelled x[a + k], which the target predicts
        from position a + k - 1 (the anchor's own position for k = 1). Computed on the device."""
        if self.verifier is None:
            raise ValueError("this objective needs the verifier's final states; none were given")
        bs, n = self.block_size, self.plan.shape[1]
        block = torch.div(self.plan.sel, bs - 1, rounding_mode="floor")  # flat block index b * N + j
        anchor = self.plan.anchors.reshape(-1)[block]
        return torch.div(block, n, rounding_mode="floor"), anchor + self.plan.slot


@dataclass
class TermValue:
    """A term's scalar (differentiable) and, for the term that predicts tokens, its top-1 token per
    supervised slot (the acceptance metrics are computed from it)."""

    value: torch.Tensor
    pred: torch.Tensor | None = None
    #: the rates the term measured on this step (device scalars, detached), one per name in its ``metrics``
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Term(ABC):
    """One part of the objective: ``__call__(forward)`` -> TermValue. Registered by name
    (dflash.objectives.register); ``weight`` is its coefficient in the sum."""

    name: ClassVar[str]
    needs: ClassVar[frozenset[str]] = frozenset({LABELS})
    #: whether this term predicts the block's tokens (one such term per objective: ce, kl)
    predicts_tokens: ClassVar[bool] = False
    #: the rates its TermValue carries, logged by name (a mean over the steps of a log interval)
    metrics: ClassVar[tuple[str, ...]] = ()
    #: how many times it runs the frozen LM head over the supervised slots (a forward, or a gradient with
    #: respect to the head's input, each 2 x hidden x vocabulary FLOPs a slot): the step's FLOP count
    #: (dflash/train/device/flops.py) adds them up
    head_passes: ClassVar[int] = 0

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight

    @classmethod
    def made(cls, weight: float, settings: Any) -> Term:
        """The term a drafter asks for at ``weight``, with the run's objective ``settings``."""
        return cls(weight)

    def at(self, progress: float) -> None:  # noqa: B027 - optional: most terms keep their weight
        """Told the run's progress (fraction done) before each step: a term whose weight is scheduled."""

    @abstractmethod
    def __call__(self, fwd: Forward) -> TermValue:
        """This term on one pass."""


class Objective:
    """The weighted sum of terms the drafter trains on, with what it needs from the batch."""

    def __init__(self, terms: Sequence[Term]) -> None:
        tokens = [t for t in terms if t.predicts_tokens]
        if len(tokens) != 1:
            raise ValueError(f"an objective needs exactly one token-predicting term, got {[t.name for t in tokens]}")
        names = [t.name for t in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"an objective's terms must differ: {names}")
        self.terms = list(terms)
        self.token_term = tokens[0]

    @property
    def needs(self) -> frozenset[str]:
        return frozenset().union(*(t.needs for t in self.terms))

    @property
    def needs_verifier(self) -> bool:
        return VERIFIER in self.needs

    @property
    def term_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.terms)

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(m for t in self.terms for m in t.metrics)

    def describe(self) -> str:
        return " + ".join(t.name if t.weight == 1 else f"{t.weight:g} x {t.name}" for t in self.terms)

    def __call__(self, drafter: nn.Module, embed_tokens: nn.Module, lm_head: nn.Module, input_ids: torch.Tensor,
                 target_hidden: torch.Tensor, plan: BlockPlan, attention_mask: torch.Tensor | None = None,
                 attn_backend: str = "auto", verifier: torch.Tensor | None = None,
                 verifier_head: nn.Module | None = None, span: Span | None = None) -> LossOutput:
        """The objective on one batch: input_ids [Bsz, T], target_hidden [Bsz, T, taps * H] (the tap
        states), ``plan`` on input_ids' device (dflash.model.blocks.plan_blocks), ``verifier``
        [Bsz, T, Hv] with ``verifier_head`` when ``needs_verifier``. ``span(category)`` times the
        drafter's pass as ``drafter_forward`` and what the terms time apart (the verifier's logits)."""
        span = span or (lambda _category: nullcontext())
        if self.needs_verifier and (verifier is None or verifier_head is None):
            raise ValueError(f"objective {self.describe()} needs the verifier's final states and head")
        cfg = drafter.config
        # bs: the plan's block (its slot k labelled x[a + k]); a DSpark block drafts from its anchor slot,
        # so its plan is one longer than the block the drafter runs (DrafterConfig.plan_block_size)
        bs, device = cfg.plan_block_size, input_ids.device
        shift = cfg.block_size - bs + 1  # the drafter slots before a block's first drafting one (1 or 0)
        # Padding blocks sit at position 0: computed like the others, never supervised, never counted. The
        # pass runs on a batch with nothing to learn from too: under DDP every rank's step is one forward and
        # one backward, and the other ranks wait in that forward's collectives (a rank that skipped it hung
        # the job at the next step).
        anchors = plan.anchors.clamp(min=0)
        if anchors.shape[1] == 0:  # no block planned at all: one at position 0 per row, for the pass alone
            anchors = anchors.new_zeros((anchors.shape[0], 1))
        with span("drafter_forward"):
            hidden, extras = run_blocks(drafter, embed_tokens, input_ids, target_hidden, anchors, attention_mask,
                                        attn_backend)
        if plan.num_tokens == 0:  # a batch of bad samples, responses shorter than two tokens: a zero loss
            zero = (hidden.sum() + sum(p.sum() for p in drafter.parameters())) * 0.0  # on every parameter
            return LossOutput(zero, torch.zeros(bs + 1 + len(self.terms) + len(self.metric_names), device=device),
                              0, [0] * (bs - 1), self.term_names, self.metric_names)
        with span("drafter_forward"):
            # Plan slot k of flat block b is drafter slot k - 1 + shift, row b * B + k - 1 + shift of the
            # (contiguous) output, i.e. sel + (b + 1) * shift: only supervised slots go through the (large)
            # LM head, with no copy of all slots.
            rows = plan.sel + (torch.div(plan.sel, bs - 1, rounding_mode="floor") + 1) * shift
            h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
        fwd = Forward(hidden, h, plan, lm_head, bs, verifier, verifier_head, extras, span, input_ids, cfg.gamma,
                      drafter, selector=self.selector_of(drafter))
        # the token term first: the others read the position weights (and candidates) it leaves on fwd
        values = {self.token_term.name: self.token_term(fwd)}
        values.update({t.name: t(fwd) for t in self.terms if t is not self.token_term})
        with span("drafter_forward"):
            loss = sum(t.weight * values[t.name].value for t in self.terms)
            with torch.no_grad():
                pred = values[self.token_term.name].pred
                correct = (pred == plan.labels).float()
                per_slot = torch.zeros(bs - 1, device=device).index_add_(0, plan.slot, correct)
                grid = torch.zeros(plan.shape[0] * plan.shape[1] * (bs - 1), device=device)
                runs = grid.index_copy_(0, plan.sel, correct).view(-1, bs - 1).cumprod(dim=-1).sum()
                terms = torch.stack([values[t.name].value.detach().float() for t in self.terms])
                measured = [values[t.name].metrics[m].float().reshape(1) for t in self.terms for m in t.metrics]
                stats = torch.cat([loss.detach().float().reshape(1), runs.reshape(1), per_slot, terms, *measured])
        return LossOutput(loss, stats, plan.num_blocks, plan.per_position_count, self.term_names,
                          self.metric_names)

    def selector_of(self, drafter: nn.Module) -> nn.Module | None:
        """The drafter's candidate selector when a term needs CANDIDATES (None otherwise); one line when
        the drafter has none."""
        if CANDIDATES not in self.needs:
            return None
        selector = getattr(getattr(drafter, "module", drafter), "candidate_selector", None)  # DDP: .module
        if selector is None:
            raise ValueError(f"objective {self.describe()} needs a drafter with a candidate selector (DFlash2)")
        return selector

    def on_batch(self, drafter: nn.Module, embed_tokens: nn.Module, lm_head: nn.Module, input_ids: torch.Tensor,
                 target_hidden: torch.Tensor, loss_mask: torch.Tensor, num_anchors: int = 512,
                 generator: torch.Generator | None = None,
                 anchors: tuple[torch.Tensor, torch.Tensor] | None = None, **kw: Any) -> LossOutput:
        """The objective with the plan built here from ``loss_mask`` (given ``anchors`` (anchors, keep)
        or sampled with ``generator``), reading the batch back to the host: for tests and one-off use;
        the trainer builds plans in its batch producer."""
        bs = drafter.config.plan_block_size
        plan = plan_blocks(input_ids.cpu(), loss_mask.cpu(), bs, num_anchors, generator,
                           None if anchors is None else (anchors[0].cpu(), anchors[1].cpu()))
        return self(drafter, embed_tokens, lm_head, input_ids, target_hidden, plan.to(input_ids.device), **kw)


class PositionWeight(ABC):
    """How a token term weighs its supervised slots: ``__call__(plan, block_size, confidence)`` ->
    (weight per slot [S], the denominator of the weighted sum). ``confidence`` [S] (the drafter's
    probability of the slot's label, detached) is given to weightings that ask for it."""

    name: ClassVar[str]
    needs_confidence: ClassVar[bool] = False

    @abstractmethod
    def __call__(self, plan: BlockPlan, block_size: int,
                 confidence: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Weights and denominator for one batch."""


class TokenTerm(Term):
    """A term over the block's tokens through the LM head (ce, kl): a per-slot loss, chunked through
    the head (head.py), weighed by position. Subclasses give the per-chunk loss and, if they compare
    with the verifier, the reference for a chunk's rows; the chunk loss returns the extras ``pred``
    (the drafter's top-1 token) and, where it has it, ``confidence`` (its probability of the label)."""

    predicts_tokens = True
    head_passes = 2  # the drafter's logits, and their gradient with respect to its states (head.py)

    def __init__(self, weighting: PositionWeight, weight: float = 1.0) -> None:
        super().__init__(weight)
        self.weighting = weighting

    @abstractmethod
    def chunk_loss(self, fwd: Forward) -> tuple[ChunkLoss, Callable[[slice], Any] | None]:
        """The per-chunk loss for this pass and the reference it reads (None: the data's labels only)."""

    def __call__(self, fwd: Forward) -> TermValue:
        from dflash.objectives.dspark_pass import dspark_rows, uses_dspark_pass

        if uses_dspark_pass(fwd) and fwd.selector is not None:
            raise ValueError("a DSpark drafter's pass keeps no candidates for a selector")
        if uses_dspark_pass(fwd):  # the drafter biases its own logits: its one shared pass (dspark_pass.py)
            if self.name != "ce":
                raise ValueError(f"a DSpark drafter's token term is cross-entropy, not {self.name!r}")
            rows = dspark_rows(fwd)
            per_slot, extras = rows["ce"], {"pred": rows["pred"], "confidence": torch.exp(-rows["ce"].detach())}
        else:
            loss, reference = self.chunk_loss(fwd)
            if fwd.selector is not None:  # its candidates from these chunks' logits: no head pass of its own
                loss = top_k_loss(loss, fwd.selector.top_k)
            per_slot, extras = head_rows(fwd.lm_head, fwd.h, loss, reference, span=fwd.span)
            fwd.candidates = extras.get("candidates")
        confidence = extras.get("confidence")
        if self.weighting.needs_confidence and confidence is None:
            raise ValueError(f"position weight {self.weighting.name!r} needs the drafter's confidence in the label, "
                             f"which loss {self.name!r} does not compute")
        w, den = self.weighting(fwd.plan, fwd.block_size, confidence)
        fwd.position_weights = (w, den)
        return TermValue((per_slot * w).sum() / den, extras["pred"])
