"""The live source: a trainer's Unix socket, read on a thread, reconnected when the trainer restarts."""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.telemetry.wire.protocol import Bye, Hello, Reply, Request, encode
from dflash.telemetry.wire.reader import FrameReader
from dflash.telemetry.wire.sockets import SocketInfo, discover, untrusted_server
from dflash_tui.sources.base import Connection, RequestFailed, SourceUpdate, mismatch_message

if TYPE_CHECKING:  # the interface's types, named in annotations only
    from dflash_tui.sources.base import LiveLink, Playback, Sink, Watched

#: how long to wait before reconnecting to a trainer that refused us (wrong uid, too many clients)
REFUSED_RETRY_S = 5.0


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
    watched: Watched | None = None

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
