"""The trainer: stages wired by bounded queues and threads, supervised by the main thread.

    batch-producer --batch queue--> target-0..N --hidden-state queue--> drafter-0
                                                                           |
    main thread: logs, telemetry, signals, failure detection  <------------+

Bounded queues give back-pressure (a slow drafter stalls the targets rather than filling memory), and
the time each worker spends blocked on them is exactly what tells the bottleneck: drafters waiting on
``hs_queue_wait`` mean the targets are too slow, targets blocked on ``hs_queue_put`` mean the drafter is.

Any exception in a worker sets the shared stop flag; every blocking queue operation polls it, so the
whole pipeline winds down within a fraction of a second and the main thread reports that worker's
traceback. In sync mode (``pipeline = false``) one thread runs target forward and drafter step in turn.

The pipeline knows its stages only by what it calls on them (a batch source ``source(index)``, target
stages ``stage(batch)`` with ``name``/``device``/``tel``, a drafter stage ``step(hidden, progress)`` with
``device``/``tel``), so tests drive it with plain Python stand-ins and no model.
"""

from __future__ import annotations

import ctypes
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dflash.telemetry.wire.vocab import Role
from dflash.train.config import PipelineSettings, RunSettings
from dflash.train.device.binding import bind_thread, cuda_devices, thread_device
from dflash.train.run.stages import BatchSource, DrafterStage, HiddenBatch, StepResult, TargetStage

_POLL = 0.05  # seconds: how often a blocked worker rechecks the stop flag


def _name_os_thread(name: str) -> None:
    """Give the OS thread the worker's name too, so `top -H`, pidstat and gdb show `target-0`
    rather than the process name (Linux keeps 15 bytes)."""
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class Stopped(Exception):
    """Raised inside a worker when the pipeline is stopping; not a failure."""


@dataclass
class TrainCounters:
    """What the drafter worker advances and the main thread reads (single writer, so no lock)."""

    step: int = 0
    next_batch: int = 0  # data position: the next batch index the drafter will consume
    tokens: int = 0
    samples: int = 0
    train_time: float = 0.0  # seconds of training before this process (resume) plus this process's
    flops: float = 0.0  # model FLOPs of this process's steps (not checkpointed: only their rate is read)
    last: StepResult | None = None


def put(q: queue.Queue, item, stop: threading.Event) -> None:
    while True:
        try:
            q.put(item, timeout=_POLL)
            return
        except queue.Full:
            if stop.is_set():
                raise Stopped from None


def get(q: queue.Queue, stop: threading.Event):
    while True:
        try:
            return q.get(timeout=_POLL)
        except queue.Empty:
            if stop.is_set():
                raise Stopped from None


class Pipeline:
    """Runs the stages in worker threads until the drafter says it is done or something fails."""

    def __init__(self, source: BatchSource, targets: list[TargetStage], drafter: DrafterStage,
                 settings: PipelineSettings, limits: RunSettings, stats, state: TrainCounters,
                 on_step: Callable[[StepResult], bool], clock: Callable[[], float] | None = None):
        """`settings`: queues, threads, pipelined or not; `limits`: the run's max_steps and max_time, which
        the progress (the LR schedule's) counts toward. `on_step` is called by the drafter thread after
        each step; returning False ends the run.
        `clock` is what the LR schedule and max_time count: this process's `train_time` by default; a
        multi-rank run passes the clock all ranks agreed on at the last step, so their schedules match."""
        self.source, self.targets, self.drafter, self.stats = source, targets, drafter, stats
        self.settings, self.limits = settings, limits
        self.state, self.on_step = state, on_step
        self.clock: Callable[[], float] = clock or self.train_time
        self._t0 = time.monotonic()  # restarted by start()
        self.stop = threading.Event()
        self.failure: tuple[str, str] | None = None  # (worker name, formatted traceback)
        self.error: BaseException | None = None  # the exception behind `failure`
        self.batch_q: queue.Queue = queue.Queue(maxsize=settings.batch_queue_size)
        self.hs_q: queue.Queue = queue.Queue(maxsize=settings.hs_queue_size)
        self.threads: list[threading.Thread] = []

    # --- workers --------------------------------------------------------------------------------------

    def _thread(self, name: str, body: Callable[[], None], *devices: torch.device,
                compute: bool = True) -> threading.Thread:
        """A worker thread that names itself and binds the CUDA device it works on; a ``compute`` worker
        also gets its own stream on each GPU it launches work on (see devices.py)."""
        def run() -> None:
            _name_os_thread(name)
            bind_thread(thread_device(*devices), cuda_devices(*devices) if compute else ())
            if self.settings.threads_per_worker:
                # Per thread on purpose: OpenMP/MKL thread counts are thread-local, so setting it in the
                # main thread does not reach matmuls issued from this one.
                torch.set_num_threads(self.settings.threads_per_worker)
            try:
                body()
            except Stopped:
                pass
            except BaseException:  # noqa: BLE001 - any death must stop the pipeline, not vanish
                if self.failure is None:
                    self.failure = (name, traceback.format_exc())
                    self.error = sys.exc_info()[1]
                self.stop.set()

        t = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(t)
        return t

    def _producer(self) -> None:
        tel = self.stats.worker("batch-producer", Role.DATA)
        index = self.state.next_batch
        while not self.stop.is_set():
            with tel.span("batch_build"):
                batch = self.source(index)
            with tel.span("batch_queue_put"):
                put(self.batch_q, batch, self.stop)
            self.stats.gauge("batch_queue", self.batch_q.qsize())
            index += 1

    def _target(self, stage: TargetStage) -> None:
        tel = stage.tel
        while not self.stop.is_set():
            # spans, not measured-then-added: a worker blocked on a queue then shows as waiting, live
            with tel.span("batch_queue_wait"):
                batch = get(self.batch_q, self.stop)
            hb = stage(batch)
            with tel.span("hs_queue_put"):
                put(self.hs_q, hb, self.stop)
            self.stats.gauge("hs_queue", self.hs_q.qsize())

    def _drafter(self) -> None:
        tel = self.drafter.tel
        pending: dict[int, HiddenBatch] = {}  # batches that overtook an earlier one (several targets)
        while not self.stop.is_set():
            # Consume in batch order whatever the targets' finishing order, so a run is reproducible.
            with tel.span("hs_queue_wait"):
                while self.state.next_batch not in pending:
                    hb = get(self.hs_q, self.stop)
                    pending[hb.batch.index] = hb
            hb = pending.pop(self.state.next_batch)
            if not self.on_step(self.drafter.step(hb, self.progress())):
                self.stop.set()

    def progress(self) -> float:
        """Fraction of the run done, by steps or by time, whichever is further along."""
        p = 0.0
        if self.limits.max_steps:
            p = self.state.step / self.limits.max_steps
        if self.limits.max_time:
            p = max(p, self.clock() / self.limits.max_time)
        return min(1.0, p)

    def depths(self) -> tuple[int, int]:
        """Items waiting in the batch queue and in the hidden-state queue (approximate, for the log line)."""
        return self.batch_q.qsize(), self.hs_q.qsize()

    def train_time(self) -> float:
        """Seconds trained so far, this process and the ones it resumed from."""
        return self.state.train_time + time.monotonic() - self._t0

    def _sync(self) -> None:
        """Sync mode: target forward then drafter step, in one thread, as public trainers do."""
        stage = self.targets[0]
        tel = self.drafter.tel
        while not self.stop.is_set():
            with tel.span("batch_build"):
                batch = self.source(self.state.next_batch)
            hb = stage(batch)
            if not self.on_step(self.drafter.step(hb, self.progress())):
                self.stop.set()

    # --- lifecycle ------------------------------------------------------------------------------------

    def start(self) -> None:
        self._t0 = time.monotonic()
        drafter = self.drafter.device
        targets = [stage.device for stage in self.targets]
        if self.settings.enabled:
            # The producer pins batches, which needs the CUDA context of the GPU they will go to.
            self._thread("batch-producer", self._producer, *targets, drafter, compute=False)
            for stage in self.targets:
                self._thread(stage.name, lambda s=stage: self._target(s), stage.device, drafter)
            self._thread("drafter-0", self._drafter, drafter)
        else:
            self._thread("trainer", self._sync, drafter, *targets)
        for t in self.threads:
            t.start()

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def shutdown(self, timeout: float = 10.0) -> list[str]:
        """Stop every worker; returns the names of any that did not exit in time."""
        self.stop.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]
