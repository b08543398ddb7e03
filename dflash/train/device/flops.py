"""Model FLOPs of a training step, and the MFU they make on the run's devices: counted here once, for the
trainer's gauges and log line and for scripts/gpu_check.py.

What one step computes (dflash/model/blocks.py, dflash/objectives/), and what is counted of it:

* **The target** (in process only; a cache's states cost nothing here): a frozen forward over the batch,
  forward only. Every decoder layer's projections and MLP (a mixture of experts: the routed experts a
  token uses, the shared ones and the router) over each row's real tokens, and causal attention over
  them (a sliding layer: the last W positions). No LM head: the target stage stops at the decoder.
* **The drafter**, forward and backward: ``fc`` over each row's real tokens (backward: its weight
  gradient only, its input being the target's frozen states), and per layer the block slots' q/k/v/o
  projections and MLP, the context's k/v projections, and attention over the pairs the mask lets
  through (a block sees the context strictly before its anchor and its own slots; a sliding layer the
  window of masks.py). Backward is twice the forward (the input's and the weight's gradients). Kept
  blocks only: a row with fewer anchors than the batch's widest gets padding blocks, computed, never
  trained on.
* **The frozen LM head** on the supervised slots, once per pass the objective's terms make over it
  (``Term.head_passes``: a token loss's logits and their gradient with respect to the input, 2; the
  verifier's logits for ``kl``, one more; DFlash2's selector, none: its candidates are the token pass's
  top-k), 2 x hidden x vocabulary each; and DFlash2's selector: its candidates' K columns of the head
  (forward, and the gradient with respect to the state), its projection and its candidate scores
  (forward and backward). DFlash2's convolutions
  count with the drafter's layers (their kernel projections; the convolution itself is elementwise).

Counted: every matrix multiply, 2 FLOPs per multiply-add. Left out: norms, RoPE, activations, softmax,
losses and the optimizer: elementwise, linear in the width where a matmul is quadratic. These are
*model* FLOPs: the padding of shorter rows and of padding blocks, the masked-out pairs an attention
kernel still computes (all of them in SDPA's dense mask on the host; FlexAttention's partly visible
128 x 128 tiles on a GPU), the experts a MoE kernel computes for tokens not routed to them, and
recomputation (the selector's checkpointed chunks, a flash kernel's backward) are work the step does
but the model does not need, so MFU falls when they grow, which is what it is for.

Where this is exact and where it is not: tests/test_train_flops.py holds the count to torch's
FlopCounterMode on real drafter steps and target forwards, to the FLOP once the masked-out pairs and
padding it also counts are added. Approximated: a target's layers share one head size (its config's)
and a MoE layer counts ``num_experts_per_tok`` experts a token. A target with layers this count does
not know (Gated DeltaNet's linear attention, multi-head latent attention, per-layer head sizes) is
refused with the reason (``FlopCountError``): no figure is made up for it.

Everything here is a function of host numbers (each row's real tokens, the plan's anchors and
supervised slots), counted where the batch is built (its producer's thread; BatchSource, mask_rows):
nothing is read from a device, and the drafter's thread only adds up what its batches carry.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash.model.drafter import SLIDING
from dflash.telemetry.wire.table import tflops
from dflash.telemetry.wire.vocab import Gauge

FULL_KIND, SLIDING_KIND = "full_attention", "sliding_attention"

#: Dense bf16 tensor-core peaks by GPU name, TFLOP/s (the vendors' datasheets give twice these "with
#: sparsity"). First match wins, so the more specific names come first. A GPU not listed has no MFU.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH200 NVL\b", 835.0),
    (r"\bH100 NVL\b", 835.0),
    (r"\bH100 PCIe\b", 756.0),
    (r"\bG?H200\b", 989.0),  # H200 SXM and GH200: the H100 SXM's compute
    (r"\bH100\b", 989.0),  # H100 SXM ("NVIDIA H100 80GB HBM3")
    (r"\bB200\b", 2250.0),
    (r"\bA100\b", 312.0),  # SXM and PCIe alike
    (r"\bL40S\b", 362.0),
    (r"\bL4\b", 121.0),
)


class FlopCountError(ValueError):
    """The step's FLOPs cannot be counted for these shapes; the message says why, in one line."""


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU called ``device_name`` (``torch.cuda.get_device_name``), None if unknown."""
    for pattern, peak in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return peak
    return None


def devices_peak(devices: Sequence[torch.device]) -> tuple[float | None, str]:
    """(The run's peak in FLOP/s, what it is): the sum over its distinct devices of their dense bf16 peaks,
    since the step's FLOPs are spread over all of them; None where any device has none known (the host,
    a GPU not in the table), with the reason."""
    names = []
    for d in dict.fromkeys(devices):
        if d.type != "cuda":
            return None, f"no peak for {d.type}"
        names.append(torch.cuda.get_device_name(d))  # the driver's name: no work on the device
    unknown = [n for n in names if peak_tflops(n) is None]
    if not names or unknown:
        return None, f"no known bf16 peak for {unknown[0] if unknown else 'no device'}"
    peaks = [peak_tflops(n) for n in names]
    what = " + ".join(f"{n} {p:g}" for n, p in zip(names, peaks, strict=True))
    return sum(peaks) * 1e12, f"{what} TFLOP/s dense bf16 peak"


@dataclass(frozen=True)
class StepFlops:
    """One step's model FLOPs by part: the target's forward, the drafter's forward and backward, the LM head."""

    target: float = 0.0
    drafter: float = 0.0
    head: float = 0.0

    @property
    def total(self) -> float:
        return self.target + self.drafter + self.head


def _get(config: Any, name: str, default: Any = None) -> Any:
    value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
    return default if value is None else value


def causal_pairs(n: int, window: int | None = None) -> int:
    """(query, key) pairs of causal attention over ``n`` tokens; with a ``window`` each query sees the
    last ``window`` positions, its own included."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


@dataclass(frozen=True)
class _TargetLayer:
    window: int | None  # None: full causal attention
    per_token: float  # projections and MLP, FLOPs per token


def _target_layers(config: Any) -> tuple[list[_TargetLayer], int]:
    """The target's layers as this count sees them, and its attention width (heads x head size); raises
    FlopCountError for a layer it cannot count."""
    if _get(config, "kv_lora_rank") is not None or _get(config, "q_lora_rank") is not None:
        raise FlopCountError("the target's multi-head latent attention is not counted")
    if _get(config, "per_layer_attributes") or _get(config, "global_head_dim") is not None:
        raise FlopCountError("the target's per-layer head sizes are not counted")
    n_layers, hidden = int(_get(config, "num_hidden_layers")), int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    kv_heads = int(_get(config, "num_key_value_heads", heads))
    head_dim = int(_get(config, "head_dim", hidden // heads))
    window = _get(config, "sliding_window")
    kinds = _get(config, "layer_types")
    if not kinds:  # no per-layer kinds: every layer slides where the config turns a window on (Mistral)
        slides = window is not None and _get(config, "use_sliding_window", True)
        kinds = [SLIDING_KIND if slides else FULL_KIND] * n_layers
    other = sorted({k for k in kinds if k not in (FULL_KIND, SLIDING_KIND)})
    if other:
        raise FlopCountError(f"the target's {', '.join(other)} layers are not counted")
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    dense_mlp = 3 * hidden * int(_get(config, "intermediate_size", 4 * hidden))
    experts = int(_get(config, "num_experts", 0) or _get(config, "num_local_experts", 0)
                  or _get(config, "n_routed_experts", 0))
    moe_mlp = dense_mlp
    if experts:
        width = int(_get(config, "moe_intermediate_size", _get(config, "intermediate_size")))
        shared = int(_get(config, "shared_expert_intermediate_size", 0)
                     or _get(config, "n_shared_experts", 0) * width)
        moe_mlp = hidden * experts + 3 * hidden * (int(_get(config, "num_experts_per_tok")) * width + shared)
    dense_layers = set(range(int(_get(config, "first_k_dense_replace", 0))))
    dense_layers |= set(_get(config, "mlp_only_layers", []))
    step = int(_get(config, "decoder_sparse_step", 1))
    layers = []
    for i, kind in enumerate(kinds):
        sparse = experts and i not in dense_layers and (i + 1) % step == 0
        layers.append(_TargetLayer(int(window) if kind == SLIDING_KIND and window is not None else None,
                                   2.0 * (attention + (moe_mlp if sparse else dense_mlp))))
    return layers, heads * head_dim


class FlopCount:
    """Model FLOPs per step for one run's shapes: a drafter config, the transformers config of a target run
    in process (None: the states are read, not computed), and the LM head passes of the objective's terms.

    ``step(lengths, anchors, supervised)``: the FLOPs of a step over rows of ``lengths`` real tokens with
    kept blocks at ``anchors`` and ``supervised`` labelled slots. Raises FlopCountError at construction
    for a target it cannot count."""

    def __init__(self, drafter: Any, target: Any | None = None, head_passes: int = 2) -> None:
        d = drafter
        self.config, self.head_passes = d, head_passes
        self.target_layers, self.target_attention = _target_layers(target) if target is not None else ([], 0)
        h, attn_width, kv_width = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
        # per query token (block slot) and layer: q, o, the block's own k, v, and the MLP
        per_query = 2 * h * attn_width + 2 * h * kv_width + 3 * h * d.intermediate_size
        kernel = getattr(d, "conv_kernel_size", None)
        if kernel is not None:  # DFlash2: each sublayer's convolution predicts its kernels from the token
            per_query += 2 * h * 2 * kernel * (h // d.conv_group_size)
        self.per_query = 2.0 * per_query * d.num_layers
        self.per_context = 2.0 * 2 * h * kv_width * d.num_layers  # the context's k, v in every layer
        self.fc = 2.0 * len(d.target_layer_ids) * h * h  # per context token
        self.attention_width = attn_width
        # per supervised slot: the head's passes, and DFlash2's selector (its candidates' unary logits from K
        # rows of the frozen head, forward and the state's gradient; its projection of the state and the
        # candidates' scores, forward and backward)
        self.per_supervised = 2.0 * h * d.vocab_size * head_passes
        rank = getattr(d, "selector_rank", None)
        if rank is not None:
            k = d.selector_top_k
            self.per_supervised += 2 * 2.0 * h * k + 3 * 2.0 * (h * rank + k * rank)

    @classmethod
    def for_run(cls, drafter: Any, target: Any, objective: Any) -> FlopCount:
        """The count for a drafter (its config), a dflash Target (counted when it computes its states in
        process) and an Objective (its terms' head passes)."""
        passes = sum(t.head_passes for t in objective.terms)
        return cls(drafter, target.config if target.computes else None, passes)

    def drafter_pairs(self, anchors: torch.Tensor) -> int:
        """(query, key) pairs the drafter's attention computes, summed over its layers, for kept blocks at
        ``anchors`` (1-D): a full layer's block sees the ``a`` context positions before its anchor and its
        own B slots; a sliding layer's slot s the context positions a+s-W+1 .. a-1 and its slots s-W+1 .. s."""
        d, b = self.config, self.config.block_size
        anchors = anchors.to(torch.long)
        sliding = d.layer_types.count(SLIDING)  # every sliding layer has the one window
        pairs = (d.num_layers - sliding) * b * (int(anchors.sum()) + anchors.numel() * b)
        if sliding:
            w, s = d.sliding_window, torch.arange(b)
            context = torch.minimum(anchors[:, None], (w - 1 - s)[None]).clamp(min=0).sum()
            pairs += sliding * (int(context) + anchors.numel() * int(torch.clamp(s + 1, max=w).sum()))
        return pairs

    def step(self, lengths: Sequence[int], anchors: torch.Tensor | Sequence[int], supervised: int) -> StepFlops:
        """The model FLOPs of one step (see the module docstring)."""
        anchors = torch.as_tensor(anchors, dtype=torch.long).flatten()
        tokens = sum(lengths)
        target = sum(layer.per_token * tokens
                     + 4.0 * self.target_attention * sum(causal_pairs(n, layer.window) for n in lengths)
                     for layer in self.target_layers)
        forward = (self.per_query * anchors.numel() * self.config.block_size + self.per_context * tokens
                   + 4.0 * self.attention_width * self.drafter_pairs(anchors))
        # backward: input and weight gradients, twice the forward; fc's input is frozen, so only its weights
        drafter = 3 * forward + 2 * self.fc * tokens
        return StepFlops(target=target, drafter=drafter, head=self.per_supervised * supervised)

    def of_batch(self, batch: Any, plan: Any = None) -> StepFlops:
        """``step`` for a trainer Batch (dflash/train/run/stages.py) and its host BlockPlan (``plan``, else
        the batch's): each row's real tokens (rows masked out as bad samples count none), the plan's kept
        anchors and supervised slots."""
        plan = plan if plan is not None else batch.plan
        lengths = batch.attention_mask.sum(1)
        if batch.skipped:
            lengths[batch.skipped] = 0
        anchors = plan.anchors
        return self.step(lengths.tolist(), anchors[anchors >= 0], plan.num_tokens)


class Utilisation:
    """Model FLOP/s over the last ``window_s`` seconds of a run's cumulative FLOPs, and the MFU that makes
    against ``peak`` FLOP/s (None: no known peak, no MFU). A window of several seconds, as dflash-top's
    tok/s: a step at the recipe's size takes about a telemetry interval, so one interval alone would read
    0 and then twice the rate."""

    def __init__(self, peak: float | None, window_s: float = 10.0, start: tuple[float, float] | None = None) -> None:
        """``start``: (clock, cumulative FLOPs) where the run (or this process's part of it) began, so that the
        first reading has something to measure from: steps done before the first reading count too (a run
        shorter than a telemetry interval read 0 without it)."""
        self.peak, self.window_s = peak, window_s
        self._readings: deque[tuple[float, float]] = deque([start] if start is not None else [])

    def rate(self, now: float, total: float) -> float | None:
        """FLOP/s over the window ending ``now`` with ``total`` FLOPs done; None before a first step."""
        self._readings.append((now, total))
        while len(self._readings) > 2 and now - self._readings[1][0] >= self.window_s:
            self._readings.popleft()
        then, before = self._readings[0]
        if total <= 0 or now <= then:
            return None
        return (total - before) / (now - then)

    def gauges(self, now: float, total: float) -> dict[str, float]:
        """The ``tflops``, ``mfu`` and ``peak_tflops`` gauges (dflash/telemetry/wire/vocab.py) now."""
        rate = self.rate(now, total)
        if rate is None:
            return {}
        out = {Gauge.TFLOPS: rate / 1e12}
        if (mfu := self.mfu(rate)) is not None:
            out.update({Gauge.MFU: mfu, Gauge.PEAK_TFLOPS: self.peak / 1e12})
        return out

    def mfu(self, flops_per_s: float) -> float | None:
        """``flops_per_s`` as a share of the peak (None: no known peak)."""
        return flops_per_s / self.peak if self.peak else None

    def text(self, flops_per_s: float) -> str:
        """The log line's part: `312 TFLOP/s MFU 31.6%`, or `0.0213 TFLOP/s MFU n/a` without a known peak."""
        mfu = self.mfu(flops_per_s)
        return f"{tflops(flops_per_s / 1e12)} TFLOP/s MFU {'n/a' if mfu is None else f'{mfu:.1%}'}"
