"""`dflash train`: set up data, target(s), drafter and telemetry; run the pipeline; log; checkpoint.

The main thread never does training work: it watches the workers, prints one compact line per log
interval followed by the telemetry table and the bottleneck verdict, and turns
SIGINT/SIGTERM into "finish this step, checkpoint, say bye, exit 0".
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dflash.train import distributed, rng
from dflash.train.build import TrainError, build, restore
from dflash.train.checkpoint import (
    CheckpointError,
    clean_partial,
    list_checkpoints,
    load_latest,
    save_checkpoint,
)
from dflash.train.config import ConfigError, TrainConfig
from dflash.train.control import Interval, StepControl
from dflash.train.distributed import Dist, DistError
from dflash.train.faults import FaultPlan, FaultSpecError
from dflash.train.metrics import StepMetrics, Totals
from dflash.train.pipeline import Pipeline, TrainCounters
from dflash.train.progress import EvalProgress, Progress
from dflash.train.stages import BatchSource, DrafterStage, StepResult, TargetStage
from dflash.train.trackers import TrackerError, Trackers, check_available, eval_scalars, interval_scalars
from dflash.words import plural


class Trainer:
    def __init__(self, cfg: TrainConfig, resume: bool = False, log: Callable[[str], None] | None = None):
        self.cfg, self.resume = cfg, resume
        self._print = log or (lambda s: print(s, flush=True))
        self.dist = Dist()
        self.run_dir = Path(cfg.run_dir)
        self.state = TrainCounters()
        self.server = None
        self.trackers: Trackers | None = None
        self.exporter = None
        self.exchange = None
        self.control: StepControl | None = None  # the per-step decisions, made once the run starts
        self._ckpt_step = -1
        self.checkpoint_failed = False  # the last checkpoint write failed (disk full, ...)
        self._signals = 0
        self._logged_step = -1
        # health: the watchdog's stall when --on-stall exit is to end the run (set on the publisher
        # thread), the line a non-finite stop ends with, and when the guard was last read
        self.watchdog = None
        self.stall_exit = None
        self.nonfinite_stop: str | None = None
        self._guard_read = time.monotonic()
        self.metrics = StepMetrics()  # the drafter thread's device-side metric sums
        self._log_totals = Totals()  # harvested since the last log line
        self.stop_requested = threading.Event()  # a signal asked for "checkpoint and exit"
        # the components setup() builds and run() drives
        self.target: Any = None  # the first target replica (its tokenizer reads the data and eval prompts)
        self.targets: list[TargetStage] = []
        self.drafter: DrafterStage | None = None
        self.drafter_device: torch.device | None = None
        self.dcfg: Any = None  # the drafter's DrafterConfig, saved in every checkpoint
        self.source: BatchSource | None = None
        self.generator: torch.Generator | None = None  # this rank's anchor sampling
        self.stats: Any = None  # the ProfileStats every worker reports to
        self.pipeline: Pipeline | None = None
        self._step_at_start, self._clock_at_start = 0, 0.0  # where this process began, for the rate/ETA

    def log(self, line: str) -> None:
        """Rank 0 speaks for the job; the other ranks would only repeat it (their telemetry is their own)."""
        if self.dist.is_main:
            self._print(line)

    def say(self, line: str) -> None:
        """Every rank, marked with its rank in multi-rank runs."""
        self._print(f"[rank {self.dist.rank}] {line}" if self.dist.enabled else line)

    # --- setup ----------------------------------------------------------------------------------------

    def setup(self) -> None:
        """Join the ranks, tidy the run directory, find the checkpoint to resume, build the run's parts
        and restore them; save the resolved config."""
        cfg = self.cfg
        self._join_ranks()
        d = self.dist
        try:
            faults = FaultPlan.from_env(d.rank)
        except FaultSpecError as e:
            raise TrainError(str(e)) from None
        if faults is not None:
            self.say(f"fault injection (DFLASH_FAULT): {faults.describe()}")
        ckpt = self._checkpoint_to_resume()
        parts = build(cfg, d, ckpt, faults, log=self.log)
        self.target, self.targets, self.drafter, self.dcfg = parts.target, parts.targets, parts.drafter, parts.dcfg
        self.source, self.stats, self.generator = parts.source, parts.stats, parts.generator
        self.drafter_device = parts.drafter_device
        if ckpt is not None:
            self.state = restore(ckpt, parts, d, self.log)
            self._ckpt_step = self.state.step
        if d.is_main:
            cfg.save(self.run_dir / "config.json")
        self.log("config: " + " ".join(f"{k}={v}" for k, v in cfg.to_dict().items()))
        self.log(parts.describe(cfg))
        if d.enabled:
            self.log(f"distributed: {d.world_size} ranks ({'nccl' if self.drafter_device.type == 'cuda' else 'gloo'}), "
                     f"each with {len(self.targets)} target worker(s) and one drafter in DDP; "
                     f"{self.source.batch_size} samples per rank per step; collective timeout "
                     f"{cfg.collective_timeout:.0f}s")

    def _checkpoint_to_resume(self) -> dict | None:
        """Rank 0 removes a partial checkpoint; a used run directory needs --resume, which loads the
        newest checkpoint that reads back whole."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main and clean_partial(self.run_dir):
            self.log("removed a partial checkpoint left by an interrupted write")
        distributed.barrier(self.dist, "waiting for rank 0 to tidy the run directory")
        existing = list_checkpoints(self.run_dir)
        if existing and not self.resume:
            raise TrainError(f"{self.run_dir} already holds checkpoints (newest {existing[-1].name}); "
                             "pass --resume to continue that run, or choose another --run-dir")
        if not self.resume:
            return None
        try:
            found = load_latest(self.run_dir, note=lambda s: self.log(f"--resume: {s}"))
        except CheckpointError as e:
            raise TrainError(f"--resume: {e}; move them away to start afresh") from None
        if found is None:
            self.log(f"--resume: no checkpoint in {self.run_dir}/checkpoints, starting fresh")
            return None
        self.log(f"--resume: using {found[0].name}")
        return found[1]

    def _join_ranks(self) -> None:
        """Under torchrun: find this rank, map bare `cuda` to its GPU, join the process groups."""
        cfg = self.cfg
        try:
            self.dist = d = distributed.from_env()
            if not d.enabled:
                return
            cfg.target_devices = [distributed.localize(x, d) for x in cfg.target_devices]
            cfg.drafter_device = distributed.localize(cfg.drafter_device, d)
            distributed.init(d, torch.device(cfg.drafter_device).type == "cuda", cfg.collective_timeout)
        except DistError as e:
            raise TrainError(str(e)) from None

    # --- the drafter thread's per-step hook -----------------------------------------------------------

    def on_step(self, r: StepResult) -> bool:
        """Runs in the drafter thread after each optimizer step; False ends the run."""
        st = self.state
        st.step += 1
        st.next_batch += 1
        st.tokens += r.tokens
        st.samples += r.samples
        st.last = r
        s = self.stats
        s.count("steps", 1)
        s.count("tokens", r.tokens)
        s.count("samples", r.samples)
        s.count("supervised_tokens", r.out.num_tokens)
        s.gauge("lr", r.lr)
        s.gauge("step", st.step)
        # Loss, accuracy, taus and the gradient norm stay on the device; the main thread reads them
        # once per interval (_harvest): reading them here would stall this thread on the GPU.
        self.metrics.add(r.out.stats, r.grad_norm, r.out.per_position_count, r.out.num_blocks)
        too_many_bad = self._check_guard(time.monotonic())
        d = self.control.after_step(st.step, too_many_bad or self.stop_requested.is_set(), self.pipeline.train_time())
        if d.checkpoint:
            self.checkpoint(final=d.stop)
        if d.evaluate:
            self.evaluate(in_training=True)
        return not d.stop

    def _check_guard(self, now: float) -> bool:
        """Report skipped non-finite steps; True when too many came in a row. The guard's counters live
        on the device on CUDA, so they are read once per log interval there (after every step on the
        CPU, where a read costs nothing)."""
        g = self.drafter.guard
        if not g.reads_free and now - self._guard_read < self.cfg.log_every:
            return False
        self._guard_read = now
        r = g.read()
        if r.new:
            self.stats.gauge("nonfinite_skipped", r.skipped)
            more = f" ({r.new} since the last report)" if r.new > 1 else ""
            self._event("nonfinite", f"non-finite loss or gradient norm at step {r.last_step} (batch "
                        f"{r.last_batch}): optimizer step skipped{more}, {r.skipped} skipped in all",
                        step=r.last_step, batch=r.last_batch, skipped=r.skipped, in_a_row=r.in_a_row)
        if r.in_a_row >= g.limit and self.nonfinite_stop is None:
            first = r.last_batch - r.in_a_row + 1
            self.nonfinite_stop = (f"{r.in_a_row} non-finite steps in a row (steps {first + 1}-{r.last_step}, "
                                   f"batches {first}-{r.last_batch}), limit {g.limit}: stopping; the checkpoint "
                                   f"holds the last good state (step {first})")
            return True
        return False

    def _harvest(self) -> None:
        """Main thread, once per telemetry interval: read the device-side metric sums (the one wait on
        the GPU the training loop allows), publish them as gauges and metrics, and keep them for the
        next log line."""
        totals = self.metrics.collect()
        if totals is not None:
            self._log_totals = self._log_totals + totals
            t, s = totals.summary(), self.stats
            s.gauge("loss", t["loss"])
            s.gauge("grad_norm", t["grad_norm"])
            for name in ("accuracy", "sim_tau", "block_tau", "per_position_acc"):
                s.metric(name, t[name])
        self._allocator_gauges()

    def _allocator_gauges(self) -> None:
        """The caching allocator's counters, read here on the main thread rather than per step by a worker."""
        devs = {self.drafter_device, *(t.device for t in self.targets)}
        for d in devs:
            if d.type != "cuda":
                continue
            m = torch.cuda.memory_stats(d)
            i = d.index if d.index is not None else torch.cuda.current_device()
            self.stats.gauge(f"cuda{i}_allocated_bytes", m.get("allocated_bytes.all.current", 0))
            self.stats.gauge(f"cuda{i}_reserved_bytes", m.get("reserved_bytes.all.current", 0))
            self.stats.gauge(f"cuda{i}_alloc_retries", m.get("num_alloc_retries", 0))

    # --- checkpoints and evaluation -------------------------------------------------------------------

    def checkpoint(self, final: bool = False, collective: bool = True) -> Path | None:
        """Save (rank 0) after an agreed decision. A failed write is one warning and training goes on
        (see README "Checkpoints"); ``checkpoint_failed`` tells the end of the run. `collective=False`
        (a stall exit, when a collective may be hung): rank 0 saves its own replica without asking
        the others; the other ranks save nothing."""
        if self.state.step == self._ckpt_step:
            return None
        if self.dist.enabled and not collective and not self.dist.is_main:
            return None
        from dataclasses import asdict

        with self.drafter.tel.span("checkpoint"):
            st = self.state
            rng_state = rng.capture(self.generator)
            rng_per_rank = None
            if self.dist.enabled and collective:
                # All ranks are here at the same step (the decision was agreed): collect every rank's
                # anchor RNG for an exact resume, and prove the replicas are still identical.
                rng_per_rank = distributed.gather(self.dist, rng_state)
                digests = distributed.gather(self.dist, distributed.param_digest(self.drafter.drafter))
                if len(set(digests)) != 1:
                    raise DistError(f"drafter replicas diverged at step {st.step}: parameter digests {digests}")
                self.log(f"replicas in sync at step {st.step}: parameter digest {digests[0]} on all "
                         f"{len(digests)} ranks")
                if not self.dist.is_main:
                    self._ckpt_step = st.step
                    self.control.checkpoints.restart()
                    return None
            state = {
                "format": "dflash-train-checkpoint/1",
                "drafter_config": asdict(self.dcfg),
                "drafter": self.drafter.drafter.state_dict(),
                "optimizer": self.drafter.optimizer.state_dict(),
                "rng": rng_state,
                "rng_per_rank": rng_per_rank,
                "state": {"step": st.step, "next_batch": st.next_batch, "tokens": st.tokens,
                          "samples": st.samples, "train_time": self.pipeline.clock()},
                "config": self.cfg.to_dict(),
            }
            try:
                path = save_checkpoint(self.run_dir, st.step, state, self.cfg.keep_checkpoints, note=self.log)
            except CheckpointError as e:
                # Training goes on (the next interval tries again); what is on disk is intact. This step
                # counts as done: a second try at the end of the run would gather alone, without the
                # other ranks.
                self._ckpt_step = st.step
                self.control.checkpoints.restart()
                newest = list_checkpoints(self.run_dir)
                self.checkpoint_failed = True
                then = "" if final else f"; training continues, next try in {self.cfg.checkpoint_every:g}s"
                self._event("warning", f"checkpoint {e}; newest good checkpoint: "
                            f"{newest[-1].name if newest else 'none'}{then}", step=st.step)
                return None
        self.checkpoint_failed = False
        self._ckpt_step = st.step
        self.control.checkpoints.restart()
        self._event("checkpoint", f"saved {path.name}", step=st.step, path=str(path))
        return path

    def evaluate(self, in_training: bool = False) -> dict | None:
        """Real speculative decoding on a few held prompts: the tau that matters (simulated tau is optimistic).
        The one after training is a phase of its own (minutes on a CPU): announced, and its progress is
        logged and published per prompt, so neither the log nor dflash-top goes quiet."""
        from dflash.data import load_prompts
        from dflash.eval.speculative import evaluate

        tok = self.target.tokenizer
        prompts = load_prompts(self.cfg.data, tok, limit=self.cfg.eval_prompts)
        t0 = time.monotonic()
        what = "evaluation" if in_training else "final evaluation"
        self._event("phase", f"{what}: {plural(len(prompts), 'prompt')} x {self.cfg.eval_max_new_tokens} "
                             "new tokens, speculative decoding against the target's own greedy output")

        def on_prompt(done: int, total: int) -> None:
            p = EvalProgress(done, total, time.monotonic() - t0)
            for name, value in p.gauges().items():
                self.stats.gauge(name, value)
            self.log(f"[{what}] {p.text()}")

        on_prompt(0, len(prompts))
        with self.drafter.tel.span("eval"):  # evaluate() restores the drafter's train/eval mode itself
            result = evaluate(self.drafter.drafter, self.target, prompts,
                              max_new_tokens=self.cfg.eval_max_new_tokens, on_prompt=on_prompt)
        self.control.evaluations.restart()
        summary = result.to_dict()
        summary["step"] = self.state.step
        with (self.run_dir / "evals.jsonl").open("a") as f:  # tau over training, for plots and the README
            f.write(json.dumps(summary) + "\n")
        self.stats.metric("eval_tau", summary["tau"])
        if self.trackers is not None:
            self.trackers.log(self.state.step, eval_scalars(summary))
        self._event("eval", f"step {self.state.step}: tau {summary['tau']:.2f} over {summary['rounds']} rounds"
                    f"{'' if summary.get('lossless', True) else ' (NOT LOSSLESS)'}",
                    step=self.state.step, tau=summary["tau"], lossless=summary.get("lossless"))
        return summary

    def _event(self, kind: str, message: str, **data: Any) -> None:
        self.log(f"[{kind}] {message}")
        if self.server is not None:
            self.server.publish_event(kind, message, **data)

    # --- logging --------------------------------------------------------------------------------------

    def _progress(self) -> Progress:
        cfg = self.cfg
        elapsed = self.pipeline.clock()
        ran = elapsed - self._clock_at_start
        rate = (self.state.step - self._step_at_start) / ran if ran > 0 else None
        return Progress(self.state.step, elapsed, cfg.max_steps, cfg.max_time, rate)

    def _publish_progress(self) -> None:
        for name, value in self._progress().gauges().items():
            self.stats.gauge(name, value)

    def _log_line(self, dt: float, tokens_before: int) -> None:
        st = self.state
        r = st.last
        tps = (st.tokens - tokens_before) / dt if dt > 0 else 0.0
        if r is None or st.step == self._logged_step:
            return  # nothing new to say; a line per interval without progress would only be noise
        self._logged_step = st.step
        self._harvest()
        m, self._log_totals = self._log_totals.summary(), Totals()  # means over the steps since the last line
        batch_q, hs_q = self.pipeline.depths()
        q = f"q batch {batch_q}/{self.cfg.batch_queue_size} hs {hs_q}/{self.cfg.hs_queue_size}"
        self.log(f"{self._progress().text()} | loss {m['loss']:.3f} | acc {m['accuracy']:.3f} | sim_tau {m['sim_tau']:.2f} "
                 f"| {tps:,.0f} tok/s | lr {r.lr:.2e} | gnorm {m['grad_norm']:.2f} | {q}")
        summary = self.server.latest() if self.server is not None else None
        b = None
        if summary is not None:
            from dflash.telemetry import format_profile_stats
            from dflash.telemetry.analysis import analyze

            # Cumulative: a 1 s window is too noisy for a line printed every few seconds.
            self.log(format_profile_stats(summary, limit=12, cumulative=True))
            # the verdict dflash-top shows (per window, with hysteresis), so the two never disagree
            b = self.server.verdict.current or analyze(summary.cumulative)
            self.log(f"bottleneck: {b.verdict}" + (f" - {b.reason}" if b.reason else ""))
        if self.trackers is not None:
            self.trackers.log(st.step, interval_scalars(
                loss=m["loss"], accuracy=m["accuracy"], sim_tau=m["sim_tau"], per_position=m["per_position_acc"],
                tokens_per_s=tps, lr=r.lr, grad_norm=m["grad_norm"], verdict=b.verdict if b else None,
                workers=summary.cumulative if summary is not None else None))

    # --- run ------------------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            check_available(self.cfg.report_to)  # before minutes of loading, not after
        except TrackerError as e:
            raise TrainError(str(e)) from None
        self.setup()
        if self.cfg.report_to and self.dist.is_main:
            try:
                self.trackers = Trackers(self.cfg.report_to, self.run_dir, self.cfg.name, self.cfg.to_dict())
            except TrackerError as e:
                raise TrainError(str(e)) from None
            self.log(f"trackers:  {', '.join(self.cfg.report_to)}")
        cfg = self.cfg
        agreement = distributed.Agreement(self.dist) if self.dist.enabled else None
        self.control = StepControl(cfg.max_steps, cfg.max_time, cfg.checkpoint_every, cfg.eval_every,
                                   is_main=self.dist.is_main, agreement=agreement, trained=self.state.train_time)
        # a multi-rank run's schedule follows the clock its ranks agreed on, not this process's own
        self.pipeline = Pipeline(self.source, self.targets, self.drafter, cfg, self.stats, self.state, self.on_step,
                                 clock=self.control.agreed_clock if agreement is not None else None)
        old = self._install_signals()
        code = 0
        try:
            # Threads first, so that the hello frame's thread map names every worker.
            self.pipeline.start()
            if cfg.telemetry:
                self._start_telemetry()
            else:
                self.log("telemetry: off (--no-telemetry)")
            code = self._supervise()
        finally:
            # after a stall exit the stuck worker will not stop: do not wait long for it
            self.pipeline.shutdown(timeout=1.0 if self.stall_exit is not None else 10.0)
            self._restore_signals(old)
            if self.exchange is not None:
                self.exchange.close("failed" if code else "finished")
            if self.server is not None:
                self.server.close(reason="error" if code else "finished")  # its last publish reaches the exporter
            if self.exporter is not None:
                self._linger_for_scrape()
                self.exporter.close()
            if self.trackers is not None:
                self.trackers.close()
        self.log(f"done: {self.state.step} steps, {self.state.tokens:,} tokens, run dir {self.run_dir}")
        if self.stall_exit is not None and self.dist.enabled:
            sys.stdout.flush()
            os._exit(code)  # a collective is hung: tearing down the process group would hang with it
        distributed.shutdown(self.dist)
        return code

    def _start_telemetry(self) -> None:
        """The socket publisher (with the recorder and the health monitors), the Prometheus exporter and,
        in a multi-rank run, the cluster exchange; started after the workers, so that the hello frame's
        thread map names every worker."""
        from dflash.telemetry import TelemetryServer

        cfg, d = self.cfg, self.dist
        if cfg.metrics_port is not None:
            from dflash.telemetry.prometheus import MetricsExporter, MetricsServerError

            self.exporter = MetricsExporter(cfg.name, rank=d.rank)
            # One port per rank on a node: the given one plus the local rank (0 stays "any").
            want = cfg.metrics_port + d.local_rank if cfg.metrics_port else 0
            try:
                port = self.exporter.serve(want, addr=cfg.metrics_addr)
            except MetricsServerError as e:
                raise TrainError(str(e)) from None
            self.say(f"metrics:   http://{cfg.metrics_addr}:{port}/metrics")
        if d.enabled:
            from dflash.telemetry.cluster import ClusterExchange

            self.exchange = ClusterExchange(
                d.store, d.rank, d.world_size, lambda: self.server.latest() if self.server else None,
                interval_s=cfg.telemetry_interval)
        server = TelemetryServer(run=cfg.name, stats=self.stats, interval_s=cfg.telemetry_interval,
                                 run_dir=self.run_dir.resolve(), socket_dir=cfg.socket_dir,
                                 rank=d.rank, world_size=d.world_size,
                                 on_publish=self.exporter.update if self.exporter else None,
                                 cluster_view=self.exchange.view if self.exchange and d.is_main else None,
                                 monitors=self._monitors())
        try:
            server.start()
        except (OSError, RuntimeError) as e:
            raise TrainError(f"telemetry socket in {server.socket_dir}: {e} (use --socket-dir, or "
                             "--no-telemetry)") from None
        self.server = server
        self.say(f"telemetry: {self.server.path}")
        self.log(f"attach:    {top_command()} {shlex.quote(str(self.server.path))}")
        if self.exchange is not None:
            self.exchange.socket_path = str(server.path)
            self.exchange.start()

    def _monitors(self) -> list:
        """The judges the telemetry server runs on each window: the anomaly detector, the GIL probe and
        the stall watchdog (unless --stall-timeout 0)."""
        from dflash.telemetry.anomalies import AnomalyDetector
        from dflash.telemetry.gil import GilProbe
        from dflash.telemetry.watchdog import Watchdog

        cfg = self.cfg
        monitors: list = [AnomalyDetector(emit=self._event)]
        if cfg.gil_probe:
            monitors.append(GilProbe())
        if cfg.stall_timeout == 0:
            return monitors

        def on_stall(st) -> None:  # publisher thread: only hand the stall to the main thread
            self.stall_exit = st

        self.watchdog = Watchdog(self.run_dir.resolve(), cfg.stall_timeout or None, emit=self._event,
                                 on_stall=on_stall if cfg.on_stall == "exit" else None)
        return [*monitors, self.watchdog]

    def _exit_on_stall(self) -> int:
        """--on-stall exit: checkpoint the last completed step without any collective (one may be the
        thing that hangs) and end with code 3, so a scheduler restarts the job with --resume."""
        st = self.stall_exit
        self.pipeline.stop.set()
        path = self.checkpoint(collective=False)
        where = f"in {st.category}" if st.category else "between spans"
        line = (f"{st.worker} stalled {where} for {st.elapsed:.0f} s (timeout {st.timeout:.0f} s)"
                + (f" at {st.frame}" if st.frame else "") + f"; checkpointed step {self.state.step}"
                + (f" to {path}" if path is not None else "") + "; exiting with code 3 (--on-stall exit), "
                "restart with --resume")
        print(f"dflash train: {line}", file=sys.stderr, flush=True)
        self._event("error", line)
        if self.watchdog is not None:
            self.watchdog.join_dumps()  # the native stacks are the point of the exercise
        return 3

    def _supervise(self) -> int:
        """Main-thread loop: log, watch for failures, and finish the run (checkpoint, final eval)."""
        cfg, code = self.cfg, 0
        logs, harvests = Interval(cfg.log_every, time.monotonic), Interval(cfg.telemetry_interval, time.monotonic)
        tokens_at_log = self.state.tokens
        self._step_at_start, self._clock_at_start = self.state.step, self.pipeline.clock()
        while self.pipeline.running:
            time.sleep(0.05)
            if self.stall_exit is not None:
                return self._exit_on_stall()
            if self.pipeline.failure:
                break
            self._publish_progress()
            if cfg.telemetry and harvests.due():
                self._harvest()
                harvests.restart()
            if logs.due():
                self._log_line(time.monotonic() - logs.last, tokens_at_log)
                logs.restart()
                tokens_at_log = self.state.tokens
        stuck = self.pipeline.shutdown()
        if self.pipeline.failure:
            name, tb = self.pipeline.failure
            last = tb.strip().splitlines()[-1]
            quiet = self._quiet_ranks()
            if isinstance(self.pipeline.error, DistError):
                last = str(self.pipeline.error)
                print(f"dflash train: {last}{quiet}", file=sys.stderr, flush=True)
            else:
                where = f"rank {self.dist.rank}: " if self.dist.enabled else ""
                print(f"dflash train: {where}worker {name} failed, stopping the pipeline:\n{tb}", file=sys.stderr,
                      flush=True)
                if self.dist.enabled:
                    print(f"dflash train: rank {self.dist.rank}: in a multi-rank run a failed collective usually "
                          f"means another rank died or hung first: see its log and torchrun's summary{quiet}",
                          file=sys.stderr, flush=True)
            self._event("error", f"worker {name} failed: {last}")
            code = 1
        else:
            if self.server is not None:
                self.server.publish_now()  # a run shorter than one interval still ends with its table
            self._log_line(max(1e-9, time.monotonic() - logs.last), tokens_at_log)
            self.checkpoint(final=True)
            if self.checkpoint_failed:
                print(f"dflash train: the final checkpoint was not saved (see above): --resume continues from "
                      f"the newest one in {self.run_dir}/checkpoints", file=sys.stderr, flush=True)
                code = 1
            if self.nonfinite_stop is not None:
                print(f"dflash train: {self.nonfinite_stop}", file=sys.stderr, flush=True)
                self._event("error", self.nonfinite_stop)
                code = 1
            elif not self.stop_requested.is_set() and cfg.eval_prompts > 0 and self.dist.is_main:
                self.evaluate()
        if stuck:
            self.log(f"warning: workers did not exit in time: {', '.join(stuck)}")
        return code

    def _linger_for_scrape(self) -> None:
        """Keep /metrics up until Prometheus has read the run's last snapshot (with the final
        evaluation's tau), at most --metrics-linger seconds: closing at once lost it every time."""
        wait = self.cfg.metrics_linger
        if self.stop_requested.is_set():
            return  # a signal asked the run to end now, not after the next scrape
        if wait > 0 and self.exporter.port is not None:
            self.say(f"metrics:   serving the final numbers until the next scrape (at most {wait:g} s; "
                     "--metrics-linger 0 skips this)")
            if not self.exporter.wait_for_scrape(wait):
                self.say("metrics:   no scrape came; the final numbers are in telemetry.jsonl and evals.jsonl")

    def _quiet_ranks(self) -> str:
        """Which ranks the cluster view saw go quiet, for a failure message (torchrun can only name the
        first process to exit, which is the one that noticed, not the one that hung)."""
        view = self.exchange.view() if self.exchange is not None else None
        if view is None or not view.stale:
            return ""
        ages = ", ".join(f"rank {r.rank} {r.age_s:.0f}s ago" for r in view.ranks if r.stale)
        return f" [cluster view: stopped reporting: {ages}]"

    def _install_signals(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def handler(signum, frame):
            self._signals += 1
            if self._signals > 1:
                print("dflash train: second signal, exiting without a checkpoint", file=sys.stderr, flush=True)
                os._exit(130)
            self.log(f"received {signal.Signals(signum).name}: finishing the current step, then checkpointing "
                     "(send again to exit at once)")
            self.stop_requested.set()

        return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    def _restore_signals(self, old: dict) -> None:
        for s, h in old.items():
            signal.signal(s, h)


def train(cfg: TrainConfig, resume: bool = False) -> int:
    created = _missing_dirs(Path(cfg.run_dir))
    try:
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


def top_command() -> str:
    """How to start dflash-top so that the printed line works as printed: by name when the shell
    finds this environment's own dflash-top, else by its absolute path (a venv that is not active),
    else through this interpreter."""
    import shutil

    exe = Path(sys.executable).with_name("dflash-top")
    if not exe.is_file():
        return f"{shlex.quote(sys.executable)} -m dflash_tui.app"
    found = shutil.which("dflash-top")
    return "dflash-top" if found and Path(found).resolve() == exe.resolve() else shlex.quote(str(exe))
