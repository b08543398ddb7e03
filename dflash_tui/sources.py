"""Where frames come from: a live trainer's Unix socket, or a recorded telemetry.jsonl.

Both sources do their blocking I/O on a daemon thread and hand batches of decoded frames to a sink
callable (the app turns each batch into a message), so the UI thread never waits on a socket or a
disk, the way memray's live reporter reads its socket. They share one small interface (start, stop,
request) in the manner of harlequin's adapters, so the app, the headless `--once` mode and the tests
treat a replay and a live trainer alike. Nothing here imports Textual.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dflash.telemetry.protocol import (
    MAX_FRAME_BYTES,
    PROTO,
    Bye,
    ClusterRank,
    Frame,
    Hello,
    ProtocolError,
    Reply,
    Request,
    SegmentGate,
    Snapshot,
    decode,
    default_socket_dir,
    encode,
    hello_proto,
    owned_by_us,
    parse_socket_filename,
    peer_credentials,
    pid_alive,
    private_socket_dir,
    trusted_uid,
)

#: connection states a source reports; the header and the status line show them
CONNECTING = "connecting"
LIVE = "live"
DISCONNECTED = "disconnected"
INCOMPATIBLE = "incompatible"
#: the socket's server runs as another user (not us, not root): nothing it says is shown
UNTRUSTED = "untrusted"
REPLAY = "replay"
PAUSED = "paused"
ENDED = "ended"

RECORDING_NAME = "telemetry.jsonl"
#: how long to wait before reconnecting to a trainer that refused us (wrong uid, too many clients)
REFUSED_RETRY_S = 5.0


@dataclass
class SourceUpdate:
    """A batch from a source: frames in arrival order, decoding errors, and maybe a new state."""

    frames: list[Frame] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    state: str | None = None
    detail: str = ""
    #: the frames that follow start the stream over (a replay seeking backwards): forget the old ones
    reset: bool = False


Sink = Callable[[SourceUpdate], None]


class RequestFailed(RuntimeError):
    """A request could not be answered (not connected, timed out, or the trainer said no)."""


class FrameSource(Protocol):
    """What the app needs from a source; LiveSource and ReplaySource both provide it."""

    kind: str
    path: Path

    def start(self, sink: Sink) -> None: ...

    def stop(self) -> None: ...

    def request(self, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Reply: ...


# --------------------------------------------------------------------------- discovery


def socket_dir() -> Path:
    """The directory trainers put their sockets in (the protocol module owns the rule)."""
    return private_socket_dir(default_socket_dir())


def untrusted_server(sock: socket.socket) -> str | None:
    """Why the server at the other end of a connected socket is not to be believed (it runs as another
    user, so its telemetry could be made up), or None when it runs as us or as root."""
    try:
        _pid, uid, _gid = peer_credentials(sock)
    except OSError as e:
        return f"cannot tell who serves it ({e.strerror or e})"
    if trusted_uid(uid):
        return None
    return f"its server runs as uid {uid}, not as you ({os.getuid()}) or root: not trusted"


@dataclass
class SocketInfo:
    """One socket file; run/pid/rank come from its name when it follows `<run>-<pid>[-r<rank>].sock`."""

    path: Path
    run: str | None = None
    pid: int | None = None
    rank: int | None = None
    mtime: float = 0.0
    alive: bool | None = None

    @classmethod
    def from_path(cls, path: Path | str) -> SocketInfo:
        path = Path(path)
        name = parse_socket_filename(path.name)
        try:
            mtime = path.stat().st_mtime
        except OSError:
            mtime = 0.0
        if name is None:
            return cls(path=path, mtime=mtime)
        return cls(path=path, run=name.run, pid=name.pid, rank=name.rank, mtime=mtime)

    @property
    def label(self) -> str:
        if self.run is None:
            return self.path.name
        rank = f" rank {self.rank}" if self.rank is not None else ""
        return f"{self.run} (pid {self.pid}{rank})"


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False


def probe(path: Path, timeout: float = 0.5) -> bool:
    """True when something accepts connections on the socket (a stale file refuses them)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def discover(directory: Path | str | None = None, check_alive: bool = True) -> list[SocketInfo]:
    """Our trainer sockets in `directory` (default: the protocol's), oldest run first; where the
    directory is not private, also those in the private subdirectory a trainer binds in there
    (``private_socket_dir``). Socket files that belong to another user are left out: whoever planted
    one could serve any telemetry through it."""
    d = Path(directory) if directory is not None else default_socket_dir()
    found: list[SocketInfo] = []
    entries: list[os.DirEntry] = []
    for where in dict.fromkeys([d, private_socket_dir(d)]):
        try:
            entries += list(os.scandir(where))
        except OSError:
            pass
    for entry in entries:
        if not entry.name.endswith(".sock"):
            continue
        path = Path(entry.path)
        if not is_socket(path) or not owned_by_us(path):
            continue
        info = SocketInfo.from_path(path)
        if check_alive:
            info.alive = probe(path)
        found.append(info)
    found.sort(key=lambda i: (i.run or "", i.rank or 0, i.mtime))
    return found


def group_jobs(infos: Iterable[SocketInfo]) -> list[list[SocketInfo]]:
    """Sockets grouped by job, in the order given: the ranks of one multi-rank run (same run name, each
    `-r<rank>`) together, lowest rank first; every other socket alone. Two jobs under one run name
    cannot be told apart by name, so when a rank appears twice those sockets stay alone."""
    infos = list(infos)
    by_run: dict[str, list[SocketInfo]] = {}
    for i in infos:
        if i.run is not None and i.rank is not None:
            by_run.setdefault(i.run, []).append(i)
    jobs: list[list[SocketInfo]] = []
    placed: set[int] = set()
    for i in infos:
        if id(i) in placed:
            continue
        group = by_run.get(i.run, []) if i.rank is not None else []
        if len(group) > 1 and len({g.rank for g in group}) == len(group):
            job = sorted(group, key=lambda g: g.rank or 0)
        else:
            job = [i]
        jobs.append(job)
        placed.update(id(g) for g in job)
    return jobs


def rank_list(ranks: Iterable[int]) -> str:
    """`0-3,6` for ranks 0, 1, 2, 3 and 6."""
    spans: list[list[int]] = []
    for r in sorted(set(ranks)):
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def job_label(job: list[SocketInfo]) -> str:
    """How the picker names a job: a lone socket by its own label, a multi-rank job by its ranks here."""
    lead = job[0]
    if len(job) == 1:
        return lead.label
    return f"{lead.run} (ranks {rank_list(i.rank or 0 for i in job)} here; rank {lead.rank} is pid {lead.pid})"


def rank_sockets(run: str, directory: Path | str | None) -> dict[int, Path]:
    """This machine's sockets of `run`, by rank (the newest when a rank has several). Judged by the
    pid in the name rather than by connecting, so that the UI thread may ask on a key press."""
    found: dict[int, Path] = {}
    for info in sorted(discover(directory, check_alive=False), key=lambda i: i.mtime):
        if info.run == run and info.rank is not None and info.pid is not None and pid_alive(info.pid):
            found[info.rank] = info.path
    return found


def rank_socket(rank: int, local: dict[int, Path], directory: Path | str | None,
                reported: ClusterRank | None = None) -> tuple[Path | None, str]:
    """Where rank `rank` of a job can be attached from this machine, or None and why not.

    The socket rank 0 reported for it counts when it is a socket here (its host is ours); else the
    job's socket for that rank in `local` (`rank_sockets()`: a rank that restarted has a new pid, so a
    new name). `directory` is only named in the explanation.
    """
    here = socket.gethostname()
    if (reported is not None and reported.socket and reported.host in ("", here)
            and is_socket(Path(reported.socket))):
        return Path(reported.socket), ""
    if rank in local:
        return local[rank], ""
    if reported is not None and reported.host and reported.host != here:
        return None, (f"rank {rank} runs on {reported.host}: its socket is not on this machine "
                      f"(ssh {reported.host} and run dflash-top there)")
    if reported is not None and reported.state == "silent":
        return None, f"rank {rank} has not reported yet and has no socket in {directory}"
    return None, f"rank {rank} has no live socket of this run in {directory}"


def read_hello(path: Path, timeout: float = 1.0) -> Hello | None:
    """Connect, read the first frame and hang up: how `--list` and run-dir matching learn who is there."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    buf = b""
    try:
        s.connect(str(path))
        if untrusted_server(s):
            return None
        while b"\n" not in buf and time.monotonic() < deadline and len(buf) < MAX_FRAME_BYTES:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    except OSError:
        return None
    finally:
        s.close()
    try:
        frame = decode(buf.split(b"\n", 1)[0])
    except ProtocolError:
        return None
    return frame if isinstance(frame, Hello) else None


def proto_mismatch(line: bytes) -> str | None:
    """If `line` is a hello from another protocol version, the message to show; else None.

    A hello from a newer trainer may not even decode with our structs, so this peeks at the raw JSON.
    """
    proto = hello_proto(line)
    if proto is None or proto == PROTO:
        return None
    return mismatch_message(proto)


def mismatch_message(proto: Any) -> str:
    return (f"the trainer speaks telemetry protocol v{proto}, this dflash-top speaks v{PROTO}: "
            "run the dflash-top installed with that trainer (same dflash-trainer version)")


# --------------------------------------------------------------------------- targets


class TargetError(Exception):
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
        rec = path / RECORDING_NAME
        if rec.exists():
            return rec
        raise TargetError(f"{path} has no {RECORDING_NAME} and no running trainer writes to it")
    if path.is_file():
        return path
    matches = [i for i in discover(directory) if i.alive and i.run == target]
    if matches:
        return group_jobs(matches)[-1][0].path  # a multi-rank job is shown from rank 0
    raise TargetError(f"{target}: not a socket, a run directory, a {RECORDING_NAME} or a running run's name "
                      f"(sockets are looked for in {Path(directory) if directory else socket_dir()})")


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

    A trainer that restarts gets a new pid and so a new socket name: when the original path stops
    answering, the source looks in the same directory for a live socket of the same run and rank.
    """

    kind = "live"

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
                sink(SourceUpdate(state=UNTRUSTED, detail=f"{self.path}: {self._untrusted}"))
                return
            if sock is None:
                state = DISCONNECTED if ever_connected else CONNECTING
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
                sink(SourceUpdate(state=INCOMPATIBLE, detail=why))
                return
            if not self._stop.is_set():
                # a connection that died before its hello (a listener closing under us, as a trainer
                # shuts down) is not news: keep the reason the last real session ended with
                if self._had_hello or self._refused:
                    sink(SourceUpdate(state=DISCONNECTED, detail=why))
                announced = DISCONNECTED
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
        buf = bytearray()
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
            buf += chunk
            if b"\n" not in chunk:
                if len(buf) > MAX_FRAME_BYTES:
                    sink(SourceUpdate(errors=[f"dropped a frame over {MAX_FRAME_BYTES} bytes"]))
                    buf.clear()
                continue
            *lines, rest = bytes(buf).split(b"\n")
            buf = bytearray(rest)
            update = SourceUpdate()
            for line in lines:
                if not line.strip():
                    continue
                try:
                    frame = decode(line)
                except ProtocolError as e:
                    mismatch = proto_mismatch(line)
                    if mismatch:
                        return mismatch, True
                    update.errors.append(str(e))
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
                    if frame.proto != PROTO:
                        return mismatch_message(frame.proto), True
                    self.hello = frame
                    self._had_hello = True
                    update.state, update.detail = LIVE, f"attached to {self.path}"
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
    """Frames already in memory, delivered in one batch: fixed data for screenshots and tests."""

    kind = "replay"

    def __init__(self, frames: list[Frame], path: Path | str = "memory", state: str = ENDED,
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


def recording_span(f) -> tuple[float | None, float | None]:
    """The first and last snapshot times of an open recording: the first from its head, the last
    from its tail (a recording of hours is tens of MB; only 64 KB at each end are read)."""
    def times(chunk: bytes) -> list[float]:
        out = []
        for line in chunk.splitlines():
            if b'"snapshot"' not in line[:40]:
                continue
            try:
                frame = decode(line)
            except ProtocolError:
                continue
            if isinstance(frame, Snapshot):
                out.append(frame.t)
        return out

    try:
        head = times(f.read(65536))
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 65536))
        tail = times(f.read())
        f.seek(0)
    except OSError:
        return None, None
    return (head[0] if head else None), (tail[-1] if tail else None)


def _rewindable(f) -> Iterable[tuple[int, bytes]]:
    """(line number, line) of `f`, numbered anew, after a (0, b"") marker, whenever the reader seeks
    the file back to its start (a replay seeking backwards)."""
    lineno = 0
    while True:
        before = f.tell()
        raw = f.readline()
        if not raw:
            return
        if before == 0 and lineno:
            lineno = 0
            yield 0, b""
        lineno += 1
        yield lineno, raw


def frame_time(frame: Frame) -> float | None:
    return getattr(frame, "t", None)


class ReplaySource:
    """Plays a telemetry.jsonl back at `speed` x its recorded pace, with pause and single-step.

    The file is streamed line by line (an hour of recording is tens of MB; we keep only what the
    state's ring buffers keep). Snapshots are paced by their `t`; other frames pass straight through.
    A truncated last line (a trainer killed mid-write) is reported and skipped.
    """

    kind = "replay"
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
        pos = fmt.duration(self.position - start, short=True) if start is not None and self.position else "0:00"
        length = fmt.duration(self.end_t - start, short=True) if start is not None and self.end_t else "?"
        return f"{pos} / {length} at {speed}" + (", paused" if self._paused else "")

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
            self._sink(SourceUpdate(state=PAUSED if self._paused else REPLAY, detail=self.describe()))

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
            sink(SourceUpdate(state=ENDED, detail=f"cannot read {self.path}: {e}"))
            self.finished.set()
            return
        self.start_t, self.end_t = recording_span(f)
        # the state goes with the first frames, so its note in the events log is stamped with the
        # run's time (the hello's) rather than today's
        batch = SourceUpdate(state=PAUSED if self._paused else REPLAY, detail=self.describe())
        last_flush = time.monotonic()
        errors = 0
        gate = SegmentGate()
        with f:
            for lineno, raw in _rewindable(f):
                if self._stop.is_set():
                    return
                if lineno == 0:  # the file started over (a seek backwards): so does the state
                    self._flush(sink, batch)
                    sink(SourceUpdate(reset=True))
                    continue
                if not raw.strip():
                    continue
                frame, error = None, ""
                try:
                    frame = decode(raw)
                except ProtocolError as e:
                    error = str(e)
                use, note = gate.admit(raw, frame)
                if note is not None:  # a segment in another protocol version: skipped, said once
                    batch.errors.append(f"{self.path.name}:{lineno}: {note}")
                if not use:
                    if frame is None and gate.foreign is None:
                        errors += 1
                        why = "truncated last line ignored" if not raw.endswith(b"\n") else error
                        batch.errors.append(f"{self.path.name}:{lineno}: {why}")
                    continue
                if isinstance(frame, Snapshot):
                    if not self._pace(frame.t, sink, batch):
                        return
                    if self._rewind:
                        self._rewind = False
                        f.seek(0)  # _rewindable yields the (0, b"") marker next
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
        if self.frames_read == 0 and gate.foreign is not None:  # the whole file is another version
            sink(SourceUpdate(state=INCOMPATIBLE, detail=f"{self.path}: {mismatch_message(gate.foreign)}"))
            return
        skipped = f", {gate.skipped} frames of another protocol version skipped" if gate.skipped else ""
        sink(SourceUpdate(state=ENDED, detail=f"replay of {self.path} finished: {self.frames_read} frames"
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
