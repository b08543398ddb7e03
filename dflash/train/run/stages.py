"""The three stages of a training step, each usable alone (sync mode) or in its own thread (pipeline).

* BatchSource: deterministic batch ``i`` of the dataset (so a resumed run sees the same data), bucketed by
  length so a batch pads little; its position counted in samples (DataPosition).
* TargetStage: the target's hidden states at the tap layers (computed, or read), moved toward the drafter's device;
  rows whose states could not be read (a cache's bad samples) masked out of the batch (mask_rows).
* DrafterStage: anchors/blocks, drafter forward, backward, optimizer step.

Every stage times itself into a telemetry worker handle; which thread runs it is the pipeline's business.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from dflash.data import Sample
from dflash.model.blocks import BlockPlan, LossOutput, plan_blocks
from dflash.objectives import Objective
from dflash.objectives.optim import build_optimizer
from dflash.targets.base import Target
from dflash.telemetry.wire.vocab import Gauge
from dflash.train.config import OptimSettings
from dflash.train.device.flops import FlopCount
from dflash.train.distributed import explain_backward_error
from dflash.train.health.faults import FaultPlan
from dflash.train.health.nonfinite import NonFiniteGuard


@dataclass
class Batch:
    index: int  # position in the run's batch sequence: the data position a checkpoint records
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T] 1 = real token
    loss_mask: torch.Tensor  # [B, T] 1 = the drafter learns to predict this token
    num_tokens: int = 0  # real tokens, counted on the host while building (no device read later)
    plan: BlockPlan | None = None  # the blocks the drafter trains on (see blocks.plan_blocks)
    sample_ids: list[int] = field(default_factory=list)  # each row's index in the data set (a cache's key)
    skipped: list[int] = field(default_factory=list)  # rows masked out: their sample did not read (mask_rows)
    flops: float = 0.0  # the model FLOPs of the step on this batch, counted where it is built (0: not counted)

    def pin_memory(self) -> Batch:
        """Page-locked copies: a non-blocking host-to-device copy from pageable memory is not
        asynchronous (the driver stages it and waits for the stream first)."""
        return replace(self, input_ids=self.input_ids.pin_memory(), attention_mask=self.attention_mask.pin_memory(),
                       loss_mask=self.loss_mask.pin_memory(),
                       plan=None if self.plan is None else self.plan.pin_memory())


@dataclass
class HiddenBatch:
    batch: Batch
    # [B, T, taps * H] (+ H: the target's final state, for an objective that needs the verifier), on the
    # drafter's device once `ready` has fired
    hidden: torch.Tensor
    ready: Any = None  # CUDA event recorded after the copy (None on CPU: nothing to wait for)


#: a bucketed epoch sorts its order by length in windows of this many steps: wide enough that a step's
#: rows are close in length, narrow enough that the order stays random at the scale of the epoch
BUCKET_WINDOW_STEPS = 64


@dataclass(frozen=True)
class DataPosition:
    """Where a run stands in its data, in samples (not batches), so a run resumed with another world size
    or batch size takes up exactly where it stopped: ``consumed`` samples of epoch ``epoch``'s order are
    done; that order was built for steps of ``step`` samples (batch size x world size; a bucketed order
    depends on it), bucketed by length or not; ``samples``: the training samples it orders."""

    epoch: int
    consumed: int
    step: int
    bucketed: bool
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "step": self.step, "bucketed": self.bucketed,
                "samples": self.samples}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataPosition:
        """A checkpoint's record (its own file, trusted no further than its types)."""
        try:
            pos = cls(int(d["epoch"]), int(d["consumed"]), int(d["step"]), bool(d["bucketed"]), int(d["samples"]))
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"a checkpoint's data position does not read: {d!r}") from None
        if min(pos.epoch, pos.consumed, pos.samples) < 0 or pos.step < 1:
            raise ValueError(f"a checkpoint's data position is out of range: {d!r}")
        return pos


def sample_lengths(samples: Sequence[Sample]) -> np.ndarray:
    """Each sample's token count: the sequence's own ``lengths`` where it keeps them (a token store
    does), else counted once here."""
    lengths = getattr(samples, "lengths", None)
    if lengths is not None:
        return np.asarray(lengths, dtype=np.int64)
    return np.fromiter((len(s.input_ids) for s in samples), dtype=np.int64, count=len(samples))


def bucketed_order(lengths: np.ndarray, seed: int, epoch: int, step: int,
                   window_steps: int = BUCKET_WINDOW_STEPS) -> np.ndarray:
    """An epoch's order (positions into ``lengths``) in which every run of ``step`` samples from the start
    has rows of similar length: shuffle, sort each window of ``window_steps`` steps by length, cut the
    windows into steps and shuffle the steps. The ``len % step`` samples that fill no step go last, drawn
    at random before sorting (never always the longest). Every position appears once."""
    rng = np.random.default_rng([seed, epoch, 0xB0C4E7])  # its own stream, apart from the unbucketed order's
    n = len(lengths)
    perm = rng.permutation(n)
    full = n // step * step
    head, tail = perm[:full], perm[full:]
    window = np.arange(full) // (step * window_steps)
    head = head[np.lexsort((lengths[head], window))]  # by window, then by length (stable: ties keep the shuffle)
    steps = head.reshape(-1, step)[rng.permutation(full // step)]
    return np.concatenate([steps.reshape(-1), tail])


class BatchSource:
    """Batch ``i`` is a pure function of (samples, seed, i, rank, world size) and the position the run
    resumed from: epochs are reshuffled with seed + epoch; one step takes the next ``batch_size x
    world_size`` samples of the epoch's order and rank ``r`` takes slice ``r`` of them: every rank sees the
    same order, no two ranks share a sample within an epoch, and the samples left over at an epoch's end
    (fewer than a step) wait for a later epoch.

    ``bucket``: order each epoch so that a step's rows have similar lengths (bucketed_order): a batch pads
    to its longest row, and the target's forward pays for every padded slot; the ranks of one step get
    neighbours in length, so no rank waits long for another in the all-reduce. Off: a plain shuffle.

    ``train``: the positions in ``samples`` to train on (default all; rows held out for evaluation are
    left out); batches still name their rows by their position in ``samples`` (``Batch.sample_ids``, which
    a cache's files are keyed by).

    The data position counts samples: ``position(i)`` is where batch ``i`` starts, what a checkpoint
    records, and ``resume_at`` continues from one recorded under another world size or batch size without
    repeating or skipping a sample of that epoch.

    Given ``block_size`` and ``num_anchors`` it also samples each batch's anchors (its BlockPlan) from
    a generator seeded by (seed, rank, i): host work done by the batch producer, off the drafter's
    thread, and as reproducible on resume as the data itself. ``pin``: page-lock every batch (for a
    CUDA target or drafter)."""

    def __init__(self, samples: Sequence[Sample], batch_size: int, seed: int, pad_id: int, rank: int = 0,
                 world_size: int = 1, block_size: int | None = None, num_anchors: int | None = None,
                 pin: bool = False, in_order_first: bool = False, flops: FlopCount | None = None,
                 bucket: bool = False, train: Sequence[int] | None = None, stats: Any = None):
        """``flops``: counts each batch's model FLOPs (None: not counted). Here, on the producer's thread, with
        the rest of the host work a batch's data decides: the drafter's thread reads nothing. ``stats``: the
        ProfileStats the padding share is published to (None: counted, not published)."""
        self.train = np.arange(len(samples)) if train is None else np.asarray(train, dtype=np.int64)
        n = len(self.train)
        if n < batch_size * world_size:
            batch_size = max(1, n // world_size)
        self.samples, self.batch_size, self.seed, self.pad_id = samples, batch_size, seed, pad_id
        self.rank, self.world_size = rank, world_size
        self.block_size, self.num_anchors, self.pin = block_size, num_anchors, pin
        self.in_order_first = in_order_first  # epoch 0 unshuffled: a cache still being written, in row order
        self.flops, self.bucket, self.stats = flops, bucket, stats
        self.slots = self.real = 0  # the batches built so far: all their slots, and the real tokens among them
        self.step = batch_size * world_size  # samples per step, all ranks together
        self.per_epoch = n // self.step
        self._lengths: np.ndarray | None = None  # the training samples' lengths, read when first bucketed
        # batch index -> position: a fresh run starts at epoch 0's first sample
        self._origin = (0, DataPosition(0, 0, self.step, bucket, n))
        # (epoch, order's key, the order), replaced as one tuple: the batch producer and a reading-ahead
        # target both ask
        self._cached: tuple[int, tuple[int, bool], np.ndarray] = (-1, (0, False), np.empty(0, dtype=np.int64))

    @property
    def padding_share(self) -> float:
        """Padded slots over all slots of the batches built so far: what the target's forward pays for
        nothing (a batch pads to its longest row)."""
        return 1 - self.real / self.slots if self.slots else 0.0

    def resume_at(self, index: int, at: DataPosition) -> None:
        """Batch ``index`` starts at ``at`` (a checkpoint's record, made under any world size or batch
        size): the rest of that epoch is its order from there, cut into this run's steps; later epochs are
        this run's own."""
        if at.samples != len(self.train):
            raise ValueError(f"the checkpoint's data position counts {at.samples} training samples, the data "
                             f"has {len(self.train)} now: resume with the data the run started with")
        self._origin = (index, at)

    def position(self, index: int) -> DataPosition:
        """Where batch ``index`` starts (for the first batch not yet trained on: what a checkpoint records)."""
        first, at = self._origin
        if index < first:
            raise ValueError(f"batch {index} comes before the position this run resumed from (batch {first})")
        j, n = index - first, len(self.train)
        left = (n - at.consumed) // self.step  # this run's steps that still fit in the resumed epoch
        if j < left:
            return replace(at, consumed=at.consumed + j * self.step)
        j -= left
        return DataPosition(at.epoch + 1 + j // self.per_epoch, j % self.per_epoch * self.step, self.step,
                            self.bucket, n)

    def _order(self, at: DataPosition) -> np.ndarray:
        """Epoch ``at.epoch``'s order of the training samples (positions in ``samples``)."""
        key = (at.step, at.bucketed) if at.bucketed else (0, False)  # a plain shuffle has no step in it
        epoch, cached_key, order = self._cached
        if (epoch, cached_key) != (at.epoch, key):
            n = len(self.train)
            if at.epoch == 0 and self.in_order_first:
                local = np.arange(n)
            elif at.bucketed:
                if self._lengths is None:
                    self._lengths = sample_lengths(self.samples)[self.train]
                local = bucketed_order(self._lengths, self.seed, at.epoch, at.step)
            else:
                perm = list(range(n))
                random.Random(self.seed * 1_000_003 + at.epoch).shuffle(perm)
                local = np.asarray(perm, dtype=np.int64)
            order = self.train[local]
            self._cached = (at.epoch, key, order)
        return order

    def anchor_generator(self, index: int) -> torch.Generator:
        """The generator batch ``index``'s anchors are drawn from on this rank."""
        return torch.Generator().manual_seed((self.seed * 1_000_003 + self.rank) * 1_000_000_007 + index)

    def sample_ids(self, index: int) -> list[int]:
        """The positions in ``samples`` of batch ``index``'s rows on this rank."""
        at = self.position(index)
        first = at.consumed + self.rank * self.batch_size
        return self._order(at)[first:first + self.batch_size].tolist()

    def __call__(self, index: int) -> Batch:
        picked = self.sample_ids(index)
        rows = [self.samples[j] for j in picked]
        width = max(len(r.input_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        loss = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, r in enumerate(rows):
            # a row may be a list or a token store's read-only memory-mapped array: numpy copies either
            # straight into the batch's slots (torch would wrap a read-only array and warn about it)
            n = len(r.input_ids)
            ids[i, :n].numpy()[:] = r.input_ids
            attn[i, :n] = 1
            loss[i, :n].numpy()[:] = np.asarray(r.loss_mask) != 0
        plan = None
        if self.block_size is not None and self.num_anchors is not None:
            plan = plan_blocks(ids, loss, self.block_size, self.num_anchors, self.anchor_generator(index))
        batch = Batch(index, ids, attn, loss, sum(len(r.input_ids) for r in rows), plan, list(picked))
        self.slots += ids.numel()
        self.real += batch.num_tokens
        if self.stats is not None:
            self.stats.gauge(Gauge.PADDING_SHARE, self.padding_share)
        if self.flops is not None and plan is not None:
            batch.flops = self.flops.of_batch(batch).total
        return batch.pin_memory() if self.pin else batch


def mask_rows(batch: Batch, rows: list[int], flops: FlopCount | None = None) -> Batch:
    """``batch`` with ``rows`` taken out of training (a cache's bad samples): their loss mask off and their
    blocks dropped from the plan, every other row's blocks and labels as they were. The tensors keep their
    shape (a step's sizes stay what memory was fitted to), and rows never see each other in the drafter's
    pass while every loss and weight is taken over the planned slots, so the step is the step on the batch
    without those rows. Host work, done where the rows were found bad (the target's thread), the step's
    FLOPs counted again with ``flops`` (the batch source's count)."""
    keep = torch.ones(batch.input_ids.shape[0], dtype=torch.bool)
    keep[rows] = False
    loss_mask = batch.loss_mask & keep[:, None]
    plan = batch.plan
    if plan is not None:  # the same anchors, unkept on those rows: no new draw, nothing else moves
        anchors = plan.anchors
        plan = plan_blocks(batch.input_ids, loss_mask, len(plan.per_position_count) + 1, plan.shape[1],
                           anchors=(anchors.clamp(min=0), (anchors >= 0) & keep[:, None]))
    if batch.input_ids.is_pinned():  # the batch was page-locked for an asynchronous copy: so are its new parts
        loss_mask = loss_mask.pin_memory()
        plan = None if plan is None else plan.pin_memory()
    tokens = batch.num_tokens - int(batch.attention_mask[~keep].sum())
    masked = replace(batch, loss_mask=loss_mask, plan=plan, num_tokens=tokens, skipped=sorted(set(rows)))
    if flops is not None and plan is not None:
        masked.flops = flops.of_batch(masked).total
    return masked


class TargetStage:
    """The pipeline's first stage: one replica of whatever produces hidden states (dflash.targets), on
    one device, timed under the category it names (`target_forward` for a model run here). Its output
    is on the drafter's device (or on its way there)."""

    def __init__(self, target: Target, drafter_device: torch.device, telemetry, name: str = "target-0",
                 faults: FaultPlan | None = None, index: int = 0, final: bool = False, flops: FlopCount | None = None):
        """`final`: append the target's final state to the taps (the objective compares with the
        verifier's distribution); `flops`: the batch source's count, to count a batch again when rows are
        masked."""
        self.target, self.drafter_device, self.tel, self.name = target, drafter_device, telemetry, name
        self.final = final
        self.faults = faults  # DFLASH_FAULT injection (tests and drills); None in a normal run
        self.fault_stage = f"target-{index}"  # the stage name fault plans use for this replica
        self.device = target.device
        if self.device.type == "cuda" and drafter_device.type != "cuda":
            # The drafter would have to wait on the host for every copy; config validation refuses it.
            raise ValueError(f"a target on {self.device} needs a CUDA drafter, not {drafter_device}")
        # A side stream for the copy so the next forward is not queued behind it (on the source GPU: a
        # copy between GPUs runs on the source device's current stream).
        self.copy_stream = None
        if drafter_device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(device=self.device if self.device.type == "cuda" else drafter_device)
        self.span = device_span(telemetry, self.device)
        self.flops = flops

    def __call__(self, batch: Batch) -> HiddenBatch:
        if self.target.waits_for_inputs:
            with self.tel.span("cache_wait"):
                self.target.wait_ready(batch)
        with self.span(self.target.span_category):
            t0 = time.perf_counter()
            hidden = self.target.hidden_states(batch, final=True) if self.final else self.target.hidden_states(batch)
            if skipped := self.target.skipped_rows(batch):  # bad samples: zeros, never trained on
                batch = mask_rows(batch, skipped, self.flops)
            if self.faults is not None:
                self.faults.delay(self.fault_stage, batch.index, time.perf_counter() - t0)
        with self.tel.span("pack_hidden"):
            if self.copy_stream is None:
                return HiddenBatch(batch, hidden)
            if self.device.type == "cpu":
                hidden = hidden.pin_memory()  # pinned memory makes the host-to-device copy truly async
            else:
                self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                moved = hidden.to(self.drafter_device, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            if hidden.is_cuda:
                # The caching allocator must not hand this memory out again before the copy finishes.
                hidden.record_stream(self.copy_stream)
            return HiddenBatch(batch, moved, ready)


def device_span(telemetry, device: torch.device) -> Callable[[str], Any]:
    """The span a stage on ``device`` times its compute with: on a GPU a CUDA-event span on the calling
    thread's current stream *of that device* (right even in sync mode, where one thread drives a target
    and a drafter on two GPUs); on the CPU a host span, since CPU compute is synchronous."""
    if device.type != "cuda":
        return telemetry.span
    return lambda category: telemetry.cuda_span(category, torch.cuda.current_stream(device))


@dataclass
class StepResult:
    """One optimizer step. ``out`` and ``grad_norm`` hold device tensors (read once per log interval by
    the main thread, never by the step); the rest are host numbers."""

    out: LossOutput
    grad_norm: torch.Tensor
    lr: float
    tokens: int
    samples: int
    flops: float = 0.0  # the step's model FLOPs (its batch's, counted on the host; 0: not counted)


def lr_at(progress: float, base_lr: float, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warmup then cosine decay, as a function of run progress in [0, 1]."""
    if warmup_ratio > 0 and progress < warmup_ratio:
        return base_lr * max(progress / warmup_ratio, 1e-3)
    p = min(1.0, (progress - warmup_ratio) / max(1e-9, 1 - warmup_ratio))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


class DrafterStage:
    """The drafter, its objective and optimizer, and the target's frozen embedding and LM head (and, for
    an objective that needs the verifier, its final norm) on the drafter's device."""

    def __init__(self, drafter, embed_tokens, lm_head, device: torch.device, telemetry, generator, *,
                 optim: OptimSettings, num_anchors: int, nonfinite_limit: int, objective: Objective,
                 ddp: torch.nn.Module | None = None, faults: FaultPlan | None = None,
                 verifier_head: torch.nn.Module | None = None):
        """`ddp`: the drafter wrapped in DistributedDataParallel (multi-rank runs); the forward goes
        through it so that backward averages gradients across ranks. `generator` samples anchors for
        batches that come without a plan. `verifier_head`: the target's final norm and LM head, when
        the objective needs the verifier (the hidden states then end with the target's final state).
        `objective`: the run's (build.py makes it: objectives.for_drafter). `num_anchors`: per sample, for
        batches that come without a plan (build sets it again once the step is sized to the device)."""
        self.drafter, self.embed, self.lm_head = drafter, embed_tokens, lm_head
        self.objective, self.optim, self.num_anchors = objective, optim, num_anchors
        self.verifier_head = verifier_head
        self.forward_module = ddp if ddp is not None else drafter
        self.device, self.tel, self.generator = device, telemetry, generator
        self.optimizer = build_optimizer(drafter, optim, device)
        # bf16 activations on CUDA with fp32 master weights; plain fp32 on CPU (bf16 matmuls are
        # slower than fp32 on the CPUs we measured).
        self.autocast = device.type == "cuda"
        self.guard = NonFiniteGuard(self.optimizer, device, nonfinite_limit)
        self.faults = faults
        self.span = device_span(telemetry, device)

    def step(self, hb: HiddenBatch, progress: float) -> StepResult:
        """One training step that never waits for the device: every copy is non-blocking from pinned
        memory, every shape is known on the host, and the metrics stay on the device. Timed as one step:
        the drafter's pass and its LM head's chunks are one ``drafter_forward`` sample (their sum), so the
        category's n counts steps and its percentiles describe steps."""
        with self.tel.step():
            return self._step(hb, progress)

    def _step(self, hb: HiddenBatch, progress: float) -> StepResult:
        b = hb.batch
        with self.tel.span("h2d"):
            if hb.ready is not None:
                # Wait on the copy's event on our stream (no host sync), and keep the tensor alive for it.
                torch.cuda.current_stream(self.device).wait_event(hb.ready)
                hb.hidden.record_stream(torch.cuda.current_stream(self.device))
            ids = b.input_ids.to(self.device, non_blocking=True)
            attn = b.attention_mask.to(self.device, non_blocking=True)
            plan = b.plan if b.plan is not None else plan_blocks(
                b.input_ids, b.loss_mask, self.drafter.config.plan_block_size, self.num_anchors, self.generator)
            plan = plan.to(self.device)
        for term in self.objective.terms:
            term.at(progress)  # a scheduled weight (DFlash2's selector ramps in)
        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.autocast):
            t0 = time.perf_counter()
            out = self.loss(ids, hb.hidden, plan, attn)
            if self.faults is not None:
                with self.span("drafter_forward"):
                    self.faults.delay("drafter", b.index, time.perf_counter() - t0)
                if self.faults.poison(b.index):
                    out.loss = out.loss * float("nan")
        with self.span("drafter_backward"):
            try:
                out.loss.backward()
            except RuntimeError as e:
                if self.forward_module is self.drafter:
                    raise
                raise explain_backward_error(self.forward_module, e, torch.distributed.get_rank()) from None
        with self.span("optimizer_step"):
            lr = lr_at(progress, self.optim.lr, self.optim.warmup_ratio, self.optim.min_lr_ratio)
            for g in self.optimizer.param_groups:
                g["lr"] = lr * g["lr_scale"]
            grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.optim.grad_clip)
            rows = b.input_ids.shape[0]
            # A batch of bad samples only takes no step: nothing was learnt, and AdamW would still move the
            # weights by its moments. Across ranks the averaged gradient is every rank's step: none skips alone.
            if len(b.skipped) < rows or self.forward_module is not self.drafter:
                self.guard.step(out.loss, grad_norm, b.index)  # skips a non-finite step, on the device
            self.optimizer.zero_grad(set_to_none=True)
        return StepResult(out=out, grad_norm=grad_norm.detach(), lr=lr, tokens=b.num_tokens,
                          samples=rows - len(b.skipped), flops=b.flops)

    def loss(self, ids: torch.Tensor, hidden: torch.Tensor, plan: BlockPlan,
             attention_mask: torch.Tensor | None = None, span: Any = None) -> LossOutput:
        """The objective on one batch on the drafter's device (the caller sets autocast): ``hidden`` the
        tap states, followed by the target's final state when the objective needs the verifier. The
        drafter's work is timed as ``drafter_forward``, the verifier's logits as ``verifier_logits``
        (``span``: the stage's own unless given)."""
        verifier = None
        if self.verifier_head is not None:
            width = hidden.shape[-1] - self.verifier_head.weight.shape[1]  # the final state is one hidden wide
            hidden, verifier = hidden[..., :width], hidden[..., width:]
        return self.objective(self.forward_module, self.embed, self.lm_head, ids, hidden, plan, attention_mask,
                              verifier=verifier, verifier_head=self.verifier_head,
                              span=self.span if span is None else span)
