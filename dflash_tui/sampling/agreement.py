"""Sampled shares beside measured ones: how far the stage rules, reading `dflash train` from outside, are
from the spans the same run timed itself (its telemetry). The test on recorded stacks and
scripts/bench_sampling.py both report this figure; docs/sampling.md states it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dflash.telemetry.wire.protocol import Frame, Snapshot

#: worker -> category -> share of its wall time
Shares = dict[str, dict[str, float]]


@dataclass(frozen=True)
class Row:
    worker: str
    category: str
    sampled: float
    measured: float

    @property
    def diff(self) -> float:
        return self.sampled - self.measured


def measured_shares(frames: Iterable[Frame], t0: float, t1: float) -> Shares:
    """Each worker's share of wall time per category over the trainer's snapshot windows that lie in
    [t0, t1]: the spans' total time over the windows' length. A span is booked in the window it ends in,
    so the spans open at the range's two edges are cut at them: the part of the span open when the range
    begins that lies before it comes off, and the part of the one open when it ends comes in (a producer
    blocked a whole second on a full queue would otherwise miss or gain a second of a 20-second range)."""
    totals: dict[str, dict[str, float]] = {}
    wall: dict[str, float] = {}
    before: Snapshot | None = None
    last: Snapshot | None = None

    def book(worker: str, category: str, seconds: float) -> None:
        totals.setdefault(worker, {})[category] = totals.get(worker, {}).get(category, 0.0) + seconds

    for f in frames:
        if not isinstance(f, Snapshot) or f.t > t1:
            continue
        if f.t - (f.window_s or f.interval_s) < t0:
            before = f
            continue
        last = f
        for w, cats in f.workers.items():
            wall[w] = wall.get(w, 0.0) + (f.window_s or f.interval_s)
            for c, st in cats.items():
                book(w, c, st.total)
    if last is not None:
        for edge, sign in ((before, -1.0), (last, 1.0)):
            for w, span in (edge.inflight if edge is not None else {}).items():
                if w in wall:
                    book(w, span.category, sign * min(span.elapsed, wall[w]))
    return {w: {c: max(0.0, t) / wall[w] for c, t in cats.items()} for w, cats in totals.items() if wall.get(w)}


def compare(sampled: Mapping[str, Mapping[str, float]], measured: Mapping[str, Mapping[str, float]]) -> list[Row]:
    """A row for every category the trainer measured, of every worker seen both ways, largest gap first."""
    rows = [Row(w, c, sampled[w].get(c, 0.0), share) for w, cats in measured.items() if w in sampled
            for c, share in cats.items()]
    return sorted(rows, key=lambda r: -abs(r.diff))


def worst_gap(rows: list[Row]) -> float:
    """The agreement figure: the largest gap, in share of wall time, between a sampled and a measured share."""
    return max((abs(r.diff) for r in rows), default=0.0)
