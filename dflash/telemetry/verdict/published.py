"""The verdict the trainer publishes, and the time it covers.

One window (a second) holds one or two drafter steps, so its shares swing across the thresholds and a
verdict judged on it flips every few seconds. The published verdict judges the last VERDICT_SPAN_S of
windows merged (shares weighted by each window's length), with the GIL probe and the machine's CPU over
the same span, states that span as its `scope`, and is held against flapping by SteadyVerdict. At the
end of a run the whole run is judged instead (`whole_run`): the last windows hold the wind-down, when
every stage waits on another.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from dflash.telemetry.summary import Summary, WorkerStats
from dflash.telemetry.verdict.evidence import (
    CpuFigures,
    analyze,
    cpu_starved,
    gil_bound,
    gpu_kernel_shares,
    launch_bound,
    stage_gpu_busy,
)
from dflash.telemetry.wire.protocol import (
    Bottleneck,
    CategoryStats,
    MachineSample,
    SystemSample,
    training_shares,
)
from dflash.telemetry.wire.table import clock, pipeline_cpu
from dflash.telemetry.wire.verdicts import (
    CPU_STARVED,
    DATA_BOUND,
    DRAFTER_BOUND,
    GIL_BOUND,
    HOLD_WINDOWS,
    INPUT_BOUND,
    LAUNCH_BOUND,
    OVERLAY_ORDER,
    TARGET_BOUND,
    THRESHOLD,
    UNKNOWN,
    VERDICT_SPAN_S,
)
from dflash.telemetry.wire.vocab import PAUSE_CATEGORIES, Gauge, evaluating

#: where a stage-bound verdict is left again (it is reached at THRESHOLD): see PublishedVerdict._threshold
LEAVE_THRESHOLD = 0.15
_STAGE_BOUND = {v.name for v in (DATA_BOUND, INPUT_BOUND, TARGET_BOUND, DRAFTER_BOUND)}


@dataclass
class _Window:
    seconds: float
    workers: WorkerStats
    #: the steps counter before and after the window (None: the run counts no steps)
    steps: tuple[float, float] | None
    contention: float | None
    process_cpu: float | None
    #: worker -> its thread's CPU percent
    thread_cpu: dict[str, float] = field(default_factory=dict)
    machine: MachineSample | None = None
    #: CUDA ordinal -> share of the window the trainer's kernels ran on that GPU (NVML)
    gpu: dict[int, float] = field(default_factory=dict)


def _mean(pairs: list[tuple[float, float]]) -> float | None:
    """Mean of (weight, value) pairs, None when there are none."""
    w = sum(p[0] for p in pairs)
    return sum(p[0] * p[1] for p in pairs) / w if w > 0 else None


def _span_stats(parts: list[tuple[float, CategoryStats]], total_s: float) -> CategoryStats:
    """One category over the span from its windows' (seconds, stats): counts and times summed, shares
    weighted by window length; the percentiles are the newest window's (the verdict does not use them)."""
    last = parts[-1][1]
    dev_parts = [(s, st.device) for s, st in parts if st.device is not None]
    dev = None
    if dev_parts:
        dev = msgspec.structs.replace(dev_parts[-1][1], n=sum(d.n for _, d in dev_parts),
                                      total=sum(d.total for _, d in dev_parts),
                                      share=sum(s * d.share for s, d in dev_parts) / total_s)
    return msgspec.structs.replace(last, n=sum(st.n for _, st in parts), total=sum(st.total for _, st in parts),
                                   share=sum(s * st.share for s, st in parts) / total_s, device=dev)


class RecentWindows:
    """The last `span_s` seconds of published windows, judged together."""

    def __init__(self, span_s: float = VERDICT_SPAN_S) -> None:
        self.span_s = span_s
        self._windows: deque[_Window] = deque()
        self._roles: dict[str, str] = {}
        self._devices: dict[str, int] = {}
        self._steps: float | None = None

    def add(self, summary: Summary, system: SystemSample | None) -> None:
        if summary.window_s <= 0:
            return
        self._roles = summary.roles or self._roles
        self._devices = summary.devices or self._devices
        steps, before = summary.counters.get("steps"), self._steps
        self._steps = steps
        threads = {t.name: t.cpu_percent for t in system.threads} if system is not None else {}
        self._windows.append(_Window(
            seconds=summary.window_s, workers=summary.workers,
            steps=None if steps is None else (steps if before is None else before, steps),
            contention=summary.gauges.get(Gauge.GIL_CONTENTION),
            process_cpu=system.cpu_percent if system is not None else None,
            thread_cpu={w: threads[w] for w in summary.workers if w in threads},
            machine=system.machine if system is not None else None, gpu=gpu_kernel_shares(system)))
        # keep the newest windows that cover the span (the oldest one may start before it)
        while (len(self._windows) > 1
               and sum(w.seconds for w in self._windows) - self._windows[0].seconds >= self.span_s):
            self._windows.popleft()

    def merged(self) -> WorkerStats:
        """Each worker's categories over the span (a worker absent from a window counts as idle there)."""
        total = sum(w.seconds for w in self._windows)
        parts: dict[str, dict[str, list[tuple[float, CategoryStats]]]] = {}
        for win in self._windows:
            for worker, cats in win.workers.items():
                for cat, st in cats.items():
                    if cat not in PAUSE_CATEGORIES:  # an evaluation is not training (whole_run drops it too)
                        parts.setdefault(worker, {}).setdefault(cat, []).append((win.seconds, st))
        return {worker: {cat: _span_stats(p, total) for cat, p in cats.items()}
                for worker, cats in parts.items()} if total > 0 else {}

    def cpu_figures(self, workers: WorkerStats) -> CpuFigures | None:
        """The machine's view over the span; None without machine samples or worker threads."""
        m = [(w.seconds, w.machine) for w in self._windows if w.machine is not None and w.machine.cores > 0]
        # each worker's thread CPU over the span, weighted like its shares
        total = sum(w.seconds for w in self._windows)
        seen = {name for w in self._windows for name in w.thread_cpu}
        thread_cpu = {name: sum(w.thread_cpu.get(name, 0.0) * w.seconds for w in self._windows) / total
                      for name in seen} if total > 0 else {}
        figures = pipeline_cpu(workers, self._roles, thread_cpu)
        if not m or figures is None:
            return None
        last = m[-1][1]
        return CpuFigures(
            worker_cpu=figures[0], worker_busy=figures[1], cores=last.cores,
            others_cores=_mean([(s, x.others_percent / 100.0) for s, x in m]) or 0.0,
            idle_cores=_mean([(s, max(0.0, x.cores - x.busy_percent / 100.0)) for s, x in m]) or 0.0,
            load1=last.load1,
            steal_cores=_mean([(s, x.steal_percent / 100.0) for s, x in m if x.steal_percent is not None]))

    def gpu_busy(self) -> dict[str, float]:
        """Each stage's GPU kernel share over the span (NVML, weighted like the shares), for launch-bound."""
        seen = {i for w in self._windows for i in w.gpu}
        gpu = {i: _mean([(w.seconds, w.gpu[i]) for w in self._windows if i in w.gpu]) or 0.0 for i in seen}
        return stage_gpu_busy(self._roles, self._devices, gpu)

    def steps(self) -> float | None:
        """Training steps made in the span (None: the run counts no steps)."""
        steps = [w.steps for w in self._windows if w.steps is not None]
        return steps[-1][1] - steps[0][0] if steps else None

    def scope(self) -> str:
        total, steps = sum(w.seconds for w in self._windows), self.steps()
        return f"last {total:.0f} s" + (f", {steps:.0f} steps" if steps is not None else "")

    def judge(self, threshold: float = THRESHOLD) -> Bottleneck:
        """The verdict over the span, with its evidence and the machine's view from the same span."""
        workers = self.merged()
        raw = analyze(workers, self._roles, threshold=threshold, steps=self.steps())
        contention = _mean([(w.seconds, w.contention) for w in self._windows if w.contention is not None])
        process = _mean([(w.seconds, w.process_cpu) for w in self._windows if w.process_cpu is not None])
        refined = refine(raw, self.cpu_figures(workers), contention, process, self.gpu_busy())
        return msgspec.structs.replace(refined, scope=self.scope())

    def clear(self) -> None:
        """Forget the span (a phase change: what came before says nothing about what comes next)."""
        self._windows.clear()


class SteadyVerdict:
    """Hysteresis for the judged verdict: the published verdict changes only once another has won
    `hold` judgements in a row, so shares wobbling around a threshold do not flip it. The first real
    verdict, and any verdict after "unknown" (start-up, an evaluation pause), is taken at once: there is
    nothing to hold then. A held verdict keeps the reason and evidence it was last judged on (so the
    two never disagree) and says in its scope what the newer judgements look like."""

    def __init__(self, hold: int = HOLD_WINDOWS) -> None:
        self.hold = hold
        self.current: Bottleneck | None = None
        self._challenger: str | None = None
        self._wins = 0

    def update(self, raw: Bottleneck) -> Bottleneck:
        cur = self.current
        if cur is None or cur.verdict == UNKNOWN.name or raw.verdict == cur.verdict:
            self._challenger, self._wins = None, 0
            self.current = raw
            return raw
        if raw.verdict == self._challenger:
            self._wins += 1
        else:
            self._challenger, self._wins = raw.verdict, 1
        if self._wins >= self.hold:
            self._challenger, self._wins = None, 0
            self.current = raw
            return raw
        # Held: the standing verdict with its own numbers, and why it stands.
        scope = f"{cur.scope}; " if cur.scope else ""
        return msgspec.structs.replace(cur, scope=f"{scope}held: the latest judgement looks {raw.verdict}, "
                                                  f"{self._wins} of {self.hold} in a row needed to change")


def refine(raw: Bottleneck, cpu: CpuFigures | None, contention: float | None, process_cpu: float | None,
           gpu_busy: Mapping[str, float] | None = None) -> Bottleneck:
    """The stage verdict, turned CPU-starved where the machine kept the workers off the cores, else
    GIL-bound where the probe and the CPU time agree, else launch-bound where the bounding stage's GPU
    waits on its thread (the overlays in OVERLAY_ORDER); all figures over the same time."""
    overlays = {CPU_STARVED.name: lambda: cpu_starved(raw, cpu),
                GIL_BOUND.name: lambda: gil_bound(raw, contention, process_cpu),
                LAUNCH_BOUND.name: lambda: launch_bound(raw, gpu_busy)}
    for overlay in OVERLAY_ORDER:  # the table's order, strongest first
        refined = overlays[overlay.name]()
        if refined.verdict == overlay.name:
            return refined
    return raw


@dataclass
class RunCpu:
    """The machine's view and the GIL probe over every training window of the run (time-weighted sums),
    for the whole run's verdict: windows of an evaluation are left out, as their shares are."""

    seconds: float = 0.0
    cpu: float = 0.0
    busy: float = 0.0
    others: float = 0.0
    idle: float = 0.0
    steal: float | None = None
    contention: tuple[float, float] = (0.0, 0.0)  # (seconds with a reading, sum of reading x seconds)
    process: float = 0.0
    last: MachineSample | None = None
    #: CUDA ordinal -> (seconds with a reading, sum of its kernel share x seconds)
    gpu: dict[int, tuple[float, float]] = field(default_factory=dict)

    def add(self, summary: Summary, system: SystemSample | None) -> None:
        if system is not None and summary.window_s > 0 and not evaluating(summary.gauges):
            for i, share in gpu_kernel_shares(system).items():
                seen, total = self.gpu.get(i, (0.0, 0.0))
                self.gpu[i] = (seen + summary.window_s, total + share * summary.window_s)
        m = system.machine if system is not None else None
        if system is None or m is None or m.cores <= 0 or summary.window_s <= 0 or evaluating(summary.gauges):
            return
        figures = pipeline_cpu(summary.workers, summary.roles, {t.name: t.cpu_percent for t in system.threads})
        if figures is None:
            return
        s = summary.window_s
        self.seconds += s
        self.cpu, self.busy = self.cpu + figures[0] * s, self.busy + figures[1] * s
        self.others += m.others_percent / 100 * s
        self.idle += max(0.0, m.cores - m.busy_percent / 100) * s
        if m.steal_percent is not None:
            self.steal = (self.steal or 0.0) + m.steal_percent / 100 * s
        self.process += system.cpu_percent * s
        g = summary.gauges.get(Gauge.GIL_CONTENTION)
        if g is not None:
            self.contention = (self.contention[0] + s, self.contention[1] + g * s)
        self.last = m

    def figures(self) -> tuple[CpuFigures | None, float | None, float | None]:
        """(CPU figures, mean GIL contention, mean process CPU percent) over the run; Nones without windows."""
        s, m = self.seconds, self.last
        if s <= 0 or m is None:
            return None, None, None
        cpu = CpuFigures(worker_cpu=self.cpu / s, worker_busy=self.busy / s, cores=m.cores,
                         others_cores=self.others / s, idle_cores=self.idle / s, load1=m.load1,
                         steal_cores=None if self.steal is None else self.steal / s)
        seen, total = self.contention
        return cpu, total / seen if seen > 0 else None, self.process / s

    def gpu_busy(self, roles: Mapping[str, str] | None, devices: Mapping[str, int]) -> dict[str, float]:
        """Each stage's GPU kernel share over the run's training windows (NVML)."""
        return stage_gpu_busy(roles, devices, {i: total / seen for i, (seen, total) in self.gpu.items() if seen > 0})


class PublishedVerdict:
    """What the trainer publishes in each snapshot and prints in its log line: the recent span judged,
    held against flapping, or the whole run once it has ended."""

    def __init__(self, span_s: float = VERDICT_SPAN_S) -> None:
        self.recent = RecentWindows(span_s)
        self.run = RunCpu()
        self.steady = SteadyVerdict()
        #: the last verdict published (None before the first window)
        self.current: Bottleneck | None = None
        self._evaluating = False

    def update(self, summary: Summary, system: SystemSample | None) -> Bottleneck:
        now = evaluating(summary.gauges)
        if now != self._evaluating:  # a phase change: the span before it says nothing about what follows
            self.recent.clear()
            self._evaluating = now
        self.recent.add(summary, system)
        self.run.add(summary, system)
        self.current = self.steady.update(self.recent.judge(self._threshold()))
        return self.current

    def _threshold(self) -> float:
        """A band, not a line: a stage-bound verdict is reached when a wait passes THRESHOLD and stands
        until it falls below LEAVE_THRESHOLD, so a share wobbling around one number (the tiny trainer's
        targets block 12-27% of each span) does not flip the verdict; the evidence says which was used."""
        standing = self.steady.current
        return LEAVE_THRESHOLD if standing is not None and standing.verdict in _STAGE_BOUND else THRESHOLD

    def final(self, summary: Summary) -> Bottleneck:
        """The whole run's verdict, the machine's view and the GIL probe over its training windows."""
        b = whole_run(summary.cumulative, summary.roles, summary.counters.get("steps"))
        gpu = self.run.gpu_busy(summary.roles, summary.devices)
        self.current = msgspec.structs.replace(refine(b, *self.run.figures(), gpu), scope=b.scope)
        return self.current


def whole_run(cumulative: Mapping[str, Mapping[str, CategoryStats]], roles: Mapping[str, str] | None,
              steps: float | None = None) -> Bottleneck:
    """The whole run's verdict: every worker's stats since its start, evaluation time taken out."""
    workers, paused_s = training_shares({w: dict(c) for w, c in cumulative.items()})
    b = analyze(workers, roles, steps=steps)
    note = f", evaluation {clock(paused_s, short=True)} apart" if paused_s > 0 else ""
    return msgspec.structs.replace(b, scope=f"whole run{note}")
