"""`dflash train`: build the run, start its workers and what watches them, supervise, finish.

The Trainer only supervises: the parts are made by `build` (build.py), the per-step decisions by
`StepControl` (control.py), saving by `Checkpointer` (checkpointer.py), evaluating by `Evaluations`
(evaluation.py), the log lines by `LogLines` (logline.py), the socket, exporter and health monitors by
`Monitoring` (monitoring.py). The main thread never does training work: it ticks the log lines, watches
for a failed worker or a stall, and ends the run (final checkpoint, final evaluation); a signal means
"finish this step, checkpoint, exit 0" (signals.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash.data.cache_format import CacheError
from dflash.data.held_out import save_record
from dflash.telemetry.wire.vocab import Counter
from dflash.train import distributed
from dflash.train.checkpoint.checkpointer import (
    Checkpointer,
    checkpoint_bytes,
    checkpoint_to_resume,
    default_interval,
)
from dflash.train.config import ConfigError, TrainConfig
from dflash.train.config.schema import flat_values
from dflash.train.control import Interval, StepControl
from dflash.train.device.binding import bind_thread, resolve, thread_device
from dflash.train.device.metrics import StepMetrics
from dflash.train.distributed import Dist, DistError
from dflash.train.health.faults import FaultPlan, FaultSpecError
from dflash.train.health.nonfinite import NonFiniteWatch
from dflash.train.reporting import Reporter, announced_phase
from dflash.train.reporting.evaluation import Evaluations
from dflash.train.reporting.logline import LogLines
from dflash.train.reporting.monitoring import Monitoring
from dflash.train.reporting.trackers import TrackerError, Trackers, check_available
from dflash.train.run.build import Components, TrainError, build, restore, run_target
from dflash.train.run.pipeline import Pipeline, TrainCounters
from dflash.train.run.stages import StepResult
from dflash.train.signals import stop_on_signals
from dflash.train.versions import check_installed
from dflash.words import plural


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: bool = False, log: Callable[[str], None] | None = None):
        self.cfg, self.resume = cfg, resume
        self.report = Reporter(log)
        self.dist = Dist()
        self.state = TrainCounters()
        self.stop_requested = threading.Event()  # a signal (or a test) asks for "checkpoint and exit"
        self.metrics = StepMetrics()  # the drafter thread's device-side metric sums
        self.parts: Components | None = None  # made by setup()
        self.device: torch.device | None = None  # the GPU every helper thread binds (None: host only)
        # made by run() around the parts
        self.control: StepControl | None = None
        self.pipeline: Pipeline | None = None
        self.checkpoints: Checkpointer | None = None
        self.evaluations: Evaluations | None = None
        self.nonfinite: NonFiniteWatch | None = None
        self.monitoring: Monitoring | None = None
        self.final_eval: dict[str, Any] | None = None  # the final evaluation's summary, for the last line

    # the parts by name, for what drives a Trainer from outside (tests, benchmarks, gpu_check)
    drafter = property(lambda self: self.parts.drafter)
    targets = property(lambda self: self.parts.targets)
    source = property(lambda self: self.parts.source)
    stats = property(lambda self: self.parts.stats)
    server = property(lambda self: self.monitoring.server if self.monitoring else None)

    # --- setup ----------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Join the ranks, find the checkpoint to resume, build the run's parts and restore them; save
        the resolved config."""
        cfg, report = self.cfg, self.report
        self.join_ranks()
        report.dist = d = self.dist
        # The main thread loads, evaluates and checkpoints on the trainer's GPU: bound there before any
        # of it, never on GPU 0 by default.
        pipe = cfg.pipeline
        self.device = thread_device(*(resolve(x) for x in (pipe.drafter_device, *pipe.target_devices)))
        bind_thread(self.device)
        try:
            faults = FaultPlan.from_env(d.rank)
        except FaultSpecError as e:
            raise TrainError(str(e)) from None
        if faults is not None:
            report.say(f"fault injection (DFLASH_FAULT): {faults.describe()}")
        ckpt = checkpoint_to_resume(Path(cfg.run.run_dir), d, self.resume, report)
        target = run_target(cfg, report.log, resuming=ckpt is not None)
        self.parts = parts = build(cfg, d, target, ckpt, faults, log=report.log, event=report.event)
        if ckpt is not None:
            self.state = restore(ckpt, parts, d, report.log)
        if d.is_main:
            cfg.save(Path(cfg.run.run_dir) / "config.json")
            if ckpt is None:  # what a resume holds out again (a run without this record held out nothing)
                save_record(Path(cfg.run.run_dir), parts.evals.held_out, str(parts.data_path), cfg.data.seed)
        report.log("config: " + " ".join(f"{k}={v}" for k, v in flat_values(cfg).items()))
        report.log(parts.describe(cfg))
        if parts.evals.what:
            report.log(f"evaluation on {parts.evals.what}" if parts.evals.prompts else
                       f"no evaluation: {parts.evals.what}")
        if d.enabled:
            backend = "nccl" if parts.drafter_device.type == "cuda" else "gloo"
            report.log(f"distributed: {d.world_size} ranks ({backend}), "
                       f"each with {len(parts.targets)} target worker(s) and one drafter in DDP; "
                       f"{parts.source.batch_size} samples per rank per step; collective timeout "
                       f"{cfg.distributed.collective_timeout:.0f}s")

    def join_ranks(self) -> None:
        """Under torchrun: find this rank, put its devices on its own GPUs, join the process groups."""
        cfg = self.cfg
        try:
            self.dist = d = distributed.from_env()
            if not d.enabled:
                return
            pipe = cfg.pipeline
            pipe.target_devices, pipe.drafter_device = distributed.place_devices(
                pipe.target_devices, pipe.drafter_device, d, torch.cuda.device_count())
            distributed.init(d, pipe.drafter_device, cfg.distributed.collective_timeout)
        except DistError as e:
            raise TrainError(str(e)) from None

    def _wire(self) -> None:
        """The objects that act on the parts: the step control (its clock is the one the ranks agree
        on in a multi-rank run), the pipeline, checkpoints, evaluations, the non-finite watch and the
        monitoring."""
        cfg, d, parts, report = self.cfg, self.dist, self.parts, self.report
        agreement = distributed.Agreement(d) if d.enabled else None
        self.control = StepControl(cfg.run.max_steps, cfg.run.max_time, self._checkpoint_interval(),
                                   cfg.eval.eval_every if parts.evals.prompts else 0,
                                   is_main=d.is_main, agreement=agreement, trained=self.state.train_time)
        self.pipeline = Pipeline(parts.source, parts.targets, parts.drafter, cfg.pipeline, cfg.run, parts.stats,
                                 self.state, self.on_step,
                                 clock=self.control.agreed_clock if agreement is not None else None)
        self.checkpoints = Checkpointer(cfg, d, parts, self.state, self.pipeline.clock, self.control.checkpoints,
                                        report)
        self.evaluations = Evaluations(cfg, parts, report)
        self.nonfinite = NonFiniteWatch(parts.drafter.guard, parts.stats, report.event,
                                        Interval(cfg.run.log_every, time.monotonic))
        self.monitoring = Monitoring(cfg, d, parts.stats, report, self.device)

    def _checkpoint_interval(self) -> float:
        """--checkpoint-every, or the default derived from the checkpoint's size (said in the log)."""
        every = self.cfg.checkpoint.checkpoint_every
        if every is None:
            size = checkpoint_bytes(self.parts.drafter.drafter)
            every = default_interval(size)
            self.report.log(f"checkpoints: every {every:.0f} s in the background ({size / 1e9:.2f} GB each: "
                            "one minute per GB, at least one; --checkpoint-every to change)")
        return every

    # --- the drafter thread's per-step hook -----------------------------------------------------------

    def on_step(self, r: StepResult) -> bool:
        """Runs in the drafter thread after each optimizer step; False ends the run."""
        st, s = self.state, self.parts.stats
        st.step += 1
        st.next_batch += 1
        st.tokens += r.tokens
        st.samples += r.samples
        st.flops += r.flops
        st.last = r
        s.count(Counter.STEPS, 1)
        s.count(Counter.TOKENS, r.tokens)
        s.count(Counter.SAMPLES, r.samples)
        s.count(Counter.SUPERVISED_TOKENS, r.out.num_tokens)
        s.gauge("lr", r.lr)
        s.gauge("step", st.step)
        # Loss, accuracy, taus and the gradient norm stay on the device; the main thread reads them once
        # per interval (LogLines.harvest): reading them here would stall this thread on the GPU.
        self.metrics.add(r.out.stats, r.grad_norm, r.out.per_position_count,
                         r.out.num_blocks, r.out.term_names, r.out.metric_names)
        wants_stop = self.nonfinite.too_many() or self.stop_requested.is_set()
        d = self.control.after_step(st.step, wants_stop, self.pipeline.train_time())
        if d.checkpoint:
            self.checkpoint(final=d.stop)
        if d.evaluate:
            self.evaluate(in_training=True)
        return not d.stop

    def checkpoint(self, final: bool = False, collective: bool = True) -> Path | None:
        return self.checkpoints.save(final=final, collective=collective)

    def evaluate(self, in_training: bool = False) -> dict[str, Any]:
        summary = self.evaluations.run(self.state.step, in_training=in_training)
        self.control.evaluations.restart()
        return summary

    # --- run ------------------------------------------------------------------------------------------

    def run(self) -> int:
        cfg, report = self.cfg, self.report
        try:
            check_available(cfg.telemetry.report_to)  # before minutes of loading, not after
        except TrackerError as e:
            raise TrainError(str(e)) from None
        self.setup()
        if cfg.telemetry.report_to and self.dist.is_main:
            try:
                report.trackers = Trackers(cfg.telemetry.report_to, Path(cfg.run.run_dir), cfg.name, flat_values(cfg))
            except TrackerError as e:
                raise TrainError(str(e)) from None
            report.log(f"trackers:  {', '.join(cfg.telemetry.report_to)}")
        self._wire()
        phase = announced_phase()
        if phase is not None:
            report.event("phase", phase)
        code, supervised = 0, False
        try:
            with stop_on_signals(self.stop_requested, report.log):
                self.pipeline.start()  # threads first, so that the hello frame's thread map names every worker
                if cfg.telemetry.enabled:
                    self.monitoring.start()
                else:
                    report.log("telemetry: off (--no-telemetry)")
                code, supervised = self._supervise(), True
        finally:
            stalled = self.monitoring.stall is not None
            self.pipeline.shutdown(timeout=1.0 if stalled else 10.0)  # a stalled worker will not stop
            self.parts.target.close()  # a cache's reader threads may be waiting for files that never come
            self.checkpoints.close()  # a save still being written is finished, not cut off
            # Prometheus gets its last scrape after a run that ended on its own, not after a start that
            # failed or a signal that asked the run to end now
            self.monitoring.close(failed=code != 0 or not supervised,
                                  linger=supervised and not self.stop_requested.is_set())
            if report.trackers is not None:
                report.trackers.close()
        bad = self.parts.bad_samples
        skipped = f", {plural(len(bad), 'bad sample')} skipped (each named above)" if bad else ""
        tau = (f", final tau {self.final_eval['tau']:.2f} on {self.final_eval['prompts']}"
               if self.final_eval is not None else "")
        report.log(f"done: {plural(self.state.step, 'step')}, {self.state.tokens:,} tokens{skipped}{tau}, run dir "
                   f"{cfg.run.run_dir}")
        if self.stop_requested.is_set() and code == 0:  # stopped early (Ctrl-C, SIGTERM): say how to go on
            report.log(f"to continue: dflash train --resume --run-dir {cfg.run.run_dir}")
        if stalled and self.dist.enabled:
            sys.stdout.flush()
            os._exit(code)  # a collective is hung: tearing down the process group would hang with it
        distributed.shutdown(self.dist)
        return code

    def _supervise(self) -> int:
        """Main-thread loop: log, watch for a failed worker or a stall, then finish the run."""
        m = self.monitoring
        lines = LogLines(self.cfg, self.state, self.parts.stats, self.metrics, self.pipeline, m.latest, m.verdict,
                         self.report, [self.parts.drafter_device, *(t.device for t in self.parts.targets)],
                         peak_flops=self.parts.peak_flops)
        while self.pipeline.running:
            time.sleep(0.05)
            if m.stall is not None:
                return self._exit_on_stall()
            if self.pipeline.failure:
                break
            lines.tick()
        stuck = self.pipeline.shutdown()
        if self.pipeline.failure:
            code = self._report_failure()
        else:
            m.publish_now()  # a run shorter than one interval still ends with its table
            lines.write(final=True)
            code = self._finish()
        if stuck:
            self.report.log(f"warning: workers did not exit in time: {', '.join(stuck)}")
        return code

    def _finish(self) -> int:
        """The final checkpoint, then the final evaluation unless the run was cut short."""
        self.checkpoint(final=True)
        code = 0
        if self.checkpoints.failed:
            self.report.problem(f"the final checkpoint was not saved (see above): --resume continues from the "
                                f"newest one in {self.cfg.run.run_dir}/checkpoints")
            code = 1
        if self.nonfinite.stop_line is not None:
            self.report.problem(self.nonfinite.stop_line)
            self.report.event("error", self.nonfinite.stop_line)
            return 1
        if (not self.stop_requested.is_set() and self.parts.evals.prompts and self.dist.is_main
                and self.parts.verifier is not None):
            self.final_eval = self.evaluate()
        return code

    def _report_failure(self) -> int:
        name, tb = self.pipeline.failure
        last = tb.strip().splitlines()[-1]
        quiet, d = self.monitoring.quiet_ranks(), self.dist
        if isinstance(self.pipeline.error, DistError):
            last = str(self.pipeline.error)
            self.report.problem(f"{last}{quiet}")
        elif isinstance(self.pipeline.error, CacheError):
            # a bad file in a hidden-states cache: the drafter is fine, so its last step is kept
            last = str(self.pipeline.error)
            path = self.checkpoint(collective=False)
            kept = f"step {self.state.step} saved to {path}" if path else "nothing to save yet"
            self.report.problem(f"{last} ({kept}; fix the file, then dflash train --resume --run-dir "
                                f"{self.cfg.run.run_dir})")
        else:
            self.report.problem(f"{f'rank {d.rank}: ' if d.enabled else ''}worker {name} failed, stopping the "
                                f"pipeline:\n{tb}")
            if d.enabled:
                self.report.problem(f"rank {d.rank}: in a multi-rank run a failed collective usually means "
                                    f"another rank died or hung first: see its log and torchrun's summary{quiet}")
        self.report.event("error", f"worker {name} failed: {last}")
        return 1

    def _exit_on_stall(self) -> int:
        """--on-stall exit: checkpoint the last completed step without any collective (one may be the
        thing that hangs) and end with code 3, so a scheduler restarts the job with --resume."""
        st, m = self.monitoring.stall, self.monitoring
        self.pipeline.stop.set()
        path = self.checkpoint(collective=False)
        where = f"in {st.category}" if st.category else "between spans"
        line = (f"{st.worker} stalled {where} for {st.elapsed:.0f} s (timeout {st.timeout:.0f} s)"
                + (f" at {st.frame}" if st.frame else "") + f"; checkpointed step {self.state.step}"
                + (f" to {path}" if path is not None else "") + "; exiting with code 3 (--on-stall exit), "
                "restart with --resume")
        self.report.problem(line)
        self.report.event("error", line)
        if m.watchdog is not None:
            m.watchdog.join_dumps()  # the native stacks are the point of the exercise
        return 3


def train(cfg: TrainConfig, resume: bool = False) -> int:
    created = _missing_dirs(Path(cfg.run.run_dir))
    try:
        check_installed()
        return Trainer(cfg, resume=resume).run()
    except (TrainError, ConfigError, DistError) as e:
        print(f"dflash train: error: {e}", file=sys.stderr)
        _remove_if_empty(created)
        return 2


def _missing_dirs(path: Path) -> list[Path]:
    """`path` and those of its parents that do not exist yet, deepest first: what a run would create."""
    missing = []
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing.append(p)
    return missing


def _remove_if_empty(dirs: list[Path]) -> None:
    """A start that failed leaves no empty run directory behind; only directories this run created and
    that are still empty go (rmdir refuses anything else, e.g. what another rank already wrote)."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return
