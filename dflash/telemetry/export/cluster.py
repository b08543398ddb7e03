"""The cluster view: every rank reports a compact summary, rank 0 turns them into min/mean/max.

Each rank runs one `ClusterExchange` thread (never a training thread). Every interval it writes its
`RankReport` under its own key in torch.distributed's key-value store (the TCPStore torchrun already
runs for rendezvous), and rank 0 reads every rank's key back. Why the store and not a collective on a
gloo group: a collective waits for every rank, cannot say which one is missing, and is unusable
after its first timeout; a store write or read never waits for another rank, so a rank that dies or
hangs simply stops updating its key and rank 0 flags *that* rank as stale after a few intervals.

This module does not import torch: the store is passed in (anything with ``set(key, bytes)``,
``get(key) -> bytes`` and ``check([key]) -> bool``), so dflash-top-side tests and tools can build
cluster views from reports alone (`build_cluster`).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import msgspec

from dflash.telemetry.summary import Summary
from dflash.telemetry.wire.protocol import Cluster, ClusterCategory, ClusterRank, RankFigures
from dflash.telemetry.wire.vocab import CLUSTER_THREAD, WAIT_SUFFIXES

log = logging.getLogger(__name__)

#: a rank with no new report for this many intervals (and at least STALE_MIN_S seconds) is stale
STALE_INTERVALS = 3
STALE_MIN_S = 5.0
#: a rank that has not reported at all is stale this long after the exchange started (ranks load
#: their targets at different speeds)
SILENT_GRACE_S = 60.0
#: categories in the view, widest spread first (a full table is in each rank's own snapshots)
MAX_CATEGORIES = 24
#: the all-reduce waits must differ by this share of wall time before a straggler is named
STRAGGLER_MIN_GAP = 0.05
#: reports are averaged over this many seconds of cumulative totals (1 s windows are too noisy to rank)
SMOOTH_S = 5.0


class Store(Protocol):
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...
    def multi_get(self, keys: list[str]) -> list[bytes]: ...


class RankReport(RankFigures, omit_defaults=True):
    """What one rank writes to the store every interval (a few hundred bytes)."""

    #: increases with every report: rank 0 ages a rank by when this last changed (no clock sync needed)
    seq: int = 0
    #: "worker/category" -> share of that worker's wall time over the last SMOOTH_S seconds
    shares: dict[str, float] = {}


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(RankReport)


def report_key(rank: int) -> str:
    return f"dflash/cluster/r{rank}"


class _Smoother:
    """Shares and rates over the last SMOOTH_S seconds, from differences of cumulative totals."""

    def __init__(self) -> None:
        self._hist: collections.deque[tuple[float, dict[str, float], dict[str, float]]] = collections.deque()

    def update(self, s: Summary) -> tuple[dict[str, float], dict[str, float]]:
        totals = {f"{w}/{c}": st.total for w, cats in s.cumulative.items() for c, st in cats.items()}
        counters = dict(s.counters)
        self._hist.append((s.t, totals, counters))
        while len(self._hist) > 2 and s.t - self._hist[1][0] >= SMOOTH_S:
            self._hist.popleft()
        t0, tot0, cnt0 = self._hist[0]
        dt = s.t - t0
        if dt <= 0:  # first report: the window's own shares and rates
            return ({f"{w}/{c}": st.share for w, cats in s.workers.items() for c, st in cats.items()}, dict(s.rates))
        # Spans are booked when they end, so a long one can push a window's share past 1: clamp.
        shares = {k: min(1.0, max(0.0, (v - tot0.get(k, 0.0)) / dt)) for k, v in totals.items()}
        rates = {k: max(0.0, (v - cnt0.get(k, 0.0)) / dt) for k, v in counters.items()}
        return shares, rates


def make_report(rank: int, seq: int, summary: Summary | None, smoother: _Smoother, state: str,
                socket_path: str | None, previous: RankReport | None = None) -> RankReport:
    """This rank's report. A window without a step has no step or loss gauge, so those carry over
    from `previous`."""
    r = RankReport(rank=rank, seq=seq, host=socket.gethostname(), pid=os.getpid(), state=state, socket=socket_path)
    if previous is not None:
        r.step, r.loss = previous.step, previous.loss
    if summary is None:
        return r
    shares, rates = smoother.update(summary)
    r.shares = {k: round(v, 4) for k, v in shares.items() if v >= 0.0005}
    r.tokens_per_s = round(rates.get("tokens", 0.0), 1)
    r.allreduce_share = round(min(1.0, rates.get("allreduce_seconds", 0.0)), 4)
    if "step" in summary.gauges:
        r.step = int(summary.gauges["step"])
    loss = summary.gauges.get("loss")
    if loss is not None and math.isfinite(loss):
        r.loss = loss
    r.stalled = [f"{s.worker}/{s.category or '(between spans)'} for {s.elapsed:.0f}s" for s in summary.stalls]
    return r


def build_cluster(world_size: int, reports: Mapping[int, RankReport], ages: Mapping[int, float],
                  stale_after_s: float, silent_for_s: float = 0.0, error: str | None = None) -> Cluster:
    """The view rank 0 publishes. `ages`: seconds since each rank's report last changed (absent: never
    reported); `silent_for_s`: how long the exchange has run, for ranks that never reported."""
    ranks: list[ClusterRank] = []
    stale: list[int] = []
    for r in range(world_size):
        rep = reports.get(r)
        if rep is None:
            is_stale = silent_for_s >= SILENT_GRACE_S
            ranks.append(ClusterRank(rank=r, state="silent", age_s=round(silent_for_s, 1), stale=is_stale))
        else:
            age = ages.get(r, 0.0)
            is_stale = rep.state == "training" and age > stale_after_s
            figures = {f: getattr(rep, f) for f in RankFigures.__struct_fields__}
            ranks.append(ClusterRank(**figures, age_s=round(age, 1), stale=is_stale))
        if is_stale:
            stale.append(r)
    live = {r: rep for r, rep in reports.items() if r not in stale and rep.state == "training"}

    categories = []
    keys = sorted({k for rep in live.values() for k in rep.shares})
    for key in keys:
        values = {r: rep.shares.get(key, 0.0) for r, rep in live.items()}
        lo, hi = min(values, key=values.__getitem__), max(values, key=values.__getitem__)
        categories.append(ClusterCategory(key=key, min=values[lo], mean=round(sum(values.values()) / len(values), 4),
                                          max=values[hi], min_rank=lo, max_rank=hi))
    categories.sort(key=lambda c: (c.max - c.min, c.max), reverse=True)

    straggler, reason = _straggler(live)
    # alive and reporting, but its own watchdog says its training is stuck
    stalled = sorted(r for r, rep in reports.items() if rep.stalled and r not in stale)
    return Cluster(world_size=world_size, ranks=ranks, categories=categories[:MAX_CATEGORIES],
                   straggler=straggler, straggler_reason=reason, stale=stale, stalled=stalled, error=error)


def _straggler(live: Mapping[int, RankReport]) -> tuple[int | None, str]:
    """With data-parallel replicas every step ends in a gradient all-reduce, so the fast ranks wait
    there for the slow one: the rank that waits least is the one the others wait for."""
    if len(live) < 2:
        return None, ""
    waits = {r: rep.allreduce_share for r, rep in live.items()}
    slow = min(waits, key=waits.__getitem__)
    top = max(waits.values())
    if top - waits[slow] < STRAGGLER_MIN_GAP:
        return None, ""
    reason = (f"rank {slow} waits {waits[slow]:.0%} of its time in the gradient all-reduce, the others up to "
              f"{top:.0%}: they wait for it")
    others = [rep for r, rep in live.items() if r != slow]
    own = live[slow].shares
    # Where its extra time goes: the non-waiting category it spends most more time in than the others.
    extra = {k: v - sum(o.shares.get(k, 0.0) for o in others) / len(others)
             for k, v in own.items() if not k.endswith(WAIT_SUFFIXES)}
    if extra:
        k = max(extra, key=extra.__getitem__)
        if extra[k] > 0.01:
            reason += f"; its {k} takes {own[k]:.0%} of its time vs {own[k] - extra[k]:.0%} on the others"
    return slow, reason


class ClusterExchange:
    """One per rank: writes this rank's report every interval; on rank 0 also reads all of them and
    keeps the latest `Cluster` for the telemetry server to publish (`view()` never blocks)."""

    def __init__(self, store: Store, rank: int, world_size: int, latest: Callable[[], Summary | None],
                 interval_s: float = 1.0, socket_path: str | None = None, stale_after_s: float | None = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.stale_after_s = stale_after_s if stale_after_s is not None else max(STALE_INTERVALS * interval_s,
                                                                                 STALE_MIN_S)
        self._latest, self.interval_s, self.socket_path = latest, interval_s, socket_path
        self._smoother = _Smoother()
        self._seq = 0
        self._state = "training"
        self._view: Cluster | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last seq, monotonic time it changed)
        self._reports: dict[int, RankReport] = {}
        self._last: RankReport | None = None
        self._error: str | None = None
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=CLUSTER_THREAD, daemon=True)

    def start(self) -> ClusterExchange:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def view(self) -> Cluster | None:
        return self._view

    def close(self, state: str = "finished") -> None:
        """Stop, and tell rank 0 this rank ended on purpose (so it is not flagged as stale)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._state = state
        self._tick()

    def _run(self) -> None:
        self._tick()  # at once: a rank is known to rank 0 from the moment it trains
        while not self._stop.wait(self.interval_s):
            self._tick()

    def _tick(self) -> None:
        self._seq += 1
        try:
            rep = make_report(self.rank, self._seq, self._latest(), self._smoother, self._state, self.socket_path,
                              self._last)
            self._last = rep
            self.store.set(report_key(self.rank), _enc.encode(rep))
            if self.rank == 0:
                self._read_all()
            self._error = None
        except Exception as e:  # noqa: BLE001 - a broken store costs the view, never the run
            msg = f"cluster exchange failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if msg != self._error:
                log.warning(msg)
            self._error = msg
        if self.rank == 0:
            self._view = self._build()

    def _read_all(self) -> None:
        now = time.monotonic()
        keys = [report_key(r) for r in range(self.world_size)]
        if self.store.check(keys):  # the usual case: two round trips, whatever the world size
            found = dict(zip(range(self.world_size), self.store.multi_get(keys), strict=True))
        else:  # some rank has not reported yet (get would block on its key)
            found = {r: self.store.get(k) for r, k in enumerate(keys) if self.store.check([k])}
        for r, raw in found.items():
            rep = _dec.decode(raw)
            last = self._seen.get(r)
            if last is None or last[0] != rep.seq:
                self._seen[r] = (rep.seq, now)
            self._reports[r] = rep

    def _build(self) -> Cluster:
        now = time.monotonic()
        ages = {r: now - t for r, (_, t) in self._seen.items()}
        return build_cluster(self.world_size, self._reports, ages, self.stale_after_s, now - self._started,
                             self._error)
