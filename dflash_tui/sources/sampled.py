"""The sampled source: any Python process on this machine (`dflash-top --pid PID`), watched from outside.

No socket and no change to the process: a thread runs `py-spy record` over one window at a time (every
thread, waiting ones too, and beside it the GIL holder), reads the process's per-thread CPU and its GPUs
(psutil, NVML: the trainer's own sampler), and hands the frames a trainer would have sent
(dflash_tui.sampling.session) to the app, so every panel, `--once` and the recording work unchanged.
py-spy reads the process's memory without stopping it; with `native` it stops it at every sample to
unwind C/CUDA frames (a host sync is only visible so), and the header says which.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from dflash.telemetry.wire.protocol import Bye, Frame, Reply, encode
from dflash.telemetry.wire.system import SystemSampler
from dflash_tui.pyspy import classify, find_pyspy, kill_pyspy, record_args, start_pyspy, wait_pyspy
from dflash_tui.sampling.processes import describe
from dflash_tui.sampling.samples import SamplesError, Window, read_window
from dflash_tui.sampling.session import SampledSession
from dflash_tui.sources.base import Connection, RequestFailed, SourceUpdate

if TYPE_CHECKING:  # the interface's types, named in annotations only
    from dflash_tui.sources.base import LiveLink, Playback, Sink, Watched

#: samples per second per thread: 100 is py-spy's default and costs it a few percent of a core
RATE_HZ = 100
#: seconds per window (a snapshot each; py-spy's --duration counts whole seconds)
WINDOW_S = 2.0
#: how long past its window a py-spy record may take before it is killed
GRACE_S = 20.0


class SampledSource:
    """Samples process `pid` window by window until stopped, `duration` seconds have passed, or it exits.

    `record_to`: also write every frame there (a recording `dflash-top FILE` replays)."""

    playback: Playback | None = None
    live: LiveLink | None = None

    def __init__(self, pid: int, *, rate_hz: int = RATE_HZ, window_s: float = WINDOW_S, native: bool = False,
                 duration: float | None = None, record_to: Path | str | None = None, exe: str | None = None) -> None:
        self.pid = pid
        self.path = Path(f"/proc/{pid}")
        self.rate_hz, self.window_s, self.native, self.duration = rate_hz, window_s, native, duration
        self.record_to = Path(record_to) if record_to is not None else None
        self.exe = exe if exe is not None else find_pyspy()
        self.connected = False
        self.windows = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._procs: list[Any] = []
        self._lock = threading.Lock()

    @property
    def watched(self) -> Watched:
        return self

    # -- lifecycle

    def start(self, sink: Sink) -> None:
        self._thread = threading.Thread(target=self._run, args=(sink,), name="dflash-top-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:  # the sampling thread, waiting on them, reaps them and sees the stop
            for p in self._procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def request(self, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Reply:
        raise RequestFailed(f"pid {self.pid} is sampled from outside: there is no trainer to ask")

    # -- the sampling thread

    def _run(self, sink: Sink) -> None:
        out: IO[bytes] | None = None
        try:
            if self.record_to is not None:
                self.record_to.parent.mkdir(parents=True, exist_ok=True)
                out = self.record_to.open("ab")
        except OSError as e:
            sink(SourceUpdate(state=Connection.ENDED, detail=f"cannot write the recording {self.record_to}: {e}"))
            return

        def send(update: SourceUpdate) -> None:
            if out is not None and update.frames:
                out.write(b"".join(encode(f) for f in update.frames))
                out.flush()
            sink(update)

        try:
            why = self._sample(send)
        except Exception as e:  # noqa: BLE001 - a bug here must end the source with its reason, not vanish
            why = f"sampling pid {self.pid} failed: {e!r}"
        finally:
            self.connected = False
        try:
            send(SourceUpdate(frames=[Bye(t=time.time(), reason=why)] if self.windows else [],
                              state=Connection.ENDED, detail=why))
        finally:
            if out is not None:
                out.close()

    def _sample(self, send: Sink) -> str:
        """Sample until done; returns why sampling ended."""
        proc = describe(self.pid)
        if proc is None:
            return f"no process {self.pid} on this machine (or not ours to see)"
        if self.exe is None:
            return "py-spy is not installed: pip install py-spy (it ships with dflash-trainer's test extra)"
        try:
            system = SystemSampler(self.pid)
        except Exception as e:  # noqa: BLE001 - psutil's NoSuchProcess, AccessDenied: the process is gone or not ours
            return f"cannot read pid {self.pid}: {e}"
        session = SampledSession(self.pid, command=proc.command, started=proc.started, rate_hz=self.rate_hz,
                                 window_s=self.window_s, native=self.native, system=system)
        mode = "--native (stops the process at each sample)" if self.native else "--nonblocking"
        send(SourceUpdate(frames=[session.hello()], state=Connection.SAMPLING,
                          detail=f"sampling pid {self.pid} ({proc.command}) with py-spy {mode} at {self.rate_hz} Hz"))
        workers: list[str] = []
        end = None if self.duration is None else time.monotonic() + self.duration
        try:
            while not self._stop.is_set():
                left = None if end is None else end - time.monotonic()
                if left is not None and left < 0.5:
                    break
                seconds = self.window_s if left is None else max(1.0, min(self.window_s, round(left)))
                used = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.monotonic()
                window = self._window(seconds)
                if self._stop.is_set():
                    break
                if isinstance(window, str):
                    return window
                cost = _child_cpu_since(used) / max(1e-6, time.monotonic() - t0) * 100
                snap = session.add(window, sampler_cpu=cost)
                self.windows += 1
                self.connected = True
                frames: list[Frame] = []
                if session.workers != workers:  # a new worker: its name in the hello's thread map
                    workers = session.workers
                    frames.append(session.hello())
                send(SourceUpdate(frames=[*frames, snap]))
            if self.windows:
                send(SourceUpdate(frames=[session.closing()]))
        finally:
            system.close()
        return (f"sampled pid {self.pid} for {self.windows} windows ({session.samples:,} samples per thread)"
                if self.windows else f"stopped before the first window of pid {self.pid}")

    def _window(self, seconds: float) -> Window | str:
        """One window's samples (all threads, and the GIL holder), or why there are none."""
        with tempfile.TemporaryDirectory(prefix="dflash-top-sample-") as d:
            every, held = Path(d) / "threads.json", Path(d) / "gil.json"
            with self._lock:
                if self._stop.is_set():
                    return "stopped"
                self._procs = [start_pyspy(self.exe, record_args(self.pid, seconds, every, rate=self.rate_hz,
                                                                 idle=True, native=self.native)),
                               start_pyspy(self.exe, record_args(self.pid, seconds, held, rate=self.rate_hz, gil=True))]
            try:
                results = [wait_pyspy(p, seconds + GRACE_S) for p in self._procs]
            except TimeoutError as e:
                for p in self._procs:
                    kill_pyspy(p)
                return f"py-spy did not finish a {seconds:g} s window: {e}"
            finally:
                with self._lock:
                    self._procs = []
            (rc, _, err), (gil_rc, _, _) = results
            if rc != 0 or not every.exists():
                if describe(self.pid) is None:
                    return f"pid {self.pid} exited"
                failure = classify(err, self.pid, "py-spy record")
                return failure.reason + ("; " + failure.fix[0] if failure.fix else "")
            try:
                return read_window(every, held if gil_rc == 0 and held.exists() else None, rate_hz=self.rate_hz,
                                   native=self.native)
            except SamplesError as e:
                return f"py-spy's samples could not be read: {e}"


def _child_cpu_since(before: resource.struct_rusage) -> float:
    """CPU seconds this process's children (the py-spy records) used since `before`."""
    now = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (now.ru_utime - before.ru_utime) + (now.ru_stime - before.ru_stime)

