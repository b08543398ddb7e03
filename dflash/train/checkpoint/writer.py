"""Saving without stalling the step: a host snapshot taken on the drafter thread, written in the background.

A 1B drafter's checkpoint (fp32 parameters and Adam state, ~12.6 GB) takes tens of seconds to
serialise, hash and fsync. Done on the drafter thread, every step waits that long. Instead:

* ``HostSnapshot.take`` copies every tensor of the checkpoint into host buffers on the calling thread.
  On CUDA the copies are non-blocking into pinned memory, queued on the thread's current stream
  behind the step that produced the values and ahead of the next optimizer step that changes them,
  so the snapshot is exact without a host sync; an event marks when they are done. The buffers are
  kept for the next save (pinning ~13 GB afresh each time would cost seconds).
* ``CheckpointWriter`` writes the snapshot on its own thread with everything ``checkpoint.py``
  guarantees (temporary file, sha256 manifest, fsync, atomic rename). It holds one save at a time:
  a new save first waits for the previous one, whose buffers it is about to reuse.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.checkpoint_files import CheckpointError
from dflash.train.device.binding import bind_thread

#: the writer thread's name, as the telemetry thread map and py-spy show it
WRITER_THREAD = "checkpoint-writer"


class HostSnapshot:
    """Host copies of a nested checkpoint state, in buffers reused from one save to the next."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._spare: dict[tuple[tuple[int, ...], torch.dtype, bool], list[torch.Tensor]] = {}
        self.nbytes = 0  # bytes of tensors in the last snapshot

    def reserve(self, like: Iterable[torch.Tensor]) -> None:
        """Allocate buffers shaped like `like` ahead of the first save, on another thread: pinning (or,
        on the host, first touching) a 1B drafter's 12.6 GB takes seconds the first save's step would
        otherwise wait. `take` uses them for tensors of the same shape and dtype and drops the rest."""
        for t in like:
            pin = t.is_cuda
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            if not pin:
                buf.zero_()  # the pages' first touch is the cost; pinned memory is touched when pinned
            self._spare.setdefault((tuple(t.shape), t.dtype, pin), []).append(buf)

    def take(self, state: Any) -> tuple[Any, torch.cuda.Event | None]:
        """``state`` with every tensor replaced by a host copy, and the CUDA event after which the
        copies are complete (None when no tensor was on a GPU: the copies are done on return)."""
        self.nbytes = 0
        devices: set[torch.device] = set()
        host = self._copy(state, "", devices)
        self._spare.clear()  # reserved buffers the state had no tensor for
        if not devices:
            return host, None
        (device, *more) = devices
        if more:  # the drafter and its optimizer live on one device; anything else is a bug here
            raise ValueError(f"a checkpoint's tensors are on several devices: {sorted(map(str, devices))}")
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(device))
        return host, ready

    def _copy(self, obj: Any, path: str, devices: set[torch.device]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, path, devices)
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{path}/{k}", devices) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self._copy(v, f"{path}/{i}", devices) for i, v in enumerate(obj))
        return obj

    def _tensor(self, t: torch.Tensor, path: str, devices: set[torch.device]) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            spare = self._spare.get((tuple(t.shape), t.dtype, t.is_cuda))
            buf = spare.pop() if spare else torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[path] = buf
        if t.is_cuda:
            devices.add(t.device)
        buf.copy_(t, non_blocking=t.is_cuda)
        self.nbytes += buf.numel() * buf.element_size()
        return buf


@dataclass
class Written:
    """How one background save ended: the path, or the error that stopped it."""

    step: int
    path: Path | None
    error: CheckpointError | None
    nbytes: int
    seconds: float  # from the hand-over to the rename (waiting for the copies included)
    finished: float  # time.perf_counter() at the end


class CheckpointWriter:
    """One background thread that writes checkpoints, one at a time, in the order they were handed over.

    ``write(step, state)`` does the actual work (checkpoint.save_checkpoint with the run's settings);
    ``on_done(Written)`` runs on the writer thread once it is over, success or not. ``device``: the
    CUDA device the thread binds before touching an event (the trainer's; None on the host, where the
    thread must not initialise CUDA at all)."""

    def __init__(self, write: Callable[[int, Any], Path], on_done: Callable[[Written], None],
                 device: torch.device | None):
        self.write, self.on_done, self.device = write, on_done, device
        self._jobs: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self.last: Written | None = None

    def submit(self, step: int, state: Any, ready: torch.cuda.Event | None, nbytes: int) -> None:
        """Hand a snapshot over and return at once (after waiting for the previous save, if any)."""
        t0 = time.perf_counter()
        self._start(lambda: self._save(step, state, ready, nbytes, t0))

    def prepare(self, work: Callable[[], None]) -> None:
        """Run `work` on the writer thread before the next save (which waits for it): what the drafter
        thread should not wait for. A failure is dropped: the save then does the work itself, and fails
        there in its own words if it must."""

        def quietly() -> None:
            try:
                work()
            except Exception:
                pass

        self._start(quietly)

    def _start(self, job: Callable[[], None]) -> None:
        self.wait()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=WRITER_THREAD, daemon=True)
            self._thread.start()
        self._idle.clear()
        self._jobs.put(job)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the save in flight (if any) is on disk or has failed; False when `timeout` ran out."""
        return self._idle.wait(timeout)

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def close(self) -> None:
        """Wait for the save in flight and end the thread."""
        self.wait()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        bind_thread(self.device)
        while (job := self._jobs.get()) is not None:
            try:
                job()
            finally:
                self._idle.set()

    def _save(self, step: int, state: Any, ready: torch.cuda.Event | None, nbytes: int, t0: float) -> None:
        path, error = None, None
        try:
            if ready is not None:
                ready.synchronize()  # this thread waits for the copies; the drafter's never does
            path = self.write(step, state)
        except CheckpointError as e:
            error = e
        except Exception as e:  # anything else must not kill the thread and lose later saves
            error = CheckpointError(f"step {step} not saved: {type(e).__name__}: {e}")
        end = time.perf_counter()
        self.last = Written(step, path, error, nbytes, end - t0, end)
        self.on_done(self.last)
