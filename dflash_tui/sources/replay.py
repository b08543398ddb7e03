"""The replay source: a recorded telemetry.jsonl played back at its own pace, with pause, step and seek."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from dflash.telemetry.wire.protocol import Reply, Snapshot
from dflash.telemetry.wire.reader import FrameReader, Read, read_file
from dflash_tui.sources.base import Connection, RequestFailed, SourceUpdate, mismatch_message

if TYPE_CHECKING:  # the interface's types, named in annotations only
    from dflash_tui.sources.base import LiveLink, Playback, Sink, Watched

#: the paces `+` and `-` step through (inf: as fast as the file reads)
SPEEDS = [0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0, math.inf]


def next_speed(current: float, direction: int) -> float:
    """The pace `direction` steps (+1 faster, -1 slower) from the ladder's nearest to `current`."""
    def distance(speed: float) -> float:
        if math.isfinite(speed) and math.isfinite(current):
            return abs(math.log(speed) - math.log(current))
        return 0 if speed == current else 99

    idx = min(range(len(SPEEDS)), key=lambda i: distance(SPEEDS[i]))
    return SPEEDS[max(0, min(len(SPEEDS) - 1, idx + direction))]


def recording_span(f: BinaryIO) -> tuple[float | None, float | None]:
    """The first and last snapshot times of an open recording: the first from its head, the last
    from its tail (a recording of hours is tens of MB; only 64 KB at each end are read). The tail's
    first line is cut and does not decode: it is passed over like any bad line."""
    def times(reads: list[Read]) -> list[float]:
        return [r.frame.t for r in reads if isinstance(r.frame, Snapshot)]

    try:
        head = times(FrameReader().feed(f.read(65536)))
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 65536))
        tail_reader = FrameReader()
        tail = times(tail_reader.feed(f.read()) + tail_reader.finish())
        f.seek(0)
    except OSError:
        return None, None
    return (head[0] if head else None), (tail[-1] if tail else None)


class ReplaySource:
    """Plays a telemetry.jsonl back at `speed` x its recorded pace, with pause and single-step.

    The file is streamed line by line (an hour of recording is tens of MB; we keep only what the
    state's ring buffers keep). Snapshots are paced by their `t`; other frames pass straight through.
    A truncated last line (a trainer killed mid-write) is reported and skipped.
    """

    live: LiveLink | None = None
    watched: Watched | None = None
    #: the longest a gap in the recording is allowed to stall the replay, in wall seconds
    MAX_GAP_S = 5.0

    def __init__(self, path: Path | str, speed: float = 1.0, paused: bool = False, batch_s: float = 0.05) -> None:
        self.path = Path(path)
        self.batch_s = batch_s
        self._speed = speed if speed > 0 else math.inf
        self._paused = paused
        self._steps = 0
        self._anchor: tuple[float, float] | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sink: Sink | None = None
        self.frames_read = 0
        self.finished = threading.Event()
        #: the recording's first and last snapshot times (the end read from the file's tail at start)
        self.start_t: float | None = None
        self.end_t: float | None = None
        #: stream time of the last snapshot delivered
        self.position: float | None = None
        self._seek: float | None = None  # a requested stream time, not yet reached
        self._fast_until: float | None = None  # deliver without pacing until this stream time

    # -- controls (called from the UI thread)

    def seek(self, delta: float | None = None, to: float | None = None) -> None:
        """Move `delta` seconds of the run's time (+-), or `to` seconds after the recording's start.
        Backwards restarts the file (the state is rebuilt from the start, quickly); paused stays paused
        at the new place."""
        with self._cond:
            here = self.position if self.position is not None else self.start_t
            if here is None:
                return
            ended = self.finished.is_set() and self._thread is not None and not self._thread.is_alive()
            target = (self.start_t or here) + to if to is not None else here + (delta or 0.0)
            if self.start_t is not None:
                target = max(self.start_t, target)
            if self.end_t is not None:
                target = min(self.end_t, target)
            self._seek = target
            self._cond.notify_all()
        if ended and self._sink is not None and not self._stop.is_set():
            # the reader had played the file to its end: read it again, from a clean state
            self.finished.clear()
            self.position = None
            self._thread = threading.Thread(target=self._run, args=(self._sink, True), name="dflash-top-replay",
                                            daemon=True)
            self._thread.start()

    def where(self) -> str:
        """`1:23 / 5:00 at 2x` (`, paused`): the position in the recording, its length and the speed."""
        from dflash_tui import fmt

        speed = self._speed_label()
        start = self.start_t
        pos = fmt.clock(self.position - start, short=True) if start is not None and self.position else "0:00"
        length = fmt.clock(self.end_t - start, short=True) if start is not None and self.end_t else "?"
        return f"{pos} / {length} at {speed}" + (", paused" if self._paused else "")

    @property
    def playback(self) -> Playback:
        return self

    @property
    def speed(self) -> float:
        return self._speed

    @property
    def paused(self) -> bool:
        return self._paused

    def describe(self) -> str:
        return f"{self.path} at {self._speed_label()}" + (" (paused: space resumes, n steps)" if self._paused else "")

    def _speed_label(self) -> str:
        return "max" if math.isinf(self._speed) else f"{self._speed:g}x"

    def set_speed(self, speed: float) -> None:
        with self._cond:
            self._speed = speed if speed > 0 else math.inf
            self._anchor = None
            self._cond.notify_all()
        self._announce()

    def pause(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.notify_all()
        self._announce()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._anchor = None
            self._cond.notify_all()
        self._announce()

    def toggle_pause(self) -> None:
        self.resume() if self._paused else self.pause()

    def step(self) -> None:
        """Release the next snapshot (pausing first if playing)."""
        with self._cond:
            self._paused = True
            self._steps += 1
            self._cond.notify_all()

    def _announce(self) -> None:
        if self._sink is not None and not self.finished.is_set():
            self._sink(SourceUpdate(state=Connection.PAUSED if self._paused else Connection.REPLAY,
                                    detail=self.describe()))

    # -- lifecycle

    def start(self, sink: Sink) -> None:
        self._sink = sink
        self._thread = threading.Thread(target=self._run, args=(sink,), name="dflash-top-replay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    def request(self, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Reply:
        raise RequestFailed("this is a recording: there is no trainer to ask")

    # -- reader thread

    def _run(self, sink: Sink, again: bool = False) -> None:
        if again:
            sink(SourceUpdate(reset=True))
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed below, the loop can return early
        except OSError as e:
            sink(SourceUpdate(state=Connection.ENDED, detail=f"cannot read {self.path}: {e}"))
            self.finished.set()
            return
        self.start_t, self.end_t = recording_span(f)
        # the state goes with the first frames, so its note in the events log is stamped with the
        # run's time (the hello's) rather than today's
        batch = SourceUpdate(state=Connection.PAUSED if self._paused else Connection.REPLAY, detail=self.describe())
        last_flush = time.monotonic()
        errors = 0
        reader = FrameReader()
        with f:
            reads: Iterator[Read] = read_file(f, reader)
            while (read := next(reads, None)) is not None:
                if self._stop.is_set():
                    return
                if read.note is not None:  # a segment in another protocol version: skipped, said once
                    batch.errors.append(f"{self.path.name}:{read.lineno}: {read.note}")
                frame = read.frame
                if frame is None:
                    if read.error is not None:
                        errors += 1
                        batch.errors.append(f"{self.path.name}:{read.lineno}: {read.error}")
                    continue
                if isinstance(frame, Snapshot):
                    if not self._pace(frame.t, sink, batch):
                        return
                    if self._rewind:  # a seek backwards: the file, the reader and the state start over
                        self._rewind = False
                        f.seek(0)
                        reader.reset()
                        reads = read_file(f, reader)
                        self._flush(sink, batch)
                        sink(SourceUpdate(reset=True))
                        continue
                    self.position = frame.t
                self.frames_read += 1
                batch.frames.append(frame)
                now = time.monotonic()
                if len(batch.frames) >= 256 or now - last_flush >= self.batch_s:
                    self._flush(sink, batch)
                    last_flush = now
        self._flush(sink, batch)
        self.finished.set()
        if self.frames_read == 0 and reader.foreign is not None:  # the whole file is another version
            sink(SourceUpdate(state=Connection.INCOMPATIBLE, detail=f"{self.path}: {mismatch_message(reader.foreign)}"))
            return
        skipped = f", {reader.gate.skipped} frames of another protocol version skipped" if reader.gate.skipped else ""
        sink(SourceUpdate(state=Connection.ENDED, detail=f"replay of {self.path} finished: {self.frames_read} frames"
                          + (f", {errors} bad lines" if errors else "") + skipped))

    @staticmethod
    def _flush(sink: Sink, batch: SourceUpdate) -> None:
        if batch.frames or batch.errors or batch.state is not None:
            sink(SourceUpdate(frames=batch.frames[:], errors=batch.errors[:], state=batch.state, detail=batch.detail))
            batch.frames.clear()
            batch.errors.clear()
            batch.state, batch.detail = None, ""

    _rewind = False

    def _pace(self, t: float, sink: Sink, batch: SourceUpdate) -> bool:
        """Wait until the snapshot stamped `t` is due; False when the source was stopped. A pending
        seek turns into fast delivery up to its time (or a rewind of the file, for one backwards)."""
        with self._cond:
            while not self._stop.is_set():
                if self._seek is not None:
                    target, self._seek = self._seek, None
                    if self.position is not None and target < self.position:
                        self._rewind, self.position = True, None
                    self._fast_until = target
                    if self._rewind:
                        return True
                if self._fast_until is not None:
                    if t < self._fast_until:
                        return True
                    self._fast_until, self._anchor = None, None
                    return True  # the frame at the target is shown, even when paused
                if self._paused:
                    if self._steps > 0:
                        self._steps -= 1
                        self._anchor = None
                        return True
                    self._flush(sink, batch)
                    self._cond.wait()
                    continue
                if math.isinf(self._speed):
                    return True
                now = time.monotonic()
                if self._anchor is None:
                    self._anchor = (t, now)
                    return True
                t0, w0 = self._anchor
                delay = (t - t0) / self._speed - (now - w0)
                if delay > self.MAX_GAP_S:  # a long pause in the recording: skip over it
                    self._anchor = (t, now)
                    return True
                if delay <= 0:
                    return True
                self._flush(sink, batch)
                self._cond.wait(min(delay, 0.25))
        return False
