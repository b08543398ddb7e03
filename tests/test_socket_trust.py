"""Who may put sockets where we look, and whose servers dflash-top believes: real sockets, a real
process running as another uid (root forks a child that drops to `nobody`), the real `dflash-top`.

Another user's socket in a directory we read is never listed; one in our own directory is removed;
a server running as another user is not believed even when named explicitly (SO_PEERCRED); and a
shared directory passed as --socket-dir keeps its mode: the trainer binds in a private subdirectory.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash.telemetry import ProfileStats, TelemetryServer
from dflash.telemetry.wire import protocol as P
from dflash.telemetry.wire.sockets import discover
from dflash_tui import synthetic

NOBODY = 65534
root_only = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user (CI runs as root)")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A short-path directory open to everyone, like /tmp (sticky) or a careless 0777 one."""
    d = Path(tempfile.mkdtemp(prefix="dft-trust-"))
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _spoofing_server(path: Path, uid: int = NOBODY) -> int:
    """Fork a child that becomes `uid`, binds `path` and serves a made-up hello and snapshot to anyone
    who connects (what another user on the box could do). Returns its pid once it listens."""
    lines = P.encode(synthetic.hello(run="spoofed", pid=os.getpid())) + P.encode(synthetic.snapshot(7))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child only makes raw calls before _exit
        try:
            os.close(r)
            os.setgid(uid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path))
            os.chmod(path, 0o777)
            s.listen(8)
            os.write(w, b"1")
            while True:
                c, _ = s.accept()
                try:
                    c.sendall(lines)
                    time.sleep(0.5)
                finally:
                    c.close()
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1", "the spoofing server did not start"
    os.close(r)
    return pid


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def _top(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "import sys; from dflash_tui.cli import main; sys.exit(main())",
                           *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


@root_only
def test_a_socket_planted_by_another_user_is_never_listed_nor_believed(shared_dir: Path) -> None:
    os.chmod(shared_dir, 0o777)  # the user's own directory, left open to everyone
    planted = shared_dir / f"spoofed-{os.getpid()}.sock"
    pid = _spoofing_server(planted)
    try:
        assert os.lstat(planted).st_uid == NOBODY
        assert discover(shared_dir) == []
        listed = _top("--list", "--socket-dir", str(shared_dir))
        assert "spoofed" not in listed.stdout, listed.stdout
        # Named explicitly it is still not believed: the server's uid is checked before a byte is read.
        once = _top("--once", "--json", "--timeout", "20", str(planted))
        assert once.returncode == 1, once.stdout
        assert f"its server runs as uid {NOBODY}" in once.stderr and "not trusted" in once.stderr, once.stderr
        assert "spoofed" not in once.stdout
    finally:
        _stop(pid)


@root_only
def test_a_foreign_socket_in_our_directory_is_removed_when_the_server_starts(sock_dir: Path, connect) -> None:
    """Only root can put one in a 0700 directory; os.chown stands in for that other user."""
    sock_dir.mkdir(mode=0o700)
    planted = sock_dir / f"spoofed-{os.getpid()}.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(planted))
    s.listen(1)
    os.chown(planted, NOBODY, NOBODY)
    assert [i.path for i in discover(sock_dir)] == []
    srv = TelemetryServer("t", ProfileStats(), interval_s=0.05, socket_dir=sock_dir).start()
    try:
        assert not planted.exists(), "a socket of another user must not stay beside ours"
        assert [i.path for i in discover(sock_dir)] == [srv.path]
        assert connect(srv.path).frame(P.Hello).pid == os.getpid()
    finally:
        srv.close()
        s.close()


@root_only
def test_a_shared_socket_dir_keeps_its_mode_and_gets_a_private_subdirectory(shared_dir: Path, connect) -> None:
    os.chmod(shared_dir, 0o1777)  # what /tmp is: `--socket-dir /tmp` must not make /tmp 0700
    srv = TelemetryServer("t", ProfileStats(), interval_s=0.05, socket_dir=shared_dir).start()
    try:
        assert stat.S_IMODE(shared_dir.stat().st_mode) == 0o1777
        private = shared_dir / f"dflash-{os.getuid()}"
        assert srv.path.parent == private and stat.S_IMODE(private.stat().st_mode) == 0o700
        assert [i.path for i in discover(shared_dir)] == [srv.path]  # dflash-top looks where it binds
        once = _top("--once", "--json", "--timeout", "20", "--socket-dir", str(shared_dir))
        assert once.returncode == 0, once.stderr
        assert json.loads(once.stdout)["pid"] == os.getpid()
    finally:
        srv.close()


def test_a_private_subdirectory_someone_else_made_is_refused(shared_dir: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to create a directory owned by another uid")
    os.chmod(shared_dir, 0o1777)
    (shared_dir / f"dflash-{os.getuid()}").mkdir(mode=0o700)
    os.chown(shared_dir / f"dflash-{os.getuid()}", NOBODY, NOBODY)
    with pytest.raises(RuntimeError, match=f"belongs to uid {NOBODY}"):
        TelemetryServer("t", ProfileStats(), socket_dir=shared_dir).start()


def test_a_shared_parent_without_the_sticky_bit_is_refused(shared_dir: Path) -> None:
    os.chmod(shared_dir, 0o777)  # anyone could rename our private subdirectory away and put theirs
    with pytest.raises(RuntimeError, match="writable by others without the sticky bit"):
        TelemetryServer("t", ProfileStats(), socket_dir=shared_dir).start()
    assert stat.S_IMODE(shared_dir.stat().st_mode) == 0o777
