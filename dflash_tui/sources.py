"""Where frames come from: a live trainer's Unix socket, or a recorded telemetry.jsonl.

Both sources fetch bytes on a daemon thread, turn them into frames with the one telemetry reader
(``dflash.telemetry.reader``) and hand batches to a sink callable (the app turns each batch into a
message), so the UI thread never waits on a socket or a disk. They share one small interface (start,
stop, request) and say what else they can do: ``playback`` (pause, step, speed, seek) for a recording,
``live`` (requests to the trainer, its run's other ranks) for a socket; the app, the headless `--once`
mode and the tests ask those instead of checking a source's type. Nothing here imports Textual.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from dflash.telemetry.protocol import (
    PROTO,
    Bye,
    Frame,
    Hello,
    Reply,
    Request,
    Snapshot,
    encode,
    recording_filename,
)
from dflash.telemetry.reader import FrameReader, Read, read_file
from dflash.telemetry.sockets import (
    SocketInfo,
    default_socket_dir,
    discover,
    group_jobs,
    is_socket,
    read_hello,
    untrusted_server,
)


class Connection(enum.StrEnum):
    """Where a source stands; the header and the status line show it."""

    CONNECTING = "connecting"
    LIVE = "live"
    DISCONNECTED = "disconnected"
    #: the trainer speaks another protocol version
    INCOMPATIBLE = "incompatible"
    #: the socket's server runs as another user (not us, not root): nothing it says is shown
    UNTRUSTED = "untrusted"
    REPLAY = "replay"
    PAUSED = "paused"
    ENDED = "ended"

    @property
    def away(self) -> bool:
        """No trainer is being heard from here: the panels dim and keep the last data."""
        return self in (Connection.DISCONNECTED, Connection.INCOMPATIBLE, Connection.UNTRUSTED)


#: how long to wait before reconnecting to a trainer that refused us (wrong uid, too many clients)
REFUSED_RETRY_S = 5.0


@dataclass
class SourceUpdate:
    """A batch from a source: frames in arrival order, decoding errors, and maybe a new state."""

    frames: list[Frame] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    state: Connection | None = None
    detail: str = ""
    #: the frames that follow start the stream over (a replay seeking backwards): forget the old ones
    reset: bool = False


Sink = Callable[[SourceUpdate], None]


class RequestFailed(RuntimeError):
    """A request could not be answered (not connected, timed out, or the trainer said no)."""


class Playback(Protocol):
    """What a recording's source can do: pace, pause, single-step and move in the stream."""

    speed: float
    paused: bool
    #: the recording's first and last snapshot times (None until known)
    start_t: float | None
    end_t: float | None

    def toggle_pause(self) -> None: ...

    def step(self) -> None: ...

    def set_speed(self, speed: float) -> None: ...

    def seek(self, delta: float | None = None, to: float | None = None) -> None: ...

    def where(self) -> str: ...


class LiveLink(Protocol):
    """What a live trainer's source can do: answer requests, and name its socket (run and rank) so that
    the other ranks of its job can be found next to it."""

    path: Path
    info: SocketInfo
    connected: bool

    def request(self, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Reply: ...


class FrameSource(Protocol):
    """What the app needs from any source; `playback` and `live` are None where the source cannot."""

    path: Path
    playback: Playback | None
    live: LiveLink | None

    def start(self, sink: Sink) -> None: ...

    def stop(self) -> None: ...

    def request(self, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Reply: ...


def mismatch_message(proto: Any) -> str:
    return (f"the trainer speaks telemetry protocol v{proto}, this dflash-top speaks v{PROTO}: "
            "run the dflash-top installed with that trainer (same dflash-trainer version)")


# --------------------------------------------------------------------------- targets


class AttachError(Exception):
    """The command-line target names nothing we can read; the message says what to do."""


def resolve(target: str | None, directory: Path | str | None = None) -> Path | None:
    """Turn the TARGET argument into a socket or a recording path (None: discover at runtime).

    A run directory of a running trainer (its hello names that run_dir) attaches live; any other run
    directory replays its telemetry.jsonl. A bare word that matches a running run's name attaches too.
    """
    if target is None:
        return None
    path = Path(target).expanduser()
    if is_socket(path):
        return path
    if path.is_dir():
        live = _live_socket_for_run_dir(path, directory)
        if live is not None:
            return live
        rec = path / recording_filename()
        if rec.exists():
            return rec
        raise AttachError(f"{path} has no {recording_filename()} and no running trainer writes to it")
    if path.is_file():
        return path
    matches = [i for i in discover(directory) if i.alive and i.run == target]
    if matches:
        return group_jobs(matches)[-1][0].path  # a multi-rank job is shown from rank 0
    raise AttachError(f"{target}: not a socket, a run directory, a {recording_filename()} or a running run's name "
                      f"(sockets are looked for in {Path(directory) if directory else default_socket_dir()})")


def _live_socket_for_run_dir(run_dir: Path, directory: Path | str | None) -> Path | None:
    for info in discover(directory):
        if info.alive and serves(info, run_dir):
            return info.path
    return None


def serves(info: SocketInfo, run: Path | str) -> bool:
    """Whether the trainer behind `info` is the run we want: a run directory (compared with the run_dir
    its hello names; a relative one is taken from our working directory) or a run name."""
    if isinstance(run, str):
        return info.run == run
    hello = read_hello(info.path, timeout=0.5)
    return hello is not None and bool(hello.run_dir) and Path(hello.run_dir).resolve() == run.resolve()


def open_source(path: Path, speed: float = 1.0, paused: bool = False) -> FrameSource:
    """A LiveSource for a socket, a ReplaySource for anything else."""
    if is_socket(path):
        return LiveSource(path)
    return ReplaySource(path, speed=speed, paused=paused)


# --------------------------------------------------------------------------- live


class _Pending:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: Reply | None = None
        self.error: str | None = None


class LiveSource:
    """Reads a trainer's socket on a thread; reconnects (to a restarted trainer of the same run) on loss.

    A trainer that restarts gets a new pid and so a new socket name: when the path it was given stops
    answering, the source looks in the same directory for a live socket of the same run and rank.
    """

    playback: Playback | None = None

    def __init__(self, path: Path | str, *, reconnect: bool = True, retry_s: float = 0.5) -> None:
        self.path = Path(path)
        self.info = SocketInfo.from_path(self.path)
        self.reconnect = reconnect
        self.retry_s = retry_s
        self.hello: Hello | None = None
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._refused: str | None = None
        self._untrusted: str | None = None  # why the socket at our path was not believed
        self._had_hello = False

    # -- lifecycle

    def start(self, sink: Sink) -> None:
        self._thread = threading.Thread(target=self._run, args=(sink,), name="dflash-top-reader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    @property
    def live(self) -> LiveLink:
        return self

    @property
    def connected(self) -> bool:
        return self._sock is not None and self.hello is not None

    # -- requests

    def request(self, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Reply:
        """Send a request and wait (on the caller's thread, never the UI's) for the matching reply."""
        sock = self._sock
        if sock is None:
            raise RequestFailed("not connected to the trainer")
        rid = next(self._ids)
        pending = self._pending[rid] = _Pending()
        try:
            with self._send_lock:
                sock.sendall(encode(Request(id=rid, op=op, args=args or {})))
            if not pending.done.wait(timeout):
                raise RequestFailed(f"the trainer did not answer {op!r} within {timeout:g} s")
        except OSError as e:
            raise RequestFailed(f"could not send {op!r} to the trainer: {e}") from None
        finally:
            self._pending.pop(rid, None)
        if pending.reply is None:
            raise RequestFailed(pending.error or f"{op!r}: connection lost")
        return pending.reply

    def _fail_pending(self, why: str) -> None:
        for pending in list(self._pending.values()):
            pending.error = why
            pending.done.set()

    # -- reader thread

    def _run(self, sink: Sink) -> None:
        ever_connected = False
        announced: str | None = None
        while not self._stop.is_set():
            sock = self._open()
            if sock is None and self._untrusted and not ever_connected:
                sink(SourceUpdate(state=Connection.UNTRUSTED, detail=f"{self.path}: {self._untrusted}"))
                return
            if sock is None:
                state = Connection.DISCONNECTED if ever_connected else Connection.CONNECTING
                if announced != state:
                    detail = (f"waiting for {self.info.label} to come back" if ever_connected
                              else f"connecting to {self.path}")
                    sink(SourceUpdate(state=state, detail=detail))
                    announced = state
                if not self.reconnect and ever_connected:
                    return
                self._stop.wait(self.retry_s)
                continue
            ever_connected = True
            announced = None
            self._sock = sock
            try:
                why, incompatible = self._read(sock, sink)
            finally:
                self._sock = None
                self.hello = None
                with contextlib.suppress(OSError):
                    sock.close()
                self._fail_pending("the connection to the trainer was lost")
            if incompatible:
                sink(SourceUpdate(state=Connection.INCOMPATIBLE, detail=why))
                return
            if not self._stop.is_set():
                # a connection that died before its hello (a listener closing under us, as a trainer
                # shuts down) is not news: keep the reason the last real session ended with
                if self._had_hello or self._refused:
                    sink(SourceUpdate(state=Connection.DISCONNECTED, detail=why))
                announced = Connection.DISCONNECTED
                if not self.reconnect:
                    return
                self._stop.wait(REFUSED_RETRY_S if self._refused else self.retry_s)

    def _open(self) -> socket.socket | None:
        candidates = [self.path]
        if self.reconnect and self.info.run is not None:
            same = [i for i in discover(self.path.parent, check_alive=False)
                    if i.run == self.info.run and i.rank == self.info.rank and i.path != self.path]
            candidates += [i.path for i in sorted(same, key=lambda i: -i.mtime)]
        for path in candidates:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(path))
            except OSError:
                s.close()
                continue
            why = untrusted_server(s)
            if why is not None:  # checked before reading a byte: a spoofing server shows nothing
                s.close()
                if path == self.path:
                    self._untrusted = why
                continue
            s.settimeout(0.5)
            if path != self.path:
                self.path = path
                self.info = SocketInfo.from_path(path)
            return s
        return None

    def _read(self, sock: socket.socket, sink: Sink) -> tuple[str, bool]:
        """Read frames until the connection ends; returns (why it ended, protocol mismatch?)."""
        reader = FrameReader()
        bye: Bye | None = None
        self._refused = None
        self._had_hello = False
        while not self._stop.is_set():
            try:
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError as e:
                if bye is None:  # after a bye, a reset is only how the trainer hung up
                    return f"connection lost: {e}", False
                break
            if not chunk:
                break
            update = SourceUpdate()
            for read in reader.feed(chunk):
                if reader.foreign is not None:  # a trainer of another protocol version
                    return mismatch_message(reader.foreign), True
                frame = read.frame
                if frame is None:
                    update.errors.append(read.error or "unreadable frame")
                    continue
                if isinstance(frame, Reply):
                    pending = self._pending.get(frame.id)
                    if pending is not None:
                        pending.reply = frame
                        pending.done.set()
                    elif frame.op == "connect" and not frame.ok:
                        self._refused = frame.error or "refused"
                    elif not frame.ok:
                        update.errors.append(f"trainer replied: {frame.error}")
                    continue
                if isinstance(frame, Hello):
                    self.hello = frame
                    self._had_hello = True
                    update.state, update.detail = Connection.LIVE, f"attached to {self.path}"
                elif isinstance(frame, Bye):
                    bye = frame
                update.frames.append(frame)
            if update.frames or update.errors or update.state:
                sink(update)
        if self._refused:
            return f"the trainer refused the connection: {self._refused}", False
        if bye is not None:
            return f"trainer exited ({bye.reason}); waiting for it to come back", False
        return "the trainer closed the connection; waiting for it to come back", False


# --------------------------------------------------------------------------- memory


class MemorySource:
    """Frames already in memory, delivered in one batch: fixed data for screenshots and tests. There is
    nothing to pace or ask."""

    playback: Playback | None = None
    live: LiveLink | None = None

    def __init__(self, frames: list[Frame], path: Path | str = "memory", state: Connection = Connection.ENDED,
                 detail: str = "fixed frames") -> None:
        self.frames = list(frames)
        self.path = Path(path)
        self.state = state
        self.detail = detail

    def start(self, sink: Sink) -> None:
        sink(SourceUpdate(frames=self.frames, state=self.state, detail=self.detail))

    def stop(self) -> None:
        pass

    def request(self, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Reply:
        raise RequestFailed("fixed frames: there is no trainer to ask")


# --------------------------------------------------------------------------- replay


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

        speed = "max" if math.isinf(self._speed) else f"{self._speed:g}x"
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
        speed = "max" if math.isinf(self._speed) else f"{self._speed:g}x"
        return f"{self.path} at {speed}" + (" (paused: space resumes, n steps)" if self._paused else "")

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
            self._sink(SourceUpdate(state=Connection.PAUSED if self._paused else Connection.REPLAY, detail=self.describe()))

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
