"""TelemetryServer: publishes ProfileStats over a Unix socket and records it to telemetry.jsonl.

One daemon thread owns everything (listener, clients, recorder, sampler) and runs a selector loop
over non-blocking sockets, so no lock is shared with the trainer beyond ProfileStats' own. The loop
drains the stats every interval, encodes the snapshot once and hands the same bytes to each client.
A client that stops reading only fills its own bounded queue, whose oldest frames are dropped: the
trainer never waits for a reader.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from dflash.telemetry.publish.introspection import ptrace_allow, python_stacks, thread_map
from dflash.telemetry.publish.peers import MAX_REQUEST_BYTES, Client, Peers
from dflash.telemetry.publish.recorder import Recorder
from dflash.telemetry.stats import ProfileStats
from dflash.telemetry.summary import Summary, to_snapshot
from dflash.telemetry.verdict.published import PublishedVerdict
from dflash.telemetry.wire.protocol import (
    PROTO,
    Bye,
    Cluster,
    Event,
    Hello,
    ProtocolError,
    Request,
    Snapshot,
    Stacks,
    decode,
    encode,
    recording_filename,
)
from dflash.telemetry.wire.sockets import (
    clean_stale_sockets,
    default_socket_dir,
    ensure_socket_dir,
    private_socket_dir,
    probe,
    socket_filename,
)
from dflash.telemetry.wire.system import SystemSampler
from dflash.telemetry.wire.vocab import PUBLISHER_THREAD

log = logging.getLogger("dflash.telemetry")

#: frames queued per client before the oldest are dropped (~64 snapshots: about a minute at 1 s)
QUEUE_FRAMES = 64
#: stacks replies per client per second (each walks every thread's frames while holding the GIL)
STACKS_PER_S = 5.0
#: how long close() keeps trying to deliver `bye` to clients that are slow to read
CLOSE_FLUSH_S = 0.5
#: events repeated to a client that joins late (checkpoints, warnings)
RECENT_EVENTS = 16
#: AF_UNIX sun_path holds 108 bytes including the terminating NUL
_SUN_PATH_MAX = 107


class Monitor(Protocol):
    """Something that judges each published window (see `TelemetryServer(monitors=...)`)."""

    emit: Callable[..., None] | None

    def check(self, summary: Summary, live: set[str]) -> object: ...


def _encodable(value: Any) -> bool:
    try:
        msgspec.json.encode(value)
        return True
    except (TypeError, ValueError):
        return False


class TelemetryServer:
    """Serves live telemetry for one trainer process (one rank) and records it.

    Start it after creating the ProfileStats; while it runs it owns `stats.drain()` (read the latest
    window with `latest()` or the `on_publish` hook instead of draining yourself).
    """

    def __init__(
        self,
        run: str,
        stats: ProfileStats,
        interval_s: float = 1.0,
        run_dir: str | os.PathLike[str] | None = None,
        rank: int = 0,
        world_size: int = 1,
        socket_dir: str | os.PathLike[str] | None = None,
        *,
        system: bool = True,
        nvml: bool = True,
        queue_frames: int = QUEUE_FRAMES,
        max_clients: int = 64,
        on_publish: Callable[[Summary, Snapshot], None] | None = None,
        cluster_view: Callable[[], Cluster | None] | None = None,
        monitors: Sequence[Monitor] = (),
        thread_init: Callable[[], None] | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.run = run
        self.stats = stats
        self.interval_s = float(interval_s)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.rank = rank
        self.world_size = world_size
        self._requested_dir = Path(socket_dir) if socket_dir is not None else default_socket_dir()
        self.socket_dir = private_socket_dir(self._requested_dir)
        self._system = system
        self._nvml = nvml
        self._queue_frames = max(1, queue_frames)
        self._max_clients = max_clients
        self._on_publish = on_publish
        # Rank 0 of a multi-rank run: the latest cross-rank view, put into every snapshot. It must
        # return at once (the exchange runs in its own thread; this only reads its result).
        self._cluster_view = cluster_view
        # Judges of each window (the stall watchdog, the anomaly detector): they run here, on the
        # publisher thread, never on a worker; their events go out as this server's events.
        self._monitors = list(monitors)
        # Run first on the publisher thread: the trainer binds it to its GPU there, since resolving CUDA
        # events on an unbound thread opens a context on GPU 0 (this package never imports torch).
        self._thread_init = thread_init
        for m in self._monitors:
            if getattr(m, "emit", None) is None:
                m.emit = self.publish_event
        self._pid = os.getpid()
        self._host = socket.gethostname()
        self._started_t = time.time()
        self.path = self._make_path()

        self._peers: Peers | None = None
        self._sel: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._close_lock = threading.Lock()
        self._closed = False
        self._io_done = False
        self._reason = "shutdown"
        self._commands: collections.deque[bytes] = collections.deque()
        self._publish_waiters: collections.deque[threading.Event] = collections.deque()
        self._recent_events: collections.deque[bytes] = collections.deque(maxlen=RECENT_EVENTS)
        self._recorder: Recorder | None = None
        self._sampler: SystemSampler | None = None
        self._sampler_failed = False
        self._seq = 0
        #: the published verdict (recent span, held; the whole run in the last snapshot); the trainer's log
        #: line reads `verdict.current`
        self.verdict = PublishedVerdict()
        self._final_publish = False
        self._last_snapshot: bytes | None = None
        self._latest: Summary | None = None
        self._accept_paused = False

    # --- lifecycle ---------------------------------------------------------------------------------

    def _make_path(self) -> Path:
        rank = self.rank if (self.world_size > 1 or self.rank) else None
        name = socket_filename(self.run, self._pid, rank)
        tail = f"-{self._pid}" + (f"-r{rank}" if rank is not None else "") + ".sock"
        head = name[: -len(tail)]
        budget = _SUN_PATH_MAX - len(os.fsencode(str(self.socket_dir))) - 1 - len(tail)
        if budget < 1:
            raise RuntimeError(
                f"socket directory {self.socket_dir} is too long for a Unix socket path; pass a shorter socket_dir"
            )
        # only the run part is shortened: pid and rank must stay parseable
        return self.socket_dir / (head[:budget] + tail)

    def start(self) -> TelemetryServer:
        """Bind the socket, write `hello` to the recording and start the publisher thread."""
        if self._closed:
            raise RuntimeError("this TelemetryServer was closed; create a new one")
        if self._thread is not None:
            return self
        self._started_t = time.time()
        actual = ensure_socket_dir(self._requested_dir)
        if actual != self.socket_dir:  # the directory changed since we were made: bind where it says now
            self.socket_dir = actual
            self.path = self._make_path()
        clean_stale_sockets(self.socket_dir)
        if self.path.exists() or self.path.is_symlink():
            if probe(self.path):
                raise RuntimeError(
                    f"a telemetry server for run {self.run!r} (rank {self.rank}) already listens at {self.path}"
                )
            self.path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, 0o600)
            listener.listen(64)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        st = os.stat(self.path)
        self._inode = (st.st_dev, st.st_ino)
        self._listener = listener
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, self._accept)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._on_wake)
        self._peers = Peers(self._sel, self._max_clients, self._queue_frames, self._greeting, self._on_line)

        if self.run_dir is not None:
            try:
                self._recorder = Recorder(self.run_dir / recording_filename(self.rank))
                self._recorder.write(encode(self._hello()))
                self._recorder.flush()
            except OSError as e:
                log.error("cannot record telemetry to %s: %s", self.run_dir, e)
                self._recorder = None
        if self._system:
            try:
                self._sampler = SystemSampler(nvml=self._nvml)
            except Exception as e:  # psutil refusing /proc in a locked-down container
                log.warning("system sampling disabled: %s", e)
        self._thread = threading.Thread(target=self._run, name=PUBLISHER_THREAD, daemon=True)
        self._thread.start()
        atexit.register(self._atexit)
        return self

    def __enter__(self) -> TelemetryServer:
        return self.start()

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        self.close(reason="error" if et is not None else "shutdown")

    def _atexit(self) -> None:
        self.close(reason="exit")

    def close(self, reason: str = "shutdown") -> None:
        """Publish a last snapshot, send `bye`, remove the socket and close the recording.

        Idempotent. In a forked child (DataLoader workers) it does nothing: the socket is the
        parent's.
        """
        if os.getpid() != self._pid:
            return
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._reason = reason
        try:
            atexit.unregister(self._atexit)
        except Exception:
            pass
        t = self._thread
        if t is not None and t.is_alive():
            self._stop.set()
            self._wake()
            t.join(timeout=5.0)
            if t.is_alive():
                log.warning("telemetry thread did not stop within 5 s")
        else:
            self._shutdown_io(final=False)  # never started, or the loop died (then this is a no-op)

    @property
    def clients(self) -> int:
        """Connected clients (approximate when read from another thread)."""
        return len(self._peers.clients) if self._peers is not None else 0

    @property
    def dropped_frames(self) -> int:
        """Frames dropped from slow clients' queues since the start."""
        return self._peers.dropped_frames if self._peers is not None else 0

    def latest(self) -> Summary | None:
        """The most recently published window (for the trainer's log line)."""
        return self._latest

    def publish_event(self, kind: str, message: str, **data: Any) -> None:
        """Send an event (checkpoint, eval, warning, ...) to clients and the recording. Thread-safe;
        encoding happens here so that bad data fails in the caller's frame."""
        if self._closed and threading.current_thread() is not self._thread:
            return  # (the publisher thread itself may still report, e.g. a monitor in the last publish)
        ev = Event(t=time.time(), kind=kind, message=message, data=data)
        try:
            frame = encode(ev)
        except (TypeError, ValueError):
            # keep what JSON can carry, show the rest as repr (a Path, a tensor, ...)
            ev.data = {k: v if _encodable(v) else repr(v) for k, v in data.items()}
            frame = encode(ev)
        self._commands.append(frame)
        self._wake()

    def publish_now(self, timeout: float = 2.0) -> Summary | None:
        """Publish a window at once and wait (bounded) until it is out, so that the trainer's last log
        line and the recording cover a run that ended between two intervals. Main thread only; never
        called from a worker."""
        if self._thread is None or not self._thread.is_alive():
            return self._latest
        done = threading.Event()
        self._publish_waiters.append(done)
        self._wake()
        done.wait(timeout)
        return self._latest

    def _wake(self) -> None:
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):
                pass  # pipe full: a wake-up is already pending (or we are shutting down)

    # --- the loop -----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._thread_init is not None:
                self._thread_init()
            self._loop()
        except Exception:
            log.exception("telemetry loop failed; the trainer continues without live telemetry")
        finally:
            self._shutdown_io(final=True)

    def _loop(self) -> None:
        sel = self._sel
        assert sel is not None
        next_pub = time.monotonic() + self.interval_s
        while not self._stop.is_set():
            timeout = max(0.0, next_pub - time.monotonic())
            for key, mask in sel.select(timeout):
                try:
                    key.data(key, mask)
                except Exception:
                    log.exception("telemetry: error while serving a client")
            self._drain_commands()
            now = time.monotonic()
            if self._publish_waiters:
                self._publish()
                next_pub = now + self.interval_s
                while self._publish_waiters:
                    self._publish_waiters.popleft().set()
            elif now >= next_pub:
                self._publish()
                next_pub += self.interval_s
                if next_pub <= now:  # fell behind (suspended, huge GC): skip, do not burst
                    next_pub = now + self.interval_s

    def _broadcast(self, data: bytes) -> None:
        if self._peers is not None:
            self._peers.broadcast(data)

    def _on_wake(self, key: selectors.SelectorKey, mask: int) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _drain_commands(self) -> None:
        while self._commands:
            frame = self._commands.popleft()
            self._recent_events.append(frame)
            self._broadcast(frame)
            if self._recorder is not None:
                self._recorder.write(frame)

    def _publish(self) -> None:
        """Drain, sample, analyse, encode once, fan out. Any failure costs one window, not the loop."""
        try:
            summary = self.stats.drain()
            summary.final = self._final_publish
            tmap = thread_map()
            live = set(tmap.values())
            for m in self._monitors:
                try:
                    m.check(summary, live)
                except Exception:
                    log.exception("telemetry monitor %s failed", type(m).__name__)
            system = None
            if self._sampler is not None:
                try:
                    system = self._sampler.sample(tmap)
                except Exception as e:
                    if not self._sampler_failed:
                        log.warning("system sample failed: %s", e)
                        self._sampler_failed = True
            self._seq += 1
            verdict = (self.verdict.final(summary) if self._final_publish
                       else self.verdict.update(summary, system))
            snap = to_snapshot(summary, self._seq, self.interval_s, system, verdict)
            if self._cluster_view is not None:
                snap.cluster = self._cluster_view()
            data = encode(snap)
        except Exception:
            log.exception("telemetry snapshot failed")
            return
        self._latest = summary
        self._last_snapshot = data
        self._broadcast(data)
        if self._recorder is not None:
            self._recorder.write(data)
            self._recorder.flush()
        if self._on_publish is not None:
            try:
                self._on_publish(summary, snap)
            except Exception:
                log.exception("telemetry on_publish hook failed")
        if self._accept_paused and not self._io_done and self._sel is not None and self._listener is not None:
            self._sel.register(self._listener, selectors.EVENT_READ, self._accept)
            self._accept_paused = False

    def _hello(self) -> Hello:
        return Hello(
            proto=PROTO,
            run=self.run,
            pid=self._pid,
            host=self._host,
            rank=self.rank,
            world_size=self.world_size,
            workers=self.stats.worker_names(),
            threads={str(k): v for k, v in thread_map().items()},
            started=self._started_t,
            interval_s=self.interval_s,
            run_dir=str(self.run_dir) if self.run_dir is not None else None,
        )

    # --- clients ------------------------------------------------------------------------------------

    def _accept(self, key: selectors.SelectorKey, mask: int) -> None:
        assert self._listener is not None and self._sel is not None and self._peers is not None
        if not self._peers.accept(self._listener):
            self._sel.unregister(self._listener)  # until the next publish
            self._accept_paused = True

    def _greeting(self) -> list[bytes]:
        """What a client gets on connecting: hello, the recent events, the last snapshot."""
        return [encode(self._hello()), *self._recent_events,
                *([self._last_snapshot] if self._last_snapshot is not None else [])]

    def _on_line(self, c: Client, line: bytes | None) -> None:
        if line is None:  # said once; the rest of that line is discarded as it arrives
            self._peers.reply(c, 0, "", False,
                              error=f"request line exceeds the {MAX_REQUEST_BYTES}-byte limit; discarded")
        else:
            self._handle_line(c, line)

    def _handle_line(self, c: Client, line: bytes) -> None:
        if not line.strip():
            return  # a bare newline from an interactive socat
        try:
            frame = decode(line, limit=MAX_REQUEST_BYTES)  # bounded: a hostile line costs one reply
        except ProtocolError as e:
            self._peers.reply(c, 0, "", False, error=str(e))
            return
        if not isinstance(frame, Request):
            tag = type(frame).__struct_config__.tag
            self._peers.reply(c, 0, "", False, error=f"expected a 'request' frame from a client, got '{tag}'")
            return
        op = frame.op
        try:
            if op == "stacks":
                now = time.monotonic()
                if now - c.last_stacks < 1.0 / STACKS_PER_S:
                    self._peers.reply(c, frame.id, op, False,
                                      error=f"stacks requested too often (at most {STACKS_PER_S:g}/s)")
                    return
                c.last_stacks = now
                self._peers.reply(c, frame.id, op, True,
                                  data=Stacks(pid=self._pid, t=time.time(), threads=python_stacks()))
            elif op == "ptrace_allow":
                ok, data, err = ptrace_allow(c.pid, c.uid)
                self._peers.reply(c, frame.id, op, ok, data=data, error=err)
            else:
                self._peers.reply(c, frame.id, op, False, error=f"unknown op {op!r} (known: stacks, ptrace_allow)")
        except Exception as e:  # a request must never take the server down
            log.exception("telemetry request %s failed", op)
            self._peers.reply(c, frame.id, op, False, error=f"{op} failed: {e}")

    # --- shutdown -----------------------------------------------------------------------------------

    def _shutdown_io(self, final: bool) -> None:
        """Last snapshot, bye, best-effort delivery, then release everything. Runs once."""
        if self._io_done:
            return
        self._io_done = True
        try:
            if self._sel is not None and self._listener is not None and not self._accept_paused:
                self._sel.unregister(self._listener)
                self._accept_paused = True
            if self._listener is not None:
                # Close and unlink first: a client reconnecting during the bye flush is then refused
                # (and retries later) instead of being accepted into a backlog and reset.
                self._listener.close()
                self._unlink_own_socket()
                self._listener = None
            self._drain_commands()
            if final:
                self._final_publish = True  # the last snapshot judges the whole run
                self._publish()
                self._drain_commands()  # events the monitors raised in that last publish
            bye = encode(Bye(t=time.time(), reason=self._reason))
            self._broadcast(bye)
            deadline = time.monotonic() + CLOSE_FLUSH_S
            peers = self._peers
            while self._sel is not None and peers is not None and time.monotonic() < deadline:
                if not peers.pending():
                    break
                for key, _mask in self._sel.select(max(0.0, deadline - time.monotonic())):
                    c = peers.clients.get(key.fd)
                    if c is not None:
                        peers.flush(c)
            if self._recorder is not None:
                self._recorder.write(bye)
        except Exception:
            log.exception("telemetry shutdown")
        finally:
            if self._peers is not None:
                self._peers.drop_all()
            if self._listener is not None:
                self._listener.close()
                self._unlink_own_socket()
            if self._sel is not None:
                self._sel.close()
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._wake_r = self._wake_w = -1
            if self._recorder is not None:
                self._recorder.close()
            if self._sampler is not None:
                self._sampler.close()
            for m in self._monitors:  # e.g. the GIL probe's thread
                close = getattr(m, "close", None)
                if close is not None:
                    close()

    def _unlink_own_socket(self) -> None:
        """Remove our socket file, but not one another server bound at the same path since."""
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove telemetry socket %s: %s", self.path, e)
