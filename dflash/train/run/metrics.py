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

from dflash.model.objective import metrics_of
from dflash.model.selector_loss import selector_metrics


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
    selector: list[float] = field(default_factory=list)  # a DFlash2 drafter's [covered, correct] slots

    def __add__(self, other: Totals) -> Totals:
        if not self.steps:
            return other
        if not other.steps:
            return self
        return Totals(self.steps + other.steps, self.loss + other.loss, self.grad_norm + other.grad_norm,
                      self.runs + other.runs, [a + b for a, b in zip(self.correct, other.correct, strict=True)],
                      [a + b for a, b in zip(self.counts, other.counts, strict=True)], self.blocks + other.blocks,
                      [a + b for a, b in zip(self.selector, other.selector, strict=True)])

    def summary(self) -> dict[str, Any]:
        """Mean loss and gradient norm per step; accuracy, per-position acceptance and both taus pooled
        over every supervised slot of these steps."""
        out: dict[str, Any] = {"loss": self.loss / self.steps if self.steps else 0.0,
                               "grad_norm": self.grad_norm / self.steps if self.steps else 0.0,
                               "supervised_tokens": sum(self.counts)}
        out.update(metrics_of(self.runs, self.correct, self.counts, self.blocks))
        if self.selector:
            out.update(selector_metrics(self.selector, sum(self.counts)))
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

    def add(self, stats: torch.Tensor, grad_norm: torch.Tensor, counts: list[int], blocks: int) -> None:
        """One step: ``stats`` as in LossOutput, its gradient norm, and its host counts. Never waits."""
        vec = torch.cat([stats.detach().double(), grad_norm.detach().double().reshape(1)])
        with self._lock:
            self._sum = vec if self._sum is None else self._sum + vec
            if vec.is_cuda:
                self._stream = torch.cuda.current_stream(vec.device)
            h = self._host
            h.steps += 1
            h.counts = [a + b for a, b in zip(h.counts, counts, strict=True)] if h.counts else list(counts)
            h.blocks += blocks

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
        n = 2 + len(host.counts)  # then a DFlash2 drafter's selector counts, then the gradient norm
        host.loss, host.runs, host.correct, host.selector, host.grad_norm = v[0], v[1], v[2:n], v[n:-1], v[-1]
        return host
