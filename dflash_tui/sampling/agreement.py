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
    [t0, t1]: each window's own share (the trainer books a span's time in the windows it was open in, so
    a producer blocked a whole second on a full queue is blocked in both windows it spans) weighted by
    the window's length."""
    busy: dict[str, dict[str, float]] = {}
    wall: dict[str, float] = {}
    for f in frames:
        if not isinstance(f, Snapshot) or f.t - (f.window_s or f.interval_s) < t0 or f.t > t1:
            continue
        length = f.window_s or f.interval_s
        for w, cats in f.workers.items():
            wall[w] = wall.get(w, 0.0) + length
            for c, st in cats.items():
                busy.setdefault(w, {})[c] = busy.get(w, {}).get(c, 0.0) + st.share * length
    return {w: {c: t / wall[w] for c, t in cats.items()} for w, cats in busy.items() if wall.get(w)}


def compare(sampled: Mapping[str, Mapping[str, float]], measured: Mapping[str, Mapping[str, float]]) -> list[Row]:
    """A row for every category the trainer measured, of every worker seen both ways, largest gap first."""
    rows = [Row(w, c, sampled[w].get(c, 0.0), share) for w, cats in measured.items() if w in sampled
            for c, share in cats.items()]
    return sorted(rows, key=lambda r: -abs(r.diff))


def worst_gap(rows: list[Row]) -> float:
    """The agreement figure: the largest gap, in share of wall time, between a sampled and a measured share."""
    return max((abs(r.diff) for r in rows), default=0.0)
