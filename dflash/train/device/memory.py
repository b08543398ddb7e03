"""Sizing a step to the device's memory, and watching the allocator while it trains.

The published recipe (batch 8 x 512 anchors x block 16) needs ~92 GiB of drafter activations for a
5-layer drafter of an 8B target, on top of ~38 GiB of weights, gradients and AdamW state: more than
an H200 has. So on a GPU the batch (and, if even one sample does not fit, the anchors) is chosen from
the device's free memory with an activation model measured at start:

* **Measured, not estimated.** ``measure_activations`` runs the real drafter forward a few times at
  small sizes on its device, under the dtype the step uses (bf16 autocast on CUDA), and counts the
  bytes autograd saves for backward (``saved_tensors_hooks``): the bytes per query token (anchors x
  block, all layers and the head) and per sample at a given sequence length.
* **Fitted.** ``fit_recipe``: the largest batch up to the configured one whose activations, plus the
  hidden states in flight and what the first step still allocates (gradients, AdamW's two moments),
  stay under ``HEADROOM`` of the free memory; anchors shrink only when even batch 1 does not fit.
* **Said.** One line at start names the choice, the free memory and the measured bytes per query token
  per drafter layer.

``AllocatorRetries`` turns the caching allocator's ``num_alloc_retries`` into an event when it rises:
a retry frees cached blocks and synchronises the device, a stall the step's own timing hides.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash.objectives.head import chunk_peak_bytes
from dflash.train import distributed
from dflash.train.device.binding import cuda_ordinal
from dflash.train.run.pipeline import reorder_window

#: the share of free memory a step may plan to fill: the rest absorbs what saved tensors do not show
#: (backward's transient gradients, allocator fragmentation); the head's chunk is counted in the plan
HEADROOM = 0.9
GIB = 1 << 30


@dataclass(frozen=True)
class ActivationModel:
    """Bytes a training step keeps for backward, as a linear function of its size (measured)."""

    per_query_token: float  # bytes per query token (block slot), all drafter layers and the head together
    per_sample: float  # bytes per sample beyond its query tokens: its context (the sequence) at seq_len
    per_step: float  # bytes whatever the batch (autocast's weight copies, ...)
    layers: int
    seq_len: int

    @property
    def per_query_token_layer(self) -> float:
        """The figure to compare across drafters: bytes per query token per drafter layer."""
        return self.per_query_token / self.layers

    def sample_bytes(self, anchors: int, block: int) -> float:
        return self.per_sample + anchors * block * self.per_query_token


def saved_bytes(run: Callable[[], Any], exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd still keeps for backward when ``run()`` returns (the graph
    is dropped afterwards). Storages in ``exclude`` (parameters: they exist anyway) are not counted.

    A tensor saved and freed again before the end (a chunk's graph, released once its gradient is taken)
    is not counted: each saved tensor is watched through a weak reference, and only the live ones are
    summed, by storage. (Keying by address alone let a later tensor at a freed one's address hide it, so
    the figure depended on how the allocator happened to reuse memory.)"""
    saved: list[tuple[int, int, weakref.ref]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            saved.append((s.data_ptr(), s.nbytes(), weakref.ref(t)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
        live = {ptr: nbytes for ptr, nbytes, ref in saved if ref() is not None}
    del out
    return sum(live.values())


def measure_activations(stage: Any, hidden_width: int, hidden_dtype: torch.dtype, seq_len: int,
                        probe_anchors: int = 8) -> ActivationModel:
    """Measure ``stage``'s drafter (a DrafterStage) at `seq_len` tokens: three forwards (batch 1 and 2
    at `probe_anchors`, batch 1 at twice as many) on its device, as the step runs them."""
    from contextlib import nullcontext

    from dflash.model.blocks import plan_blocks

    drafter, device = stage.drafter, stage.device
    block = drafter.config.block_size  # queries per block (a DSpark plan is one slot longer: its labels)
    params = {p.untyped_storage().data_ptr() for m in (drafter, stage.embed, stage.lm_head) for p in m.parameters()}
    gen = torch.Generator().manual_seed(0)

    def probe(batch: int, anchors: int) -> int:
        ids = torch.randint(0, drafter.config.vocab_size, (batch, seq_len), generator=gen)
        loss_mask = torch.ones_like(ids, dtype=torch.bool)
        plan = plan_blocks(ids, loss_mask, drafter.config.plan_block_size, anchors, gen).to(device)
        hidden = torch.randn(batch, seq_len, hidden_width, generator=gen).to(device, hidden_dtype)
        ids = ids.to(device)

        def forward():  # the step's own objective (and verifier head), untimed
            with torch.autocast(device.type, torch.bfloat16, enabled=stage.autocast):
                return stage.loss(ids, hidden, plan, span=lambda _category: nullcontext()).loss

        # the states are counted as the batches in flight, not as activations
        return saved_bytes(forward, params | {hidden.untyped_storage().data_ptr()})

    anchors = max(1, min(probe_anchors, (seq_len - 1) // block))
    one, two, more = probe(1, anchors), probe(2, anchors), probe(1, 2 * anchors)
    per_query = max(0.0, (more - one) / (anchors * block))
    sample = max(0.0, two - one)  # everything per sample at `anchors`
    per_sample = max(0.0, sample - anchors * block * per_query)
    return ActivationModel(per_query, per_sample, max(0.0, one - sample), drafter.config.num_layers, seq_len)


@dataclass(frozen=True)
class Fit:
    """A batch and anchor count that fits, and the budget it was fitted to (bytes)."""

    batch: int
    anchors: int
    free: float  # free device memory at the start
    fixed: float  # what every step needs whatever its size: first-step allocations, per-step activations
    per_sample: float  # activations and hidden states of one sample at `anchors`

    @property
    def need(self) -> float:
        return self.fixed + self.batch * self.per_sample


class RecipeError(ValueError):
    """Not even one sample with one anchor fits; the message is one line for the user."""


def fit_recipe(free: float, fixed: float, sample_bytes: Callable[[int], float], batch: int, anchors: int,
               headroom: float = HEADROOM) -> Fit:
    """The largest batch up to `batch` at `anchors` whose step fits ``headroom`` of `free`; when even
    batch 1 does not, batch 1 with the most anchors that fit (`sample_bytes(anchors)` must grow with
    the anchors: it is linear in them)."""
    budget = free * headroom - fixed
    if budget > 0 and sample_bytes(anchors) > 0:
        fits = min(batch, int(budget // sample_bytes(anchors)))
        if fits >= 1:
            return Fit(fits, anchors, free, fixed, sample_bytes(anchors))
    base, slope = sample_bytes(0), sample_bytes(1) - sample_bytes(0)
    most = int((budget - base) // slope) if slope > 0 else 0
    if most < 1:
        raise RecipeError(f"not even batch 1 with 1 anchor fits: {free / GIB:.1f} GiB free, {fixed / GIB:.1f} GiB "
                          f"needed before any sample and {sample_bytes(1) / GIB:.2f} GiB per sample; use a "
                          "smaller drafter (--drafter-layers), a shorter --max-seq-len, or a GPU of its own "
                          "for the target (--target-devices)")
    return Fit(1, min(anchors, most), free, fixed, sample_bytes(min(anchors, most)))


def free_bytes(device: torch.device) -> int:
    """What this process can still allocate on ``device``: the driver's free memory plus what our
    caching allocator holds unused."""
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def trained_bytes(drafter: torch.nn.Module) -> int:
    """Bytes of the parameters the optimizer trains: AdamW keeps two moments of each, in their dtype
    (Muon one: planning for AdamW's two leaves Muon's run some room)."""
    return sum(p.numel() * p.element_size() for p in drafter.parameters() if p.requires_grad)


def first_step_bytes(drafter: torch.nn.Module) -> int:
    """What the first optimizer step still allocates: a gradient per parameter and AdamW's two moments."""
    return 3 * trained_bytes(drafter)


def fit_to_device(stage: Any, hidden_width: int, hidden_dtype: torch.dtype, in_flight: int, *, seq_len: int,
                  batch_size: int, num_anchors: int, free: int | None = None) -> tuple[Fit, ActivationModel]:
    """Measure the drafter and fit the asked batch and anchors to its device (`free`: the free bytes,
    measured when not given). `in_flight`: hidden-state batches held on the drafter's device at once
    (the queue's, the one in use, the one being copied)."""
    block = stage.drafter.config.block_size
    model = measure_activations(stage, hidden_width, hidden_dtype, seq_len)
    hidden_per_sample = in_flight * seq_len * hidden_width * torch.empty((), dtype=hidden_dtype).element_size()
    # the LM head's one chunk of logits at a time (and what a loss holds beside them): a step's transient
    # peak that autograd never keeps, so the measuring forwards cannot see it
    head = chunk_peak_bytes(int(stage.lm_head.weight.shape[0]))
    fixed = first_step_bytes(stage.drafter) + model.per_step + head
    if free is None:
        free = free_bytes(stage.device)
    fit = fit_recipe(free, fixed, lambda a: model.sample_bytes(a, block) + hidden_per_sample,
                     batch_size, num_anchors)
    return fit, model


def describe(fit: Fit, model: ActivationModel, block: int, device: torch.device, asked: tuple[int, int]) -> str:
    """The start-of-run line about the recipe the device's memory allows."""
    chose = f"batch {fit.batch} x {fit.anchors} anchors x block {block}"
    change = "" if (fit.batch, fit.anchors) == asked else f" (asked: batch {asked[0]} x {asked[1]} anchors)"
    return (f"memory: {chose} fits {device}{change}: {fit.need / GIB:.1f} of {fit.free / GIB:.1f} GiB free "
            f"({fit.fixed / GIB:.1f} fixed + {fit.per_sample / GIB:.2f} per sample); activations "
            f"{model.per_query_token_layer / 1e3:.0f} KB per query token per drafter layer (measured at start)")


def plan_step(stage: Any, target: Any, target_devices: list[torch.device], *, seq_len: int, batch_size: int,
              num_anchors: int, hs_queue_size: int, free: int) -> tuple[Fit, ActivationModel]:
    """The memory plan of a step of ``stage`` (a DrafterStage) fed by ``target``: the asked batch and
    anchors fitted to ``free`` bytes, and the activation model it was fitted with. ``Fit.need`` is what
    the plan says the steps add to the device's allocated memory (scripts/gpu_check.py holds a measured
    peak to it)."""
    # hidden-state batches on the drafter's device at once: the one in use and the reorder window after it
    # (the queue's and one per target: the pipeline bounds it), and the one a target on the same device
    # is producing
    in_flight = 1 + reorder_window(hs_queue_size, len(target_devices)) + (stage.device in target_devices)
    # the taps, and the target's final state after them for an objective that needs the verifier
    width = (len(target.layer_ids) + (stage.verifier_head is not None)) * target.hidden_size
    return fit_to_device(stage, width, target.dtype, in_flight, seq_len=seq_len, batch_size=batch_size,
                         num_anchors=num_anchors, free=free)


def size_to_device(stage: Any, target: Any, target_devices: list[torch.device], dist: Any,
                   log: Callable[[str], None], *, seq_len: int, batch_size: int, num_anchors: int,
                   hs_queue_size: int, free: int | None = None) -> tuple[int, int]:
    """(batch size, anchors) for the step: on a CUDA drafter the asked ones fitted to the device's free
    memory (`free` bytes when given), said in one line (they only ever go down). Every rank takes the
    smallest fit of all, so that the ranks' batches, epochs and stops stay in step. The host keeps what
    was asked: the step does not plan against its memory."""
    if free is None:
        if stage.device.type != "cuda":
            return batch_size, num_anchors
        free = free_bytes(stage.device)
    fit, model = plan_step(stage, target, target_devices, seq_len=seq_len, batch_size=batch_size,
                           num_anchors=num_anchors, hs_queue_size=hs_queue_size, free=free)
    chosen = (fit.batch, fit.anchors)
    if dist.enabled:
        chosen = min(distributed.gather(dist, chosen))
    log(describe(fit, model, stage.drafter.config.block_size, stage.device, (batch_size, num_anchors))
        + ("" if chosen == (fit.batch, fit.anchors) else f"; batch {chosen[0]} x {chosen[1]} on every rank"))
    return chosen


class AllocatorRetries:
    """The caching allocator's retry count per device: an event when it rises (each retry frees the
    cache and synchronises the device), read where the allocator gauges are."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}

    def rose(self, index: int, retries: int) -> str | None:
        """The line to report when `retries` on device `index` grew since the last reading."""
        before = self._last.get(index)
        self._last[index] = retries
        if before is None or retries <= before:
            return None
        return (f"cuda:{index} allocator retried {retries - before} allocation(s) ({retries} in all): each "
                "one empties the cache and waits for the GPU; lower --batch-size or --num-anchors")


#: the caching allocator's driver calls in ``torch.cuda.memory_stats``: "num_device_alloc" counts cuMemMap
#: (expandable segments) and cudaMalloc, "num_device_free" cuMemUnmap and cudaFree (torch 2.5 and later);
#: before those, the segments allocated and freed ("segment.all.allocated"/"freed": cudaMalloc/cudaFree only)
DEVICE_CALLS = (("num_device_alloc", "num_device_free"), ("segment.all.allocated", "segment.all.freed"))


def segment_calls(stats: dict[str, Any]) -> tuple[int, int]:
    """(segments mapped or allocated, unmapped or freed) since the start, from one ``memory_stats`` reading."""
    for maps, frees in DEVICE_CALLS:
        if maps in stats and frees in stats:
            return int(stats[maps]), int(stats[frees])
    return 0, 0


def allocator_gauges(devices: list[torch.device]) -> dict[int, dict[str, int]]:
    """The caching allocator's counters per CUDA device in `devices` (none on the host: N/A there), with
    its driver calls (`segment_maps`, `segment_frees`, cumulative: ``segment_calls``) for the churn rates."""
    out = {}
    for d in devices:
        if d.type != "cuda":
            continue
        m = torch.cuda.memory_stats(d)
        i = cuda_ordinal(d)
        maps, frees = segment_calls(m)
        out[i] = {"allocated_bytes": m.get("allocated_bytes.all.current", 0),
                  "reserved_bytes": m.get("reserved_bytes.all.current", 0),
                  "alloc_retries": m.get("num_alloc_retries", 0),
                  "segment_maps": maps, "segment_frees": frees}
    return out

