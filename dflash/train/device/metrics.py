"""Training metrics summed on the device, step by step, and read by the host once per interval.

Reading a CUDA tensor (``float(loss)``, ``.item()``, ``.tolist()``) blocks the reading thread until
the GPU has drained everything queued before it. Done in the drafter's thread after every step, that
wait would stop the thread from queueing the next step and serialise the pipeline; so the drafter
thread only adds each step's metric vector to a running device sum (a few tiny kernels, no wait), and
the main thread takes the sum and reads it once per telemetry/log interval, waiting alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash.model.blocks import metrics_of


@dataclass
class Totals:
    """Host sums over some steps; ``summary()`` turns them into the figures the log and telemetry show."""

    steps: int = 0
    loss: float = 0.0  # sum of the steps' losses
    grad_norm: float = 0.0  # sum of the steps' gradient norms (before clipping)
    runs: float = 0.0  # leading correct slots, summed over blocks
    correct: list[float] = field(default_factory=list)  # per slot position
    counts: list[int] = field(default_factory=list)  # supervised slots per position
    blocks: int = 0
    terms: dict[str, float] = field(default_factory=dict)  # each objective term's sum over the steps
    measured: dict[str, float] = field(default_factory=dict)  # each rate a term measured, summed over the steps

    def __add__(self, other: Totals) -> Totals:
        if not self.steps:
            return other
        if not other.steps:
            return self
        return Totals(self.steps + other.steps, self.loss + other.loss, self.grad_norm + other.grad_norm,
                      self.runs + other.runs, [a + b for a, b in zip(self.correct, other.correct, strict=True)],
                      [a + b for a, b in zip(self.counts, other.counts, strict=True)], self.blocks + other.blocks,
                      {k: v + other.terms.get(k, 0.0) for k, v in self.terms.items()},
                      {k: v + other.measured.get(k, 0.0) for k, v in self.measured.items()})

    def summary(self) -> dict[str, Any]:
        """Mean loss, gradient norm and objective terms (``terms``: name -> mean, before its weight) per
        step; accuracy, per-position acceptance and both taus pooled over every supervised slot."""
        per_step = 1 / self.steps if self.steps else 0.0
        out: dict[str, Any] = {"loss": self.loss * per_step, "grad_norm": self.grad_norm * per_step,
                               "supervised_tokens": sum(self.counts),
                               "terms": {k: v * per_step for k, v in self.terms.items()}}
        out.update(metrics_of(self.runs, self.correct, self.counts, self.blocks))
        out["measured"] = {k: v * per_step for k, v in self.measured.items()}  # selector_recall, ...
        return out


class StepMetrics:
    """The device-side running sum. ``add`` is called by the drafter thread, ``collect`` by the main
    thread; a lock guards the hand-over, and the sum is rebuilt out of place at each add so a taken sum
    is never written again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sum: torch.Tensor | None = None
        self._stream: Any = None
        self._host = Totals()

    def add(self, stats: torch.Tensor, grad_norm: torch.Tensor, counts: list[int], blocks: int,
            terms: tuple[str, ...] = (), measured: tuple[str, ...] = ()) -> None:
        """One step: ``stats`` as in LossOutput (its objective's ``terms`` by name), its gradient norm, and
        its host counts. Never waits."""
        vec = torch.cat([stats.detach().double(), grad_norm.detach().double().reshape(1)])
        with self._lock:
            self._sum = vec if self._sum is None else self._sum + vec
            if vec.is_cuda:
                self._stream = torch.cuda.current_stream(vec.device)
            h = self._host
            h.steps += 1
            h.counts = [a + b for a, b in zip(h.counts, counts, strict=True)] if h.counts else list(counts)
            h.blocks += blocks
            h.terms = dict.fromkeys(terms, 0.0)  # named now, summed at collect
            h.measured = dict.fromkeys(measured, 0.0)

    def collect(self) -> Totals | None:
        """The sums since the previous collect (None if no step ended since). Waits for the device."""
        with self._lock:
            taken, stream, host = self._sum, self._stream, self._host
            self._sum, self._host = None, Totals()
        if taken is None:
            return None
        if stream is not None:
            # Read on the stream that computed the sum, so the copy is ordered after it.
            with torch.cuda.stream(stream):
                taken = taken.cpu()
        v = taken.tolist()
        slots = len(host.counts)
        host.loss, host.runs, host.correct, host.grad_norm = v[0], v[1], v[2:2 + slots], v[-1]
        rest = v[2 + slots:-1]
        host.terms = dict(zip(host.terms, rest[:len(host.terms)], strict=True))
        host.measured = dict(zip(host.measured, rest[len(host.terms):], strict=True))
        return host
