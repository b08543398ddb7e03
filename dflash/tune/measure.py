"""A trial's figures from its own telemetry recording: tokens/s over the steady part, their spread across
windows, and the verdict the trainer's own judge gives that part with the share of its bounding stage.

The steady part leaves out what every run has and no setting changes: the start-up before the first step
(loading, the first step's allocations), the next few windows (the queues filling) and the last window
(the wind-down, where every stage waits on another). Evaluation windows are left out too (a trial runs
without one, but a user's --eval-every would pause it).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash.telemetry.summary import Summary
from dflash.telemetry.verdict.published import RecentWindows
from dflash.telemetry.wire import verdicts as V
from dflash.telemetry.wire.protocol import Snapshot
from dflash.telemetry.wire.reader import read_frames
from dflash.telemetry.wire.vocab import Counter, evaluating

#: after the first step, this share of the trial (at least WARM_S) is warm-up, not measured
WARM_SHARE, WARM_S = 0.15, 2.0
#: the spread is taken over chunks of consecutive windows at least this long: one window holds one or two
#: steps on a small run, and its rate swings with where a step ended, not with the settings
CHUNK_S = 3.0

#: the bounding stage's busy share, by stage verdict (device time where the evidence has it)
_STAGE_SHARE = {V.TARGET_BOUND.name: ("target.device_busy", "target.busy"),
                V.DRAFTER_BOUND.name: ("drafter.device_busy", "drafter.busy"),
                V.DATA_BOUND.name: ("data.busy",), V.INPUT_BOUND.name: ("target.cache_wait",)}


class MeasureError(ValueError):
    """A recording that holds nothing to measure; the message says why."""


@dataclass
class Measurement:
    tokens_per_s: float
    #: standard deviation of tokens/s across the steady part's chunks (0 with fewer than two)
    spread: float
    steady_s: float
    windows: int
    verdict: str
    reason: str
    #: the stage verdict under an overlay (CPU-starved on top of drafter-bound: drafter-bound)
    stage_verdict: str
    #: the bounding stage's busy share of wall time (balanced: the busier stage's)
    share: float | None
    evidence: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _window(s: Snapshot) -> float:
    return s.window_s or s.interval_s


def steady(snaps: list[Snapshot]) -> list[Snapshot]:
    """The steady windows: after the first step and the warm-up, without the last window or evaluations."""
    snaps = [s for s in snaps if _window(s) > 0]
    first = next((i for i, s in enumerate(snaps) if s.counters.get(Counter.STEPS, 0) > 0), None)
    if first is None:
        return []
    after = snaps[first + 1:-1]
    total = sum(_window(s) for s in after)
    skip, warm = 0.0, max(WARM_S, WARM_SHARE * total)
    out = []
    for s in after:
        if skip < warm:
            skip += _window(s)
            continue
        if not evaluating(s.gauges):
            out.append(s)
    return out


def _rate(snaps: list[Snapshot], before: dict[str, float]) -> float:
    seconds = sum(_window(s) for s in snaps)
    made = snaps[-1].counters.get(Counter.TOKENS, 0.0) - before.get(Counter.TOKENS, 0.0)
    return made / seconds if seconds > 0 else 0.0


def measure(recording: Path) -> Measurement:
    """The trial's figures; MeasureError where it made no steps to measure."""
    if not recording.is_file():
        raise MeasureError(f"{recording}: no telemetry recording (the trial did not get going)")
    snaps = [f for f in read_frames(recording, on_error=lambda n, msg: None) if isinstance(f, Snapshot)]
    part = steady(snaps)
    if len(part) < 2:
        raise MeasureError(f"{recording}: {len(part)} steady windows after the first step; give trials more time "
                           "(--trial-time)")
    index = {id(s): i for i, s in enumerate(snaps)}
    before = snaps[index[id(part[0])] - 1].counters
    rate = _rate(part, before)
    chunks, chunk, prev = [], [], before
    for s in part:
        chunk.append(s)
        if sum(_window(c) for c in chunk) >= CHUNK_S:
            chunks.append(_rate(chunk, prev))
            prev, chunk = s.counters, []
    spread = statistics.stdev(chunks) if len(chunks) > 1 else 0.0

    judge = RecentWindows(span_s=float("inf"))  # the trainer's own judge, over the whole steady part
    for s in part:
        judge.add(Summary(t=s.t, window_s=_window(s), workers=s.workers, counters=s.counters, gauges=s.gauges,
                          roles=s.roles, devices=s.devices), s.system)
    b = judge.judge()
    evidence = dict(b.evidence)
    stage = V.first_stage_verdict(evidence).name if evidence else b.verdict
    return Measurement(tokens_per_s=rate, spread=spread, steady_s=sum(_window(s) for s in part), windows=len(part),
                       verdict=b.verdict, reason=b.reason, stage_verdict=stage, share=stage_share(stage, evidence),
                       evidence=evidence)


def stage_share(stage: str, evidence: dict[str, float]) -> float | None:
    """How busy the bounding stage was: the share of wall time its workers spent working."""
    if stage == V.BALANCED.name:
        busy = [evidence[k] for k in ("target.device_busy", "drafter.device_busy", "target.busy", "drafter.busy")
                if k in evidence]
        return min(1.0, max(busy)) if busy else None
    for k in _STAGE_SHARE.get(stage, ()):
        if k in evidence:
            return min(1.0, evidence[k])
    return None
