"""Fault injection for tests and drills: `DFLASH_FAULT` makes the real workers hang, slow down or
produce NaNs at chosen steps, so the stall watchdog, the anomaly detector and the non-finite guard can
be shown working on a real run.

    DFLASH_FAULT="hang:drafter:step=20:seconds=15"      drafter sleeps 15 s inside drafter_forward at step 20
    DFLASH_FAULT="slow:target:factor=3:from_step=40"    every target forward from step 40 takes 3x as long
    DFLASH_FAULT="nan:drafter:step=30"                  the loss of step 30 is NaN (its gradients too)
    DFLASH_FAULT="nan:drafter:from_step=30:count=3; hang:target-1:step=5:seconds=60:rank=1"

A spec is `kind:stage[:key=value...]`; several are separated by `;` or `,`. Stages: `drafter`,
`target` (every target worker) or `target-N`. Keys: `step=N` (that step only) or `from_step=N` (from N
on, default 0), `count=K` (at most K steps), `rank=R` (only on that rank), `seconds=S` (hang, required),
`factor=F` (slow, > 1, required), `after_s=S` (only once S seconds have passed since the first step
reached an injection point: a drill that starts after the run has settled, whatever its speed).
Step N is the step that trains batch N (0-based; without --resume, the step counter before that
step). A bad spec stops `dflash train` at start with one line.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

KINDS = ("hang", "slow", "nan")
_INT_KEYS = ("step", "from_step", "count", "rank")
_FLOAT_KEYS = ("seconds", "factor", "after_s")


class FaultSpecError(ValueError):
    """A DFLASH_FAULT spec that cannot be used; the message names the part that is wrong."""


@dataclass(frozen=True)
class Fault:
    kind: str
    stage: str  # "drafter", "target" or "target-N"
    first: int
    exact: bool  # step=N (only N) rather than from_step=N
    count: int | None = None
    rank: int | None = None
    seconds: float = 0.0
    factor: float = 1.0
    after_s: float = 0.0

    def hits(self, stage: str, step: int, rank: int) -> bool:
        if self.rank is not None and rank != self.rank:
            return False
        if not (stage == self.stage or (self.stage == "target" and stage.startswith("target"))):
            return False
        if self.exact:
            return step == self.first
        return step >= self.first and (self.count is None or step < self.first + self.count)


def parse(text: str | None) -> list[Fault]:
    """The faults in a DFLASH_FAULT value (empty or unset: none)."""
    if not text or not text.strip():
        return []
    return [_parse_one(part.strip()) for part in text.replace(",", ";").split(";") if part.strip()]


def _parse_one(spec: str) -> Fault:
    parts = spec.split(":")
    if len(parts) < 2:
        raise FaultSpecError(f"DFLASH_FAULT {spec!r}: expected kind:stage[:key=value...], "
                             "e.g. hang:drafter:step=20:seconds=15")
    kind, stage = parts[0].strip(), parts[1].strip()
    if kind not in KINDS:
        raise FaultSpecError(f"DFLASH_FAULT {spec!r}: unknown kind {kind!r} (known: {', '.join(KINDS)})")
    if not (stage in ("drafter", "target") or (stage.startswith("target-") and stage[7:].isdigit())):
        raise FaultSpecError(f"DFLASH_FAULT {spec!r}: unknown stage {stage!r} (drafter, target or target-N)")
    if kind == "nan" and stage != "drafter":
        raise FaultSpecError(f"DFLASH_FAULT {spec!r}: nan acts on the drafter's loss; use nan:drafter")
    values: dict[str, float] = {}
    for kv in parts[2:]:
        key, sep, raw = kv.partition("=")
        key = key.strip()
        if not sep or key not in _INT_KEYS + _FLOAT_KEYS:
            raise FaultSpecError(f"DFLASH_FAULT {spec!r}: bad option {kv!r} "
                                 f"(known: {', '.join(k + '=' for k in _INT_KEYS + _FLOAT_KEYS)})")
        try:
            v = int(raw) if key in _INT_KEYS else float(raw)
        except ValueError:
            want = "an integer" if key in _INT_KEYS else "a number"
            raise FaultSpecError(f"DFLASH_FAULT {spec!r}: {key} must be {want}, got {raw!r}") from None
        if v < 0 or not math.isfinite(v):
            raise FaultSpecError(f"DFLASH_FAULT {spec!r}: {key} must be a finite number >= 0, got {raw!r}")
        values[key] = v
    if "step" in values and "from_step" in values:
        raise FaultSpecError(f"DFLASH_FAULT {spec!r}: give step= or from_step=, not both")
    if kind == "hang" and values.get("seconds", 0) <= 0:
        raise FaultSpecError(f"DFLASH_FAULT {spec!r}: hang needs seconds=S (> 0)")
    if kind == "slow" and values.get("factor", 0) <= 1:
        raise FaultSpecError(f"DFLASH_FAULT {spec!r}: slow needs factor=F (> 1)")
    exact = "step" in values
    return Fault(kind=kind, stage=stage, first=int(values.get("step", values.get("from_step", 0))), exact=exact,
                 count=int(values["count"]) if "count" in values else None,
                 rank=int(values["rank"]) if "rank" in values else None,
                 seconds=values.get("seconds", 0.0), factor=values.get("factor", 1.0),
                 after_s=values.get("after_s", 0.0))


def injected_hang(seconds: float) -> None:
    """The frame a `hang` fault blocks in (named so that a stall's stack file shows it plainly)."""
    time.sleep(seconds)


class FaultPlan:
    """The faults of one rank, asked by the stages at their injection points. With no faults the
    stages hold None instead of a plan, so a normal run pays one `is None` test per stage call."""

    def __init__(self, faults: list[Fault], rank: int = 0) -> None:
        self.faults, self.rank = faults, rank
        self._t0: float | None = None  # when the first injection point was reached (for after_s)

    @classmethod
    def from_env(cls, rank: int = 0) -> FaultPlan | None:
        faults = parse(os.environ.get("DFLASH_FAULT"))
        return cls(faults, rank) if faults else None

    def delay(self, stage: str, step: int, elapsed: float) -> None:
        """At the end of a timed stage call (`elapsed` seconds so far): hang, or stretch it to
        `factor` times its length."""
        for f in self.faults:
            if f.kind == "hang" and self._due(f, stage, step):
                injected_hang(f.seconds)
            elif f.kind == "slow" and self._due(f, stage, step):
                time.sleep(elapsed * (f.factor - 1.0))

    def poison(self, step: int) -> bool:
        """Whether the drafter's loss at `step` is to be made NaN."""
        return any(f.kind == "nan" and self._due(f, "drafter", step) for f in self.faults)

    def _due(self, f: Fault, stage: str, step: int) -> bool:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        return f.hits(stage, step, self.rank) and now - self._t0 >= f.after_s

    def describe(self) -> str:
        return "; ".join(f"{f.kind} {f.stage} " + (f"at step {f.first}" if f.exact else f"from step {f.first}")
                         + (f" x{f.count}" if f.count else "") + (f" on rank {f.rank}" if f.rank is not None else "")
                         + (f" after {f.after_s:g} s" if f.after_s else "")
                         for f in self.faults)
