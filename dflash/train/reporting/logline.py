"""The main thread's regular work while the workers train: once per telemetry interval, read the
drafter's device-side metric sums (the one wait on the GPU the training loop allows) and publish them
with the progress; once per log interval, write one log line (progress, metrics, the verdict's name)
and feed the trackers. The category table, the verdict's reason and its evidence follow a line only
every `log_table_every` seconds, at the end of the run, or every time with `--log-table`: they are
what dflash-top and `dflash stats` are for, and twelve rows every few seconds bury the progress."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from dflash.telemetry.verdict.churn import ChurnRates
from dflash.telemetry.wire.vocab import SEGMENT_FREES_PER_S, SEGMENT_MAPS_PER_S, device_gauge, term_gauge
from dflash.train.config import TrainConfig
from dflash.train.control import Interval
from dflash.train.device.flops import Utilisation
from dflash.train.device.memory import AllocatorRetries, allocator_gauges
from dflash.train.device.metrics import StepMetrics, Totals
from dflash.train.reporting import Reporter
from dflash.train.reporting.progress import Progress, clock
from dflash.train.reporting.trackers import interval_scalars
from dflash.train.run.pipeline import Pipeline, TrainCounters


class LogLines:
    def __init__(self, cfg: TrainConfig, state: TrainCounters, stats: Any, metrics: StepMetrics, pipeline: Pipeline,
                 latest: Callable[[], Any], verdict: Callable[[], Any], report: Reporter,
                 devices: list, clock: Callable[[], float] = time.monotonic, peak_flops: float | None = None):
        """`latest`: the newest telemetry snapshot (or None); `verdict()`: the verdict dflash-top shows
        (the last 10 s, held) or None, and `verdict(summary)` the whole run's; `devices`: the run's
        devices, for allocator gauges; `peak_flops`: their dense bf16 peak, FLOP/s, for MFU (None: none
        known, MFU n/a)."""
        self.cfg, self.state, self.stats, self.metrics, self.pipeline = cfg, state, stats, metrics, pipeline
        self.latest, self.verdict, self.report = latest, verdict, report
        self.cuda = list(dict.fromkeys(d for d in devices if d.type == "cuda"))
        self.retries = AllocatorRetries()  # an event each time the allocator had to retry (CUDA only)
        # segment maps and frees per second (CUDA only): a harvest at each log line as well as each interval
        # must not make a rate of a few milliseconds, so readings closer than half an interval are skipped
        self.churn = ChurnRates(min_dt_s=cfg.telemetry.telemetry_interval / 2)
        self.clock = clock
        self.logs = Interval(cfg.run.log_every, clock)
        self.tables = Interval(cfg.run.log_table_every, clock)
        self._planned = False  # the run's duration here, said once from its first steps (`plan`)
        self.harvests = Interval(cfg.telemetry.telemetry_interval, clock)
        self._totals = Totals()  # harvested since the last log line
        self._tokens_at_log = state.tokens
        # the gauges' model TFLOP/s and MFU over the last 10 s, measured from this process's start
        self.utilisation = Utilisation(peak_flops, start=(clock(), state.flops))
        self._flops_at_log = state.flops
        self._logged_step = -1
        self._said_verdict: str | None = None  # the last verdict said with its reason
        self._start = (state.step, pipeline.clock())  # where this process began, for the rate and ETA
        self._first: tuple[int, float] | None = None

    def tick(self) -> None:
        """Whatever is due now."""
        for name, value in self.progress().gauges().items():
            self.stats.gauge(name, value)
        if self.cfg.telemetry.enabled and self.harvests.due():
            self.harvest()
            self.harvests.restart()
        if not self._planned:
            self.plan()
        if self.logs.due():
            self.write()

    #: the rate the duration is said from: this much training and this many steps after the first one
    #: (the first step also pays for warm-up: thread start, allocator, the first batches)
    PLAN_AFTER_S, PLAN_AFTER_STEPS = 10.0, 5

    def plan(self) -> None:
        """Once the first steps have set the rate, say how long the run takes here: a step budget's
        duration depends on the machine (its result does not), so the log says it up front."""
        first, run = self._first_step(), self.cfg.run
        if first is None:
            return
        now = self.pipeline.clock()
        steps, ran = self.state.step - first[0], now - first[1]
        if steps < self.PLAN_AFTER_STEPS or ran < self.PLAN_AFTER_S:
            return
        self._planned = True
        if not run.max_steps:
            return  # a time limit says its own duration; an open-ended run has none
        rate = steps / ran
        left = (run.max_steps - self.state.step) / rate
        cut = run.max_time is not None and run.max_time - now < left
        if cut:
            left = run.max_time - now
        then = ", then the final evaluation" if self.cfg.eval.eval_prompts > 0 else ""
        self.report.event("phase", f"training: {run.max_steps:,} steps at {rate:.2f} steps/s here (steps "
                          f"{first[0]}-{self.state.step}): about {clock(left)} more, {clock(now + left)} in all"
                          + (" (--max-time ends it first)" if cut else "") + then,
                          steps=run.max_steps, steps_per_s=rate, eta_s=left)

    def _first_step(self) -> tuple[int, float] | None:
        """(step, training clock) when this process made its first step; None before it."""
        if self._first is None and self.state.step > self._start[0]:
            self._first = (self.state.step, self.pipeline.clock())
        return self._first

    def progress(self) -> Progress:
        elapsed = self.pipeline.clock()
        ran = elapsed - self._start[1]
        rate = (self.state.step - self._start[0]) / ran if ran > 0 else None
        return Progress(self.state.step, elapsed, self.cfg.run.max_steps, self.cfg.run.max_time, rate)

    def harvest(self) -> None:
        """Read the device-side metric sums, publish them as gauges and metrics, and keep them for the
        next log line; and the caching allocator's counters (read here, not per step by a worker)."""
        totals = self.metrics.collect()
        if totals is not None:
            self._totals = self._totals + totals
            t, s = totals.summary(), self.stats
            s.gauge("loss", t["loss"])
            for term, value in t["terms"].items():
                s.gauge(term_gauge(term), value)
            s.gauge("grad_norm", t["grad_norm"])
            for name in ("accuracy", "sim_tau", "block_tau", "per_position_acc"):
                s.metric(name, t[name])
            for name, value in t["measured"].items():  # what the objective's terms measure (DFlash2's selector)
                s.metric(name, value)
        for name, value in self.utilisation.gauges(self.clock(), self.state.flops).items():
            self.stats.gauge(name, value)
        for i, counters in allocator_gauges(self.cuda).items():
            # the driver calls go out as rates (the churn monitor reads those), not as running counts
            maps, frees = counters.pop("segment_maps"), counters.pop("segment_frees")
            for name, value in counters.items():
                self.stats.gauge(f"cuda{i}_{name}", value)
            if (rates := self.churn.rates(i, self.clock(), maps, frees)) is not None:
                self.stats.gauge(device_gauge(i, SEGMENT_MAPS_PER_S), rates[0])
                self.stats.gauge(device_gauge(i, SEGMENT_FREES_PER_S), rates[1])
            if (line := self.retries.rose(i, counters["alloc_retries"])) is not None:
                self.report.event("anomaly", line, device=f"cuda:{i}", retries=counters["alloc_retries"])

    def write(self, final: bool = False) -> None:
        """The log line for the steps since the last one (nothing when no step was made: a line per
        interval without progress would only be noise), and when due the table and the verdict's
        reason and evidence; the `final` call always ends with them, even when the last interval's
        line already showed the last step. It judges the whole run: its last window holds the
        wind-down, when every stage waits on another."""
        st, r = self.state, self.state.last
        dt = max(1e-9, self.clock() - self.logs.last)
        tps = (st.tokens - self._tokens_at_log) / dt
        flops = (st.flops - self._flops_at_log) / dt if st.flops > 0 else None  # None: FLOPs not counted
        self.logs.restart()
        self._tokens_at_log, self._flops_at_log = st.tokens, st.flops
        new = r is not None and st.step != self._logged_step
        if not new and not (final and r is not None):
            return
        summary, b = self.latest(), None
        if summary is not None:
            from dflash.telemetry.verdict.published import whole_run

            # The verdict dflash-top shows (the recent span it names), the whole run at the end.
            b = self.verdict(summary if final else None) or whole_run(summary.cumulative, summary.roles,
                                                                     summary.counters.get("steps"))
        if new:
            self._logged_step = st.step
            self.line(tps, b, summary, flops)
        if summary is not None and (final or self.cfg.run.log_table or self.tables.due()):
            self.tables.restart()
            self.table(summary, b)
        elif b is not None and b.verdict != self._said_verdict:
            self.say_verdict(b)  # a new verdict is said with its reason at once, not at the next table

    def line(self, tps: float, b: Any, summary: Any, flops: float | None = None) -> None:
        """The one line of an interval (the means over its steps; `flops`: its model FLOP/s, None where
        they are not counted), and the trackers' scalars."""
        st, r = self.state, self.state.last
        self.harvest()
        m, self._totals = self._totals.summary(), Totals()  # means over the steps since the last line
        batch_q, hs_q = self.pipeline.depths()
        q = f"q batch {batch_q}/{self.cfg.pipeline.batch_queue_size} hs {hs_q}/{self.cfg.pipeline.hs_queue_size}"
        measured = m["measured"]
        selector = f"| sel recall {measured['selector_recall']:.3f} acc {measured['selector_accuracy']:.3f} " \
            if "selector_recall" in measured else ""
        if "accept_rate" in measured:  # DSpark: 1 - TV to the target, and its confidence head's error on it
            selector += f"| accept {measured['accept_rate']:.3f} conf err {measured['confidence_error']:.3f} "
        self.report.log(f"{self.progress().text()} | loss {m['loss']:.3f} | acc {m['accuracy']:.3f} "
                        f"| sim_tau {m['sim_tau']:.2f} {selector}| {tps:,.0f} tok/s "
                        + (f"| {self.utilisation.text(flops)} " if flops is not None else "")
                        + f"| lr {r.lr:.2e} "
                        f"| gnorm {m['grad_norm']:.2f} | {q}" + (f" | {b.verdict}" if b is not None else ""))
        if self.report.trackers is not None:
            self.report.trackers.log(st.step, interval_scalars(
                loss=m["loss"], terms=m["terms"], accuracy=m["accuracy"], sim_tau=m["sim_tau"],
                per_position=m["per_position_acc"],
                tokens_per_s=tps, lr=r.lr, grad_norm=m["grad_norm"], verdict=b.verdict if b else None,
                tflops=None if flops is None else flops / 1e12,
                mfu=None if flops is None else self.utilisation.mfu(flops),
                measured=measured,
                workers=summary.cumulative if summary is not None else None))

    def table(self, summary: Any, b: Any) -> None:
        """The category table of the run so far (cumulative: a 1 s window is too noisy for a table in a
        log), the verdict with its scope and reason, and its evidence from that same span, so the
        lines never pair a verdict with other numbers."""
        from dflash.telemetry import format_profile_stats

        self.report.log(format_profile_stats(summary, limit=12, cumulative=True))
        self.say_verdict(b)

    def say_verdict(self, b: Any) -> None:
        """The verdict with its scope and reason, and its evidence."""
        from dflash.telemetry.wire.table import evidence_text

        self._said_verdict = b.verdict
        scope = f" ({b.scope})" if b.scope else ""
        self.report.log(f"bottleneck{scope}: {b.verdict}" + (f" - {b.reason}" if b.reason else ""))
        if b.evidence:
            self.report.log(f"  evidence: {evidence_text(b.evidence)}")
