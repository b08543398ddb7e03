"""Everything the panels show, derived from frames: the latest snapshot plus bounded history.

One-way flow: a source produces frames, `RunState.apply` folds them in, widgets only read. Every
history is a fixed-length ring buffer and the number of series is capped, so a dashboard left open
for days (or a long replay at 100x) holds the same memory as one left open for minutes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from dflash.telemetry.wire.protocol import (
    Anomaly,
    Bottleneck,
    Bye,
    CategoryStats,
    Cluster,
    ClusterRank,
    Event,
    Frame,
    GpuSample,
    Hello,
    OpenSpan,
    Snapshot,
    Stall,
    SystemSample,
)
from dflash.telemetry.wire.vocab import Counter, Gauge, loss_terms
from dflash_tui.sources import Connection, SourceUpdate

#: points kept per series (at 2 Hz: 2.5 minutes; sparklines show the newest that fit)
HISTORY = 300
#: most (worker, category) and GPU series kept: a runaway producer cannot grow us without bound
MAX_SERIES = 4096
#: tok/s is taken over at least this many seconds of training windows: a 1 s window holds one drafter
#: step or two, so a per-window rate jumps between two values and is never the true one
RATE_SPAN_S = 10.0
MAX_EVENTS = 500
MAX_ERRORS = 50

Key = tuple[str, str]


class Ring:
    """A fixed-size numeric history (deque with maxlen), with the few reads the widgets need."""

    __slots__ = ("values",)

    def __init__(self, size: int = HISTORY) -> None:
        self.values: deque[float] = deque(maxlen=size)

    def append(self, v: float) -> None:
        self.values.append(v)

    def last(self, n: int) -> list[float]:
        if n >= len(self.values):
            return list(self.values)
        return list(self.values)[-n:]

    def __len__(self) -> int:
        return len(self.values)


@dataclass
class LoggedEvent:
    """An event line for the log: trainer events plus the TUI's own notes (disconnects, py-spy saves)."""

    t: float
    kind: str
    message: str


class RunState:
    """The model behind the panels; `apply()` is the only writer."""

    def __init__(self, history: int = HISTORY) -> None:
        self.history = history
        self.hello: Hello | None = None
        self.snapshot: Snapshot | None = None
        self.connection: Connection = Connection.CONNECTING
        self.connection_detail: str = ""
        self.frames = 0
        self.snapshots = 0
        self.bad_frames = 0
        self.last_error: str | None = None
        self.errors: deque[str] = deque(maxlen=MAX_ERRORS)
        self.events: deque[LoggedEvent] = deque(maxlen=MAX_EVENTS)
        #: how many events were ever logged: the log widget writes the ones past the count it has shown
        #: (it reads the state; it does not drain it)
        self.events_logged = 0
        self.category_mean: dict[Key, Ring] = {}
        self.category_share: dict[Key, Ring] = {}
        self.untracked: dict[str, Ring] = {}
        self.tokens_per_s = Ring(history)
        #: (window seconds, tokens trained in it) of recent training windows, for tokens_rate
        self._trained: deque[tuple[float, float]] = deque()
        self._tokens_seen: float | None = None
        self.loss = Ring(history)
        self.tau = Ring(history)
        self.gpu_util: dict[int, Ring] = {}
        self.gpu_mem: dict[int, Ring] = {}
        self.process_cpu = Ring(history)
        #: every (worker -> categories) seen so far: a category idle in one window keeps its table row
        self.known: dict[str, dict[str, None]] = {}
        #: grows with every change of what the panels draw from (a panel drawn at this version is current)
        self.version = 0
        #: the cross-rank view rank 0 publishes, and the stream time it came with. It outlives a switch
        #: to another rank: then a second connection to rank 0 keeps it current (`apply_cluster_update`)
        self.cluster: Cluster | None = None
        self.cluster_t: float | None = None
        #: the state of that second connection; None while this connection is rank 0's own
        self.cluster_connection: Connection | None = None
        #: the rank picked with the rank keys (None: whichever rank this connection is)
        self.selected_rank: int | None = None
        #: why the selected rank's details cannot be shown here (its socket is on another machine)
        self.rank_note: str = ""
        #: the last verdict judged on training (not on an evaluation pause): a finished run's summary
        self.training_bottleneck: Bottleneck | None = None

    # ------------------------------------------------------------------ writing

    def apply_update(self, update: SourceUpdate) -> None:
        if update.reset:
            self.forget_source()
        for err in update.errors:
            self.bad_frames += 1
            self.last_error = err
            self.errors.append(err)
        for frame in update.frames:
            self.apply(frame)
        if update.state is not None:
            if update.state != self.connection or update.detail != self.connection_detail:
                self.note("info" if update.state not in ("disconnected", "incompatible") else "warning",
                          f"{update.state}: {update.detail}" if update.detail else update.state)
            self.connection = update.state
            self.connection_detail = update.detail
        self.version += 1

    def apply(self, frame: Frame) -> None:
        self.frames += 1
        if isinstance(frame, Snapshot):
            self._apply_snapshot(frame)
        elif isinstance(frame, Hello):
            if self.hello is not None and (frame.run != self.hello.run or frame.rank != self.hello.rank):
                self.reset_history()
            if self.hello is not None and frame.run != self.hello.run:
                self.forget_cluster()
            self.hello = frame
        elif isinstance(frame, Event):
            self._log(LoggedEvent(frame.t, frame.kind, frame.message + _event_data(frame.data)))
        elif isinstance(frame, Bye):
            self._log(LoggedEvent(frame.t, "info", f"trainer said bye ({frame.reason})"))

    def note(self, kind: str, message: str, t: float | None = None) -> None:
        """An event of the TUI's own (connection changes, saved snapshots), stamped with the stream's
        clock when there is one, so a replay's log reads in the recording's time."""
        if t is None:
            t = (self.snapshot.t if self.snapshot is not None
                 else self.hello.started if self.hello is not None and self.hello.started else time.time())
        self._log(LoggedEvent(t, kind, message))
        self.version += 1

    def apply_cluster_update(self, update: SourceUpdate) -> None:
        """An update from the second connection, to rank 0: only its cluster view is taken."""
        for frame in update.frames:
            if isinstance(frame, Snapshot) and frame.cluster is not None:
                self.cluster, self.cluster_t = frame.cluster, frame.t
        if update.state is not None:
            self.cluster_connection = update.state
        self.version += 1

    def forget_source(self) -> None:
        """Before following another rank: its hello and snapshots replace this one's, and nothing of
        this rank may show under the other's name meanwhile. The log and the cluster view stay."""
        self.hello = None
        self.snapshot = None
        self.reset_history()
        self.version += 1

    def forget_cluster(self) -> None:
        """Another run: its ranks are not this one's."""
        self.cluster = self.cluster_t = self.cluster_connection = self.selected_rank = None
        self.rank_note = ""

    def reset_history(self) -> None:
        for d in (self.category_mean, self.category_share, self.untracked, self.gpu_util, self.gpu_mem, self.known):
            d.clear()
        for r in (self.tokens_per_s, self.loss, self.tau, self.process_cpu):
            r.values.clear()
        self._trained.clear()
        self._tokens_seen = None

    def _log(self, ev: LoggedEvent) -> None:
        self.events.append(ev)
        self.events_logged += 1

    def _ring(self, table: dict, key: object) -> Ring | None:
        ring = table.get(key)
        if ring is None:
            if len(table) >= MAX_SERIES:
                return None
            ring = table[key] = Ring(self.history)
        return ring

    def _apply_snapshot(self, snap: Snapshot) -> None:
        self.snapshot = snap
        self.snapshots += 1
        if snap.bottleneck is not None and snap.bottleneck.verdict != "unknown" and self.evaluating is None:
            self.training_bottleneck = snap.bottleneck
        if snap.cluster is not None:
            self.cluster, self.cluster_t = snap.cluster, snap.t
        for worker, cats in snap.workers.items():
            known = self.known.get(worker)
            if known is None and len(self.known) < MAX_SERIES:
                known = self.known[worker] = {}
            for cat, st in cats.items():
                if known is not None and cat not in known and len(known) < MAX_SERIES:
                    known[cat] = None
                key = (worker, cat)
                if (r := self._ring(self.category_mean, key)) is not None:
                    r.append(st.mean)
                if (r := self._ring(self.category_share, key)) is not None:
                    r.append(st.share)
        for worker, frac in snap.untracked.items():
            if (r := self._ring(self.untracked, worker)) is not None:
                r.append(frac)
        self._count_tokens(snap)
        tps = self.tokens_rate
        if tps is not None:
            self.tokens_per_s.append(tps)
        if (loss := self.loss_value) is not None:
            self.loss.append(loss)
        if (tau := self.tau_value) is not None:
            self.tau.append(tau)
        sys_ = snap.system
        if sys_ is not None:
            self.process_cpu.append(sys_.cpu_percent)
            for g in sys_.gpus:
                if g.util_percent is not None and (r := self._ring(self.gpu_util, g.index)) is not None:
                    r.append(g.util_percent)
                if g.mem_used is not None and (r := self._ring(self.gpu_mem, g.index)) is not None:
                    r.append(float(g.mem_used))

    # ------------------------------------------------------------------ reading

    @property
    def workers(self) -> dict[str, dict[str, CategoryStats]]:
        return self.snapshot.workers if self.snapshot is not None else {}

    @property
    def inflight(self) -> dict[str, OpenSpan]:
        """worker -> its innermost open span, as of the latest snapshot."""
        return self.snapshot.inflight if self.snapshot is not None else {}

    @property
    def stalls(self) -> list[Stall]:
        return list(self.snapshot.stalls) if self.snapshot is not None else []

    @property
    def anomalies(self) -> list[Anomaly]:
        return list(self.snapshot.anomalies) if self.snapshot is not None else []

    @property
    def system(self) -> SystemSample | None:
        return self.snapshot.system if self.snapshot is not None else None

    @property
    def gpus(self) -> list[GpuSample]:
        s = self.system
        return list(s.gpus) if s is not None else []

    @property
    def bottleneck(self) -> Bottleneck | None:
        return self.snapshot.bottleneck if self.snapshot is not None else None

    @property
    def uptime_s(self) -> float | None:
        if self.hello is None or not self.hello.started or self.snapshot is None:
            return None
        return max(0.0, self.snapshot.t - self.hello.started)

    @property
    def step(self) -> int | None:
        if self.snapshot is None:
            return None
        v = self.snapshot.gauges.get(Gauge.STEP)
        if v is None:
            v = self.snapshot.counters.get(Counter.STEPS)
        return int(v) if v is not None else None

    @property
    def bad_samples(self) -> int:
        """Sample files of a hidden-states cache the trainer skipped because they did not read (0: none,
        or a trainer that reads no cache)."""
        if self.snapshot is None:
            return 0
        return int(self.snapshot.counters.get(Counter.BAD_SAMPLES, 0))

    def nonfinite(self, name: str) -> str | None:
        """"nan"/"inf" when the trainer reported `name` (e.g. "gauges.loss") as not finite."""
        if self.snapshot is None:
            return None
        return getattr(self.snapshot, "nonfinite", {}).get(name)

    def gauge(self, name: str) -> float | None:
        """A gauge of the latest snapshot (None when the trainer did not send it)."""
        if self.snapshot is None:
            return None
        v = self.snapshot.gauges.get(name)
        return v if isinstance(v, (int, float)) else None

    @property
    def evaluating(self) -> tuple[int, int] | None:
        """(prompts done, prompts in all) while the trainer runs an evaluation; training has paused
        then, so the time shares say nothing about the pipeline."""
        done, total = self.gauge(Gauge.EVAL_DONE), self.gauge(Gauge.EVAL_TOTAL)
        if done is None or total is None or done >= total:
            return None
        return int(done), int(total)

    def _count_tokens(self, snap: Snapshot) -> None:
        """Keep the tokens each training window added; evaluation windows (training paused) are left
        out, so the rate is over training time, as `dflash stats` gives it."""
        tokens = snap.counters.get(Counter.TOKENS)
        before, self._tokens_seen = self._tokens_seen, tokens
        if tokens is None or before is None or tokens < before or self.evaluating is not None:
            return  # the first window, a restarted trainer, or an evaluation
        self._trained.append((snap.window_s or snap.interval_s, tokens - before))
        while len(self._trained) > 1 and sum(s for s, _ in self._trained) - self._trained[0][0] >= RATE_SPAN_S:
            self._trained.popleft()

    @property
    def tokens_rate(self) -> float | None:
        """Tokens trained per second over the last RATE_SPAN_S of training windows (the first window's
        own rate until there are two to take a difference from)."""
        seconds = sum(s for s, _ in self._trained)
        if seconds > 0:
            return sum(t for _, t in self._trained) / seconds
        return self.snapshot.rates.get("tokens") if self.snapshot is not None else None

    @property
    def loss_value(self) -> float | None:
        if self.snapshot is None:
            return None
        return self.snapshot.gauges.get(Gauge.LOSS)

    @property
    def loss_terms(self) -> dict[str, float]:
        """The objective's terms (each before its weight) by name, as the trainer last published them."""
        return loss_terms(self.snapshot.gauges) if self.snapshot is not None else {}

    @property
    def tau_value(self) -> float | None:
        if self.snapshot is None:
            return None
        v = self.snapshot.metrics.get("sim_tau")
        return v if isinstance(v, (int, float)) else None

    @property
    def shown_rank(self) -> int | None:
        """The rank whose details the panels show (None until its hello)."""
        return self.hello.rank if self.hello is not None else None

    @property
    def multi_rank(self) -> bool:
        return (self.hello is not None and self.hello.world_size > 1) or self.cluster is not None

    def job_ranks(self, local: Iterable[int] = ()) -> list[int]:
        """Every rank of the job we know of: from the hello's world size, rank 0's cluster view, and
        `local` (ranks with a socket on this machine)."""
        ranks = set(local)
        if self.hello is not None:
            ranks.add(self.hello.rank)
            if self.hello.world_size > 1:
                ranks.update(range(self.hello.world_size))
        if self.cluster is not None:
            ranks.update(range(self.cluster.world_size))
            ranks.update(r.rank for r in self.cluster.ranks)
        return sorted(ranks)

    def cluster_rank(self, rank: int) -> ClusterRank | None:
        """What rank 0 last said about `rank`."""
        if self.cluster is None:
            return None
        return next((r for r in self.cluster.ranks if r.rank == rank), None)

    def thread_cpu(self) -> dict[int, float]:
        """Native thread id -> CPU% from the latest snapshot (py-spy joins on this)."""
        s = self.system
        return {t.tid: t.cpu_percent for t in s.threads} if s is not None else {}

    def thread_names(self) -> dict[int, str]:
        names: dict[int, str] = {}
        if self.hello is not None:
            for tid, name in self.hello.threads.items():
                if tid.isdigit():
                    names[int(tid)] = name
        s = self.system
        if s is not None:
            names.update({t.tid: t.name for t in s.threads if t.name})
        return names

    def categories(self, worker: str | None = None) -> Iterable[tuple[str, str, CategoryStats]]:
        """(worker, category, stats) rows, per worker in order, categories by share (largest first)."""
        for w, cats in self.workers.items():
            if worker is not None and w != worker:
                continue
            for c, st in sorted(cats.items(), key=lambda kv: -kv[1].share):
                yield w, c, st


def _event_data(data: dict) -> str:
    if not data:
        return ""
    return "  " + " ".join(f"{k}={v}" for k, v in list(data.items())[:6])
