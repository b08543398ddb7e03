"""Windows of samples turned into the frames a dflash trainer sends: a hello, then one snapshot per window,
so that the state, the panels, `--once`, and a recording (replayed later) read a sampled process exactly as
they read a trainer. Each snapshot says it was sampled (`Snapshot.sampling`).

A worker is a Python thread that did something the rules name (threads that only ever idle, and dflash's
own telemetry threads, stay out of the panels); its role follows from where its samples fall.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from dflash.telemetry.wire.protocol import (
    PROTO,
    Hello,
    MachineSample,
    OpenSpan,
    Sampling,
    Snapshot,
    SystemSample,
)
from dflash.telemetry.wire.system import SystemSampler
from dflash.telemetry.wire.table import clock
from dflash.telemetry.wire.verdicts import VERDICT_SPAN_S
from dflash.telemetry.wire.vocab import TELEMETRY_THREADS
from dflash_tui.sampling.samples import ThreadSamples, Window
from dflash_tui.sampling.tally import Tally, categories, margin, merged
from dflash_tui.sampling.verdict import Observed, judge, role_of

#: categories that do not make a thread a worker on their own
_NOTHING = (None, "idle_wait")


def cost_text(native: bool, rate_hz: float, sampler_cpu: float | None) -> str:
    """What sampling costs the watched process, for the header."""
    own = f"; py-spy used {sampler_cpu:.0f}% of a core here" if sampler_cpu is not None else ""
    if native:
        return (f"--native: py-spy stops the process {rate_hz:g} times a second to unwind its C/CUDA frames, which "
                f"slows it{own}")
    return (f"py-spy reads the process's memory without stopping it (--nonblocking){own}; --native would stop it at "
            "every sample")


class SampledSession:
    """The frames of one sampled process, window by window."""

    def __init__(self, pid: int, *, command: str, started: float, rate_hz: float, window_s: float,
                 native: bool = False, host: str | None = None, system: SystemSampler | None = None) -> None:
        """`system`: the process's CPU and GPU sampler, read once per window (None: no system samples)."""
        self.pid, self.command, self.started = pid, command, started
        self.system = system
        self.rate_hz, self.window_s, self.native = rate_hz, window_s, native
        self.host = host or socket.gethostname()
        self._labels: dict[tuple[int | None, str], str | None] = {}
        self._cumulative: dict[str, Tally] = {}
        #: the last VERDICT_SPAN_S of windows, for the verdict
        self._recent: deque[_Judged] = deque()
        #: the whole sampling's: samples in which the GIL record found the GIL held, and samples it covered
        self._gil = _Judged(0.0, {}, None, None, 0)
        self._open: dict[str, tuple[str | None, int]] = {}  # worker -> (category of its last run, its length)
        self.samples = 0
        self._seq = 0
        self._last: tuple[Window, dict[str, Tally], SystemSample | None, float | None] = (
            Window(rate_hz=rate_hz, stacks=[], threads=[]), {}, None, None)

    @property
    def interval_s(self) -> float:
        return 1.0 / self.rate_hz

    def hello(self) -> Hello:
        return Hello(proto=PROTO, run=self.command, pid=self.pid, host=self.host, started=self.started,
                     interval_s=self.window_s, workers=self.workers, threads=self.thread_names_json)

    @property
    def workers(self) -> list[str]:
        return [w for w, t in self._cumulative.items() if any(t.counts[c] for c in t.counts if c not in _NOTHING)]

    @property
    def thread_names(self) -> dict[int, str]:
        """Native thread id -> worker name, for the per-thread CPU sampler."""
        return {tid: label for (tid, _), label in self._labels.items() if tid is not None and label is not None}

    @property
    def thread_names_json(self) -> dict[str, str]:
        return {str(tid): name for tid, name in self.thread_names.items()}

    def _label(self, t: ThreadSamples) -> str | None:
        key = (t.tid, t.name)
        if key not in self._labels:
            if t.name in TELEMETRY_THREADS:  # a dflash trainer's own monitor: not the trainer's work
                self._labels[key] = None
            else:
                label = t.name or f"tid-{t.tid}"
                taken = set(self._labels.values())
                self._labels[key] = label if label not in taken else f"{label}-{t.tid}"
        return self._labels[key]

    def add(self, window: Window, t: float | None = None, sampler_cpu: float | None = None) -> Snapshot:
        """The snapshot of one more window (with the system sample taken now, its threads named)."""
        t = time.time() if t is None else t
        tallies: dict[str, Tally] = {}
        for th in window.threads:
            label = self._label(th)
            if label is None or not th.samples:
                continue
            cats = categories(window, th)
            tally = Tally(gil=th.gil)
            tally.add(cats)
            tallies[label] = tally
            self._cumulative.setdefault(label, Tally()).merge(tally)
            last, run = self._open.get(label, (None, 0))
            tail = next((i for i, c in enumerate(reversed(cats)) if c != cats[-1]), len(cats))
            # a window spent wholly in the stage its predecessor ended in continues that run
            self._open[label] = (cats[-1], run + tail if tail == len(cats) and last == cats[-1] else tail)
        system = self.system.sample(self.thread_names) if self.system is not None else None
        self.samples += window.samples
        this = _Judged(t, tallies, system, window.gil_held, window.samples)
        self._recent.append(this)
        while len(self._recent) > 1 and t - self._recent[0].t >= VERDICT_SPAN_S:
            self._recent.popleft()
        if window.gil_held is not None:
            self._gil.gil_held = (self._gil.gil_held or 0) + window.gil_held
            self._gil.samples += window.samples
        self._last = (window, tallies, system, sampler_cpu)
        return self._snapshot(window, tallies, system, t, sampler_cpu, final=False)

    def closing(self, t: float | None = None) -> Snapshot:
        """The last window's snapshot again, judged over the whole sampling: what `--once` summarises."""
        window, tallies, system, sampler_cpu = self._last
        return self._snapshot(window, tallies, system, time.time() if t is None else t, sampler_cpu, final=True)

    def _snapshot(self, window: Window, tallies: dict[str, Tally], system: SystemSample | None, t: float,
                  sampler_cpu: float | None, final: bool) -> Snapshot:
        dt = self.interval_s
        shown = self.workers
        systems = [r.system for r in self._recent]
        if final:
            judged = {w: self._cumulative[w] for w in shown}
            scope = f"whole sampling ({clock(self.samples * dt)}, {self.samples:,} samples per thread)"
            gil = [self._gil]
        else:
            judged = {w: merged(r.tallies[w] for r in self._recent if w in r.tallies) for w in shown}
            n = max((x.samples for x in judged.values()), default=0)
            scope = f"last {n * dt:.0f} s sampled ({n:,} samples per thread)"
            gil = list(self._recent)
        bottleneck = judge(_observed(judged, systems, gil, dt, scope))
        roles = {w: r.value for w in shown if (r := role_of(self._cumulative[w])) is not None}
        self._seq += 1
        inflight = {}
        for w in shown:
            cat, run = self._open.get(w, (None, 0))
            if cat is not None and w in tallies:
                inflight[w] = OpenSpan(category=cat, start=t - run * dt, elapsed=run * dt)
        n = window.samples
        held = {w: round(tallies[w].gil / tallies[w].samples, 4) for w in shown if w in tallies and tallies[w].samples}
        return Snapshot(
            seq=self._seq, t=t, interval_s=self.window_s, window_s=n * dt,
            workers={w: tallies[w].stats(dt) for w in shown if w in tallies},
            untracked={w: round(tallies[w].share(None), 4) for w in shown if w in tallies},
            cumulative={w: self._cumulative[w].stats(dt) for w in shown},
            counters={"samples": float(self.samples)}, system=system, bottleneck=bottleneck,
            inflight=inflight, roles=roles,
            sampling=Sampling(tool="py-spy --native" if self.native else "py-spy --nonblocking", rate_hz=self.rate_hz,
                              samples=n, total_samples=self.samples, margin=round(margin(n), 4),
                              total_margin=round(margin(self.samples), 4), native=self.native,
                              sampler_cpu_percent=None if sampler_cpu is None else round(sampler_cpu, 1),
                              cost=cost_text(self.native, self.rate_hz, sampler_cpu),
                              gil_held=(None if window.gil_held is None or not n
                                        else round(min(1.0, window.gil_held / n), 4)),
                              gil=held if window.gil_held is not None else {}),
        )


@dataclass
class _Judged:
    """One window as the verdict reads it (or, for the GIL, the whole sampling's sums)."""

    t: float
    tallies: dict[str, Tally]
    system: SystemSample | None
    #: samples in which the GIL record found the GIL held (None: no GIL record), of `samples`
    gil_held: float | None
    samples: int


def _observed(judged: Mapping[str, Tally], systems: list[SystemSample | None], gil: list[_Judged], dt: float,
              scope: str) -> Observed:
    """What the verdict needs over the judged span: the tallies, and each thread's mean CPU beside them."""
    known = [s for s in systems if s is not None]
    cpu: dict[str, list[float]] = {}
    for s in known:
        for th in s.threads:
            cpu.setdefault(th.name, []).append(th.cpu_percent / 100)
    machines = [s.machine for s in known if s.machine is not None]
    machine = None
    if machines:
        machine = MachineSample(cores=machines[-1].cores, load1=machines[-1].load1,
                                busy_percent=sum(m.busy_percent for m in machines) / len(machines),
                                others_percent=sum(m.others_percent for m in machines) / len(machines))
    with_gil = [g for g in gil if g.gil_held is not None and g.samples]
    gil_held = (min(1.0, sum(g.gil_held or 0 for g in with_gil) / sum(g.samples for g in with_gil))
                if with_gil else None)
    return Observed(tallies=judged, thread_cpu={w: sum(v) / len(v) for w, v in cpu.items() if w in judged},
                    process_cpu=sum(s.cpu_percent for s in known) / len(known) if known else None,
                    machine=machine, gil_held=gil_held, interval_s=dt, scope=scope)
