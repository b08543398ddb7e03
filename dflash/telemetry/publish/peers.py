"""The clients of one telemetry server: who may connect, and how frames reach each of them without the
trainer ever waiting for a reader.

Every socket is non-blocking and owned by the server's one thread. A frame is written at once when
nothing is pending; otherwise it joins the client's bounded queue, whose oldest frame is dropped when
full (a frame being written is never cut). A client that stops reading only loses its own frames.
"""

from __future__ import annotations

import collections
import logging
import os
import selectors
import socket
from collections.abc import Callable

from dflash.telemetry.wire.protocol import Reply, encode
from dflash.telemetry.wire.reader import LineSplitter
from dflash.telemetry.wire.sockets import peer_credentials, trusted_uid

log = logging.getLogger("dflash.telemetry")

#: a request line longer than this is discarded with an error reply (requests are tiny)
MAX_REQUEST_BYTES = 64 * 1024


class Client:
    """One connected reader: its socket, its peer credentials, and what is queued for it."""

    __slots__ = ("sock", "fd", "pid", "uid", "lines", "outq", "cur", "dropped", "writing", "last_stacks")

    def __init__(self, sock: socket.socket, pid: int, uid: int, queue_frames: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.pid = pid
        self.uid = uid
        self.lines = LineSplitter(MAX_REQUEST_BYTES)  # the requests it sends, line by line
        self.outq: collections.deque[bytes] = collections.deque(maxlen=queue_frames)
        self.cur: memoryview | None = None  # the frame being written; never dropped half-sent
        self.dropped = 0
        self.writing = False
        self.last_stacks = 0.0


class Peers:
    """The connected clients, registered on the server's selector.

    `greeting()` gives the frames a new client gets first (hello, recent events, the last snapshot);
    `on_line(client, line)` handles each request line (None: a line over the size limit).
    """

    def __init__(self, sel: selectors.BaseSelector, max_clients: int, queue_frames: int,
                 greeting: Callable[[], list[bytes]], on_line: Callable[[Client, bytes | None], None]) -> None:
        self.sel = sel
        self.max_clients = max_clients
        self.queue_frames = max(1, queue_frames)
        self.greeting = greeting
        self.on_line = on_line
        self.clients: dict[int, Client] = {}
        self.dropped_frames = 0

    def accept(self, listener: socket.socket) -> bool:
        """Take every pending connection; False when accepting failed (e.g. EMFILE) and the caller
        should stop polling the listener for a while, since it stays readable."""
        while True:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except OSError as e:
                log.warning("telemetry: accept failed (%s); pausing accepts for one interval", e)
                return False
            conn.setblocking(False)
            try:
                pid, uid, _gid = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            if not trusted_uid(uid):
                self._refuse(conn, f"peer uid {uid} is not the trainer's uid {os.getuid()} (or root)")
                continue
            if len(self.clients) >= self.max_clients:
                self._refuse(conn, f"too many telemetry clients (limit {self.max_clients})")
                continue
            c = Client(conn, pid, uid, self.queue_frames)
            self.clients[c.fd] = c
            self.sel.register(conn, selectors.EVENT_READ, self.on_event)
            for frame in self.greeting():
                self.send(c, frame)

    @staticmethod
    def _refuse(conn: socket.socket, why: str) -> None:
        try:
            conn.send(encode(Reply(id=0, op="connect", ok=False, error=why)), socket.MSG_NOSIGNAL)
        except OSError:
            pass
        conn.close()

    def drop(self, c: Client) -> None:
        if self.clients.pop(c.fd, None) is None:
            return
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError, OSError):
            pass
        try:
            c.sock.close()
        except OSError:
            pass

    def drop_all(self) -> None:
        for c in list(self.clients.values()):
            self.drop(c)

    def _want_write(self, c: Client, on: bool) -> None:
        if c.writing == on:
            return
        c.writing = on
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if on else 0)
        self.sel.modify(c.sock, events, self.on_event)

    def send(self, c: Client, data: bytes) -> None:
        """Queue one frame for a client, writing straight away when nothing is pending."""
        if c.cur is None and not c.outq:
            try:
                n = c.sock.send(data, socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                self.drop(c)
                return
            if n == len(data):
                return
            c.cur = memoryview(data)[n:]
            self._want_write(c, True)
            return
        if len(c.outq) == c.outq.maxlen:
            c.dropped += 1
            self.dropped_frames += 1
        c.outq.append(data)  # a full deque drops its oldest frame
        self._want_write(c, True)

    def broadcast(self, data: bytes) -> None:
        for c in list(self.clients.values()):
            self.send(c, data)

    def reply(self, c: Client, id_: int, op: str, ok: bool, data: object = None, error: str | None = None) -> None:
        self.send(c, encode(Reply(id=id_, op=op, ok=ok, error=error, data=data)))

    def flush(self, c: Client) -> None:
        while True:
            if c.cur is None:
                if not c.outq:
                    self._want_write(c, False)
                    return
                c.cur = memoryview(c.outq.popleft())
            try:
                n = c.sock.send(c.cur, socket.MSG_NOSIGNAL)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.drop(c)
                return
            c.cur = c.cur[n:] if n < len(c.cur) else None

    def pending(self) -> list[Client]:
        """Clients with frames still to write."""
        return [c for c in self.clients.values() if c.cur is not None or c.outq]

    def on_event(self, key: selectors.SelectorKey, mask: int) -> None:
        c = self.clients.get(key.fd)
        if c is None:
            return
        if mask & selectors.EVENT_WRITE:
            self.flush(c)
            if c.fd not in self.clients:
                return
        if mask & selectors.EVENT_READ:
            self._read(c)

    def _read(self, c: Client) -> None:
        try:
            data = c.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.drop(c)
            return
        if not data:  # peer closed; a half-sent request dies with it
            self.drop(c)
            return
        for line in c.lines.feed(data):
            if c.fd not in self.clients:
                return
            self.on_line(c, line)
