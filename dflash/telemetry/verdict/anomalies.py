"""Anomalies: a worker/category whose timing drifts well above its own recent normal, for long enough
to matter, becomes one event ("target-0/target_forward p95 3.4x its baseline (41ms vs 12ms) since
12:03:10") and stays on the snapshot's `anomalies` until it is back to normal.

The baseline is robust so that the odd slow window (a GC pause, a checkpoint on another thread) does
not move it: per worker, category and statistic (the window's p95 and mean), the median and the MAD
of the last windows that were *not* deviating. A window deviates when it is above both
`ratio` x the median and the median + `mads` x the scaled MAD (and by at least `min_abs_s`, so
microsecond categories do not alarm on jitter). It becomes an anomaly only when at least `share` of
the windows of the last `sustain_s` seconds (and at least `sustain_windows` of them) deviate: one slow
window is noise, a stage that stays 3x slower is news (a majority rather than an unbroken run,
because a short window of a slowed stage sometimes holds only its faster calls), and only for a
category that takes at least `floor` of its worker's time (a 0.3% category 3x slower costs nothing
worth a banner). It ends once at most `1 - share` of them have deviated for `end_s` seconds on end
(hysteresis: a stage hovering at the edge does not start and end every few seconds), and every
anomaly ends at a phase change (an evaluation begins or ends: what was slow in one phase says nothing
about the next) and at the end of the run (`finish`). Only slowdowns are reported; waits (`*_wait`, `*_put`)
are left out, because they are the consequence of another worker's slowdown, which is reported in
its own right (and the bottleneck verdict already explains waits).

Like the stall watchdog it runs on the telemetry publisher thread, once per snapshot, from the window
statistics the snapshot carries anyway: it costs the workers nothing.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dflash.telemetry.summary import Summary
from dflash.telemetry.wire.protocol import Anomaly
from dflash.telemetry.wire.table import seconds
from dflash.telemetry.wire.vocab import WAIT_SUFFIXES
from dflash.telemetry.wire.vocab import evaluating as in_evaluation

log = logging.getLogger("dflash.telemetry")

STATS = ("p95", "mean")
#: windows kept in each baseline, and how many it needs before it judges anything
HISTORY = 120
MIN_HISTORY = 20
#: a deviation must be this many times the baseline ...
RATIO = 2.0
#: ... and this many (normal-scaled) MADs above it ...
MADS = 3.0
#: ... and at least this many seconds above it
MIN_ABS_S = 0.0005
#: and hold in this share of the windows of the last SUSTAIN_S seconds (at least SUSTAIN_WINDOWS
#: windows) before it is an anomaly; it ends when no more than 1 - SHARE of them deviate
SUSTAIN_S = 5.0
SUSTAIN_WINDOWS = 5
SHARE = 0.8
#: ... and it ends once it has been back for this long
END_S = 10.0
#: a category under this share of its worker's time (mean over the sustain span) raises nothing
FLOOR = 0.02
_MAD_SCALE = 1.4826  # MAD of a normal distribution x this = its standard deviation


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@dataclass
class Sustained:
    """The last ``sustain_s`` seconds of windows of one judged thing (a worker's category, a device's
    allocator): whether it deviated in enough of them to begin an anomaly, and whether an anomaly in force
    has been calm long enough to end (the rule of the module docstring, shared by every anomaly kind)."""

    sustain_s: float
    sustain_windows: int
    share: float
    end_s: float
    #: (window start, window end, deviating, weight: e.g. the category's share of its worker's time)
    recent: collections.deque[tuple[float, float, bool, float]] = field(default_factory=collections.deque)
    #: when the deviating windows last fell to the end level (None: they have not)
    calm_since: float | None = None

    def add(self, t: float, window_s: float, deviating: bool, weight: float = 1.0) -> bool:
        """Fold in the window ending at ``t``; whether the span is long enough to judge."""
        recent = self.recent
        recent.append((t - window_s, t, deviating, weight))
        while recent and recent[0][1] <= t - self.sustain_s:
            recent.popleft()
        return len(recent) >= self.sustain_windows and t - recent[0][0] >= self.sustain_s

    def begins(self, floor: float = 0.0) -> float | None:
        """When an anomaly begins (the first deviating window's start) if this window deviates, enough of the
        span did and its mean weight reaches ``floor``; else None."""
        r = self.recent
        if not r[-1][2] or sum(w[2] for w in r) / len(r) < self.share or sum(w[3] for w in r) / len(r) < floor:
            return None
        return next(w[0] for w in r if w[2])

    def ends(self, t: float) -> bool:
        """Whether an anomaly in force ends now: at most 1 - share of the span deviated for end_s on end."""
        if sum(w[2] for w in self.recent) / len(self.recent) > 1.0 - self.share:
            self.calm_since = None
        elif self.calm_since is None:
            self.calm_since = t
        if self.calm_since is None or t - self.calm_since < self.end_s:
            return False
        self.calm_since = None
        return True

    def clear(self) -> None:
        """Start the span anew (a phase change, the end of the run)."""
        self.recent.clear()
        self.calm_since = None


def say(emit: Callable[..., None] | None, kind: str, message: str, **data: object) -> None:
    """An anomaly's event: to ``emit`` (the trainer's events), else the log."""
    if emit is None:
        log.warning(message)
    else:
        emit(kind, message, **data)


@dataclass
class _Track:
    """One worker/category: a baseline per statistic and its span of deviating windows."""

    sustained: Sustained
    history: dict[str, collections.deque[float]] = field(default_factory=dict)
    deviating: dict[str, tuple[float, float]] = field(default_factory=dict)  # stat -> (value, baseline)
    active: Anomaly | None = None


class AnomalyDetector:
    def __init__(self, *, ratio: float = RATIO, mads: float = MADS, min_abs_s: float = MIN_ABS_S,
                 sustain_s: float = SUSTAIN_S, sustain_windows: int = SUSTAIN_WINDOWS, share: float = SHARE,
                 end_s: float = END_S, floor: float = FLOOR, history: int = HISTORY, min_history: int = MIN_HISTORY,
                 emit: Callable[..., None] | None = None) -> None:
        self.ratio, self.mads, self.min_abs_s = ratio, mads, min_abs_s
        self.sustain_s, self.sustain_windows, self.share = sustain_s, sustain_windows, share
        self.end_s, self.floor = end_s, floor
        self.history, self.min_history = history, min_history
        self.emit = emit
        self._tracks: dict[tuple[str, str], _Track] = {}
        self._evaluating: bool | None = None

    @property
    def active(self) -> list[Anomaly]:
        return [t.active for t in self._tracks.values() if t.active is not None]

    def baseline(self, worker: str, category: str, stat: str) -> tuple[float, float] | None:
        """(median, MAD) of the normal windows, or None while there are too few."""
        track = self._tracks.get((worker, category))
        hist = track.history.get(stat) if track is not None else None
        if hist is None or len(hist) < self.min_history:
            return None
        values = list(hist)
        med = _median(values)
        return med, _median([abs(v - med) for v in values])

    def check(self, summary: Summary, live: set[str] | None = None) -> list[Anomaly]:
        """Fold in one window; returns (and puts on the summary) the anomalies in force now."""
        t = summary.t
        evaluating = in_evaluation(summary.gauges)
        if self._evaluating is not None and evaluating != self._evaluating:
            self.finish("an evaluation began" if evaluating else "the evaluation ended")
        self._evaluating = evaluating
        for worker, cats in summary.workers.items():
            for cat, st in cats.items():
                if st.n == 0 or cat.endswith(WAIT_SUFFIXES):
                    continue
                track = self._tracks.get((worker, cat))
                if track is None:
                    track = self._tracks[(worker, cat)] = _Track(
                        Sustained(self.sustain_s, self.sustain_windows, self.share, self.end_s))
                self._judge(worker, cat, track, {s: getattr(st, s) for s in STATS}, t, summary.window_s, st.share)
        if summary.final:
            self.finish()
        summary.anomalies = self.active
        return summary.anomalies

    def _judge(self, worker: str, cat: str, track: _Track, values: dict[str, float], t: float,
               window_s: float, share_of_time: float) -> None:
        deviating = {}
        for stat, v in values.items():
            base = self.baseline(worker, cat, stat)
            if base is not None:
                med, mad = base
                if v > med * self.ratio and v > med + self.mads * _MAD_SCALE * mad and v - med >= self.min_abs_s:
                    deviating[stat] = (v, med)
        judged = track.sustained.add(t, window_s, bool(deviating), share_of_time)
        if deviating:
            track.deviating = deviating
        else:
            # a normal window joins the baseline (a deviating one never does, or it would become normal)
            for stat, v in values.items():
                hist = track.history.get(stat)
                if hist is None:
                    hist = track.history[stat] = collections.deque(maxlen=self.history)
                hist.append(v)
        if not judged:
            return
        if track.active is None:
            if (since := track.sustained.begins(self.floor)) is not None:
                self._begin(worker, cat, track, since)
            return
        if deviating:
            self._refresh(track)
        if track.sustained.ends(t):
            self._end(worker, cat, track)

    def finish(self, why: str = "the run ended") -> None:
        """End every anomaly in force (a phase change, the end of the run) and start their spans anew."""
        for (worker, cat), track in self._tracks.items():
            track.sustained.clear()
            if track.active is not None:
                self._end(worker, cat, track, why)

    def _refresh(self, track: _Track) -> None:
        a = track.active
        assert a is not None
        value, base = track.deviating.get(a.stat, next(iter(track.deviating.values())))
        a.value, a.baseline, a.ratio = value, base, value / base if base > 0 else float("inf")

    def _begin(self, worker: str, cat: str, track: _Track, since: float) -> None:
        stat = "p95" if "p95" in track.deviating else next(iter(track.deviating))
        value, base = track.deviating[stat]
        ratio = value / base if base > 0 else float("inf")
        msg = (f"{worker}/{cat} {stat} {ratio:.1f}x its baseline ({seconds(value)} vs "
               f"{seconds(base)}) since {time.strftime('%H:%M:%S', time.localtime(since))}")
        track.active = Anomaly(worker=worker, category=cat, stat=stat, value=value, baseline=base, ratio=ratio,
                               since=since, message=msg)
        self._say("anomaly", msg, worker=worker, category=cat, stat=stat, value=round(value, 6),
                  baseline=round(base, 6), ratio=round(ratio, 2))

    def _end(self, worker: str, cat: str, track: _Track, why: str | None = None) -> None:
        a = track.active
        assert a is not None
        track.active = None
        text = f"ended: {why}" if why else f"back to its baseline ({seconds(a.baseline)} {a.stat})"
        self._say("anomaly_end", f"{worker}/{cat} {text}", worker=worker, category=cat, stat=a.stat,
                  baseline=round(a.baseline, 6))

    def _say(self, kind: str, message: str, **data: object) -> None:
        say(self.emit, kind, message, **data)
