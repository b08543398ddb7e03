"""How far a run is and when it ends: one place for the log line, the published gauges (which
dflash-top's header shows) and the final evaluation's own progress, so they always agree.

Torch-free and clock-free: the trainer passes in its step and training clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash.telemetry.wire.table import NA
from dflash.telemetry.wire.table import clock as _clock
from dflash.telemetry.wire.vocab import Gauge


def clock(seconds: float | None) -> str:
    """The run's clock as the table writes it, hours only when there are some (1:05, 1:02:03); '?'
    for a time not known yet (an ETA before the first step)."""
    text = _clock(seconds, short=True)
    return "?" if text == NA else text


@dataclass(frozen=True)
class Progress:
    """Training progress against whichever limits the run has (steps, time, or both: the first
    reached ends it). `rate` is steps per second of training in this process (resumes start anew)."""

    step: int
    elapsed: float
    max_steps: int | None = None
    max_time: float | None = None
    rate: float | None = None

    @property
    def fraction(self) -> float | None:
        parts = []
        if self.max_steps:
            parts.append(self.step / self.max_steps)
        if self.max_time:
            parts.append(self.elapsed / self.max_time)
        return min(1.0, max(parts)) if parts else None

    @property
    def eta_s(self) -> float | None:
        """Seconds until the first limit is reached: the time left, or the steps left at the run's rate."""
        left = []
        if self.max_time:
            left.append(max(0.0, self.max_time - self.elapsed))
        if self.max_steps and self.rate:
            left.append(max(0.0, (self.max_steps - self.step) / self.rate))
        return min(left) if left else None

    def text(self) -> str:
        """`step 120/242 (50%) | 1:02 of 5:00 | ETA 1:01` (the parts the limits allow)."""
        steps = f"step {self.step:>6}" + (f"/{self.max_steps}" if self.max_steps else "")
        frac = self.fraction
        if frac is not None:
            steps += f" ({frac:.0%})"
        when = clock(self.elapsed) + (f" of {clock(self.max_time)}" if self.max_time else "")
        return f"{steps} | {when} | ETA {clock(self.eta_s)}"

    def gauges(self) -> dict[str, float]:
        """What dflash-top shows in its header (only the limits the run has)."""
        out = {Gauge.TRAIN_TIME_S: self.elapsed}
        for name, value in ((Gauge.MAX_STEPS, self.max_steps), (Gauge.MAX_TIME_S, self.max_time),
                            (Gauge.PROGRESS, self.fraction), (Gauge.ETA_S, self.eta_s)):
            if value is not None:
                out[name] = float(value)
        return out


@dataclass(frozen=True)
class EvalProgress:
    """The evaluation after training, prompt by prompt (its rounds vary, so prompts are the unit)."""

    done: int
    total: int
    elapsed: float

    @property
    def eta_s(self) -> float | None:
        return self.elapsed / self.done * (self.total - self.done) if self.done else None

    def text(self) -> str:
        return f"prompt {self.done}/{self.total} | {clock(self.elapsed)} | ETA {clock(self.eta_s)}"

    def gauges(self) -> dict[str, float]:
        out = {Gauge.EVAL_DONE: float(self.done), Gauge.EVAL_TOTAL: float(self.total), Gauge.EVAL_TIME_S: self.elapsed}
        if self.eta_s is not None:
            out[Gauge.EVAL_ETA_S] = self.eta_s
        return out
