"""TelemetryServer over real Unix sockets, real threads and real processes: the happy path, requests,
and the faults the issue lists (garbage, oversized lines, wrong frames, a client that never reads,
16 clients, mid-frame disconnects, a second server for the same run, stale sockets, foreign uids)."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import wait_until

from dflash.telemetry import ProfileStats, TelemetryServer
from dflash.telemetry.wire import protocol as P
from dflash.telemetry.wire import sockets as S
from dflash.telemetry.wire.reader import read_frames

FAST = 0.05
REPO = Path(__file__).resolve().parents[1]


class Workload:
    """A real worker thread doing timed steps, recording the longest gap between its iterations."""

    def __init__(self, stats: ProfileStats, name: str = "target-0", categories: int = 3) -> None:
        self.stats = stats
        self.name = name
        self.categories = [f"cat_{i:02d}" for i in range(categories)]
        self.stop = threading.Event()
        self.iterations = 0
        self.max_gap = 0.0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        w = self.stats.worker(self.name)
        last = time.perf_counter()
        while not self.stop.is_set():
            with w.span("target_forward"):
                sum(range(200))
            for c in self.categories:
                w.add(c, 1e-5)
            self.iterations += 1
            now = time.perf_counter()
            self.max_gap = max(self.max_gap, now - last)
            last = now
            time.sleep(0.0005)

    def __enter__(self) -> Workload:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


@pytest.fixture
def server(sock_dir: Path, tmp_path: Path) -> Iterator[TelemetryServer]:
    stats = ProfileStats()
    srv = TelemetryServer("t", stats, interval_s=FAST, run_dir=tmp_path / "run", socket_dir=sock_dir).start()
    yield srv
    srv.close()


def _seqs(client, count: int, timeout: float = 5.0) -> list[int]:
    return [client.frame(P.Snapshot, timeout).seq for _ in range(count)]


def test_location_names_and_permissions(sock_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    stats = ProfileStats()
    srv = TelemetryServer("my run/1", stats, interval_s=FAST, socket_dir=sock_dir).start()
    ranked = TelemetryServer("my run/1", stats, interval_s=FAST, socket_dir=sock_dir, rank=1, world_size=2).start()
    try:
        assert srv.path.name == f"my_run_1-{os.getpid()}.sock"
        assert ranked.path.name == f"my_run_1-{os.getpid()}-r1.sock"
        assert stat.S_IMODE(sock_dir.stat().st_mode) == 0o700
        assert stat.S_ISSOCK(srv.path.stat().st_mode)
        assert stat.S_IMODE(srv.path.stat().st_mode) == 0o600
        assert S.parse_socket_filename(ranked.path.name) == ("my_run_1", os.getpid(), 1)
    finally:
        srv.close()
        ranked.close()
    assert not srv.path.exists() and not ranked.path.exists()

    xdg = tmp_path / "xdg"
    xdg.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert S.default_socket_dir() == xdg / "dflash"
    assert TelemetryServer("r", stats).path.parent == xdg / "dflash"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert S.default_socket_dir() == Path(f"/tmp/dflash-{os.getuid()}")


def test_long_run_names_are_shortened_to_fit_sun_path(sock_dir: Path) -> None:
    srv = TelemetryServer("x" * 300, ProfileStats(), interval_s=FAST, socket_dir=sock_dir).start()
    try:
        assert len(os.fsencode(str(srv.path))) <= 107
        assert S.parse_socket_filename(srv.path.name).pid == os.getpid()
    finally:
        srv.close()


def test_socket_dir_owned_by_someone_else_is_refused(sock_dir: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to create a directory owned by another uid")
    sock_dir.mkdir(mode=0o700)
    os.chown(sock_dir, 65534, 65534)
    with pytest.raises(RuntimeError, match="belongs to uid 65534"):
        TelemetryServer("t", ProfileStats(), socket_dir=sock_dir).start()


def test_publish_now_covers_work_done_between_intervals(sock_dir: Path, tmp_path: Path) -> None:
    """A run that ends before the first interval still gets a window with its work (the trainer's last
    log line and the recording read it)."""
    stats = ProfileStats()
    srv = TelemetryServer("t", stats, interval_s=3600, run_dir=tmp_path / "run", socket_dir=sock_dir).start()
    try:
        stats.worker("drafter-0").add("drafter_forward", 0.25)
        assert srv.latest() is None  # no interval has passed
        summary = srv.publish_now(timeout=30)
        assert summary is not None and summary.workers["drafter-0"]["drafter_forward"].total == 0.25
    finally:
        srv.close()
    assert srv.publish_now(timeout=3600) is srv.latest()  # a closed server answers at once (no hour-long wait)


def test_hello_snapshots_events_bye_and_recording(server: TelemetryServer, connect, tmp_path: Path) -> None:
    stats = server.stats
    stats.count("tokens", 100)
    stats.gauge("loss", 2.0)
    with Workload(stats) as wl:
        time.sleep(0.05)
        c = connect(server.path)
        hello = c.frame()
        assert isinstance(hello, P.Hello)
        assert (hello.proto, hello.run, hello.pid, hello.interval_s) == (P.PROTO, "t", os.getpid(), FAST)
        assert "target-0" in hello.workers
        assert hello.threads[str(wl.thread.native_id)] == "target-0"
        assert hello.threads[str(threading.main_thread().native_id)] == "MainThread"
        snaps = [c.frame(P.Snapshot) for _ in range(3)]
    assert [s.seq for s in snaps] == sorted(s.seq for s in snaps) and len({s.seq for s in snaps}) == 3
    last = snaps[-1]
    tf = last.workers["target-0"]["target_forward"]
    assert tf.n > 0 and 0 < tf.share <= 1
    assert last.window_s == pytest.approx(FAST, rel=0.9)
    assert last.cumulative["target-0"]["target_forward"].n >= tf.n
    assert last.counters["tokens"] == 100 and last.gauges["loss"] == 2.0
    assert last.system is not None and any(t.name == "target-0" for t in last.system.threads)
    # a lone target: nothing waits on it (CPU-starved where other processes hold the cores)
    assert last.bottleneck is not None and last.bottleneck.verdict in {"unknown", "balanced", "data-bound",
                                                                       "CPU-starved"}
    assert last.untracked["target-0"] == pytest.approx(
        max(0.0, 1 - sum(v.share for v in last.workers["target-0"].values())))

    server.publish_event("checkpoint", "saved step 100", step=100, path=Path("/x"))
    ev = c.frame(P.Event)
    assert (ev.kind, ev.message, ev.data) == ("checkpoint", "saved step 100", {"step": 100, "path": "PosixPath('/x')"})
    late = connect(server.path)
    assert isinstance(late.frame(), P.Hello)
    assert isinstance(late.frame(), P.Event)  # recent events are replayed to late joiners

    server.close(reason="done")
    server.close()  # idempotent
    bye = c.frame(P.Bye)
    assert bye.reason == "done"
    with pytest.raises(EOFError):
        c.frame()
    assert not server.path.exists()
    frames = list(read_frames(tmp_path / "run" / "telemetry.jsonl", strict=True))
    kinds = [type(f).__name__ for f in frames]
    assert kinds[0] == "Hello" and kinds[-1] == "Bye" and "Event" in kinds and kinds.count("Snapshot") >= 3
    assert frames[-2].seq == max(f.seq for f in frames if isinstance(f, P.Snapshot))  # final window kept


def test_stacks_request(server: TelemetryServer, connect) -> None:
    parked = threading.Event()
    release = threading.Event()

    def a_uniquely_named_parking_function() -> None:
        parked.set()
        release.wait(10)

    t = threading.Thread(target=a_uniquely_named_parking_function, name="parked-worker")
    t.start()
    try:
        parked.wait(5)
        c = connect(server.path)
        c.send(b'{"type":"request","id":7,"op":"stacks"}\n')
        r = c.frame(P.Reply)
        assert (r.id, r.op, r.ok) == (7, "stacks", True)
        th = next(x for x in r.data["threads"] if x["name"] == "parked-worker")
        assert th["tid"] == t.native_id
        funcs = [f["function"] for f in th["frames"]]
        assert "a_uniquely_named_parking_function" in funcs
        assert funcs.index("wait") < funcs.index("a_uniquely_named_parking_function")  # innermost first
        assert r.data["threads"][0]["name"] == "MainThread"
        c.send(b'{"type":"request","id":8,"op":"stacks"}\n')
        r2 = c.frame(P.Reply)
        assert r2.id == 8 and not r2.ok and "too often" in r2.error
    finally:
        release.set()
        t.join()


def test_ptrace_allow_request(server: TelemetryServer, connect) -> None:
    c = connect(server.path)
    c.send(b'{"type":"request","id":3,"op":"ptrace_allow"}\n')
    r = c.frame(P.Reply)
    assert r.id == 3 and r.op == "ptrace_allow"
    assert r.data["pid"] == os.getpid()  # the peer is this very process (SO_PEERCRED)
    scope = r.data["ptrace_scope"]
    if scope is None or scope == 0:
        assert r.ok and "not needed" in r.data["message"]
    elif scope == 1:
        assert r.ok and "may now ptrace" in r.data["message"]
    else:
        assert r.error


def test_bad_input_gets_one_line_errors_and_others_keep_being_served(server: TelemetryServer, connect) -> None:
    bystander = connect(server.path)
    bystander.frame(P.Hello)
    c = connect(server.path)
    c.frame(P.Hello)
    cases = [
        (b"\xff\x00\x13garbage\x80\n", "malformed frame"),
        (b"{not json\n", "malformed frame"),
        (b'{"type":"snapshot","seq":1,"t":0,"interval_s":1}\n', "expected a 'request'"),
        (b'{"type":"hello","proto":1}\n', "invalid frame"),
        (b'{"type":"request"}\n', "invalid frame"),
        (b'{"type":"request","id":"x","op":"stacks"}\n', "invalid frame"),
        (b'{"type":"request","id":5,"op":"rm -rf"}\n', "unknown op"),
        (b"[1,2,3]\n", "invalid frame"),
    ]
    for payload, expected in cases:
        c.send(b"\n" + payload)  # the bare newline is ignored, not answered
        r = c.frame(P.Reply)
        assert not r.ok and expected in r.error, (payload, r.error)
        assert "\n" not in r.error
    # an oversized line: one error, the rest of the line discarded, the connection still usable
    c.send(b"x" * 100_000)
    c.send(b"y" * 100_000 + b"\n")
    r = c.frame(P.Reply)
    assert not r.ok and "exceeds" in r.error
    c.send(b'{"type":"request","id":9,"op":"ptrace_allow"}\n')
    r = c.frame(P.Reply)
    assert r.id == 9 and r.ok, r.error
    seqs = _seqs(bystander, 3)
    assert seqs == sorted(seqs)
    assert server.clients == 2


def test_client_that_never_reads_does_not_stall_the_workload(sock_dir: Path, connect) -> None:
    stats = ProfileStats()
    # 8 workers x 12 categories: ~20 KB snapshots, every 10 ms, so a silent client's socket buffer
    # and its 8-frame queue overflow within a fraction of a second
    for i in range(8):
        w = stats.worker(f"drafter-{i}")
        for k in range(12):
            w.add(f"category_{k:02d}", 0.001)
    srv = TelemetryServer("stall", stats, interval_s=0.01, socket_dir=sock_dir, queue_frames=8).start()
    try:
        with Workload(stats, categories=12) as wl:
            silent = connect(srv.path)
            silent.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader = connect(srv.path)
            t0 = time.monotonic()
            seqs = []
            while time.monotonic() - t0 < 1.5:
                seqs.append(reader.frame(P.Snapshot).seq)
                for i in range(8):  # keep the frames big
                    stats.worker(f"drafter-{i}").add("category_00", 0.001)
            # the silent client has overflowed: the workload must go on past that moment (a publisher
            # blocked on it, holding what the workers need, would stop it for good); a wall-clock bound
            # on its longest gap would measure the machine's load instead
            wait_until(lambda: srv.dropped_frames > 0, timeout=30, what="the silent client to overflow")
            overflowed_at = wl.iterations
            wait_until(lambda: wl.iterations > overflowed_at + 100, timeout=30,
                       what=f"the workload to go on (longest gap so far {wl.max_gap:.3f} s)")
        assert len(seqs) > 20 and seqs == sorted(seqs)
        t_close = time.monotonic()
    finally:
        srv.close()
    assert time.monotonic() - t_close < 3.0  # bye to the silent client is best-effort, bounded


def test_sixteen_clients_at_once(server: TelemetryServer, connect) -> None:
    clients = []
    errors = []

    def attach() -> None:
        try:
            c = connect(server.path)
            assert isinstance(c.frame(), P.Hello)
            clients.append((c, _seqs(c, 2)))
        except Exception as e:  # collected: assertion errors in threads would be lost
            errors.append(e)

    threads = [threading.Thread(target=attach) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(clients) == 16 and server.clients == 16
    # half of them vanish abruptly; the rest keep receiving
    for c, _ in clients[:8]:
        c.sock.close()
    for c, seen in clients[8:]:
        assert c.frame(P.Snapshot).seq > seen[-1]
    deadline = time.monotonic() + 2
    while server.clients != 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.clients == 8


def test_clients_disconnecting_mid_frame(server: TelemetryServer, connect) -> None:
    # half a request, then gone
    a = connect(server.path)
    a.send(b'{"type":"request","id":1,"op":"sta')
    a.sock.close()
    # reads a few bytes of a snapshot and closes with the rest unread (the server sees a reset)
    for _ in range(5):
        b = connect(server.path)
        b.frame(P.Hello)
        b.sock.recv(7)
        b.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        b.sock.close()
    # a request sent right before closing: the reply has nobody to go to
    c = connect(server.path)
    c.send(b'{"type":"request","id":2,"op":"stacks"}\n')
    c.sock.shutdown(socket.SHUT_RDWR)
    c.sock.close()
    time.sleep(3 * FAST)
    d = connect(server.path)
    d.frame(P.Hello)
    d.send(b'{"type":"request","id":3,"op":"stacks"}\n')
    assert d.frame(P.Reply).ok
    assert _seqs(d, 2)
    assert server._thread.is_alive()


_CHILD_SERVER = textwrap.dedent(
    """
    import sys
    from dflash.telemetry import ProfileStats, TelemetryServer
    srv = TelemetryServer(sys.argv[1], ProfileStats(), interval_s=0.05, socket_dir=sys.argv[2]).start()
    print(srv.path, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    srv.close()
    """
)


def test_second_server_same_run_name(sock_dir: Path, connect) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD_SERVER, "dup", str(sock_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        child_path = Path(child.stdout.readline().strip())
        assert child_path.exists()
        mine = TelemetryServer("dup", ProfileStats(), interval_s=FAST, socket_dir=sock_dir).start()
        try:
            assert mine.path != child_path
            assert connect(child_path).frame(P.Hello).pid == child.pid
            assert connect(mine.path).frame(P.Hello).pid == os.getpid()
            # the same run and rank twice in one process cannot share a path: refused, not clobbered
            with pytest.raises(RuntimeError, match="already listens"):
                TelemetryServer("dup", ProfileStats(), socket_dir=sock_dir).start()
            assert connect(mine.path).frame(P.Hello).pid == os.getpid()
        finally:
            mine.close()
        assert child_path.exists() and not mine.path.exists()
        assert connect(child_path).frame(P.Hello).pid == child.pid
    finally:
        child.stdin.close()
        assert child.wait(10) == 0
    assert not child_path.exists()


def test_stale_sockets_are_cleaned_live_ones_kept(sock_dir: Path) -> None:
    sock_dir.mkdir(mode=0o700)
    # a trainer killed with SIGKILL leaves its socket file behind
    code = (
        "import socket, sys, os, time\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        "s.bind(sys.argv[1] + f'/old-{os.getpid()}.sock'); s.listen()\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    victim = subprocess.Popen([sys.executable, "-c", code, str(sock_dir)], stdout=subprocess.PIPE, text=True)
    assert victim.stdout.readline().strip() == "ready"
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    stale = sock_dir / f"old-{victim.pid}.sock"
    assert stale.exists()
    live = sock_dir / "alive-1.sock"  # pid 1 always exists
    live.touch()
    other = sock_dir / "notes.txt"
    other.touch()
    # and a leftover at our own path from an earlier server in this process that was not closed
    leftover_srv = TelemetryServer("me", ProfileStats(), socket_dir=sock_dir)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(leftover_srv.path))
    s.close()
    srv = TelemetryServer("me", ProfileStats(), interval_s=FAST, socket_dir=sock_dir).start()
    try:
        assert not stale.exists()
        assert live.exists() and other.exists()
        assert srv.path.exists()
        c = socket.socket(socket.AF_UNIX)
        c.connect(str(srv.path))
        c.close()
    finally:
        srv.close()


def _connect_as(uid: int, path: Path) -> bytes:
    """Connect from a forked child running as `uid` and return all it received (a real process with
    a real other uid; the child only makes raw syscalls before _exit)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(5)
            s.connect(str(path))
            while chunk := s.recv(65536):
                os.write(w, chunk)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return data


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another uid")
def test_foreign_uid_is_refused(server: TelemetryServer, connect) -> None:
    # open the doors that normally keep other users out, so the SO_PEERCRED check is what stops them
    os.chmod(server.path.parent.parent, 0o755)
    os.chmod(server.path.parent, 0o755)
    os.chmod(server.path, 0o666)
    lines = _connect_as(65534, server.path).splitlines()
    assert len(lines) == 1, lines  # no hello, no snapshot: just the refusal
    reply = json.loads(lines[0])
    assert reply["type"] == "reply" and reply["ok"] is False and "uid 65534" in reply["error"]
    assert connect(server.path).frame(P.Hello).pid == os.getpid()


def test_publish_before_start_and_after_close(sock_dir: Path, tmp_path: Path, connect) -> None:
    srv = TelemetryServer("ev", ProfileStats(), interval_s=FAST, run_dir=tmp_path, socket_dir=sock_dir)
    srv.publish_event("info", "queued before start")
    srv.start()
    c = connect(srv.path)
    assert c.frame(P.Event).message == "queued before start"
    srv.close()
    srv.publish_event("info", "after close is ignored")
    frames = list(read_frames(tmp_path / "telemetry.jsonl"))
    assert [f.message for f in frames if isinstance(f, P.Event)] == ["queued before start"]
    with pytest.raises(RuntimeError):
        srv.start()


def test_forked_child_close_leaves_parent_socket(server: TelemetryServer, connect) -> None:
    pid = os.fork()
    if pid == 0:  # the child (a DataLoader worker, say) exits through close(): must not unlink
        try:
            server.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert server.path.exists()
    assert connect(server.path).frame(P.Hello).pid == os.getpid()


def test_on_publish_hook_and_latest(sock_dir: Path) -> None:
    got = []
    stats = ProfileStats()
    srv = TelemetryServer(
        "hook", stats, interval_s=FAST, socket_dir=sock_dir, system=False,
        on_publish=lambda summ, snap: got.append((summ.window_s, snap.seq)),
    ).start()
    try:
        stats.worker("target-0").add("target_forward", 0.01)
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [seq for _, seq in got[:2]] == [1, 2]
        assert srv.latest() is not None
    finally:
        srv.close()


def test_client_limit(sock_dir: Path, connect) -> None:
    srv = TelemetryServer("lim", ProfileStats(), interval_s=FAST, socket_dir=sock_dir, max_clients=2).start()
    try:
        a, b = connect(srv.path), connect(srv.path)
        a.frame(P.Hello)
        b.frame(P.Hello)
        c = connect(srv.path)
        r = c.frame()
        assert isinstance(r, P.Reply) and not r.ok and "too many" in r.error
        with pytest.raises(EOFError):
            c.frame()
        assert a.frame(P.Snapshot).seq >= 1
    finally:
        srv.close()
