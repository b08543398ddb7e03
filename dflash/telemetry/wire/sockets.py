"""Where telemetry sockets live, what their names say, and which of them are alive and trusted.

The trainer's publisher binds its socket by these rules and dflash-top finds it by the same ones, so
both sides import this module (torch-free, nothing of the trainer). See docs/protocol.md, "Socket".
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from dflash.telemetry.wire.protocol import Hello
from dflash.telemetry.wire.reader import FrameReader

log = logging.getLogger("dflash.telemetry")

_SOCKET_RE = re.compile(r"^(?P<run>.+)-(?P<pid>\d+)(?:-r(?P<rank>\d+))?\.sock$")


class SocketName(NamedTuple):
    run: str
    pid: int
    rank: int | None


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (EPERM: it exists but is not ours) and has not
    exited: a zombie (exited, not yet reaped by its parent) runs nothing and holds no socket. Shared
    because both sides judge socket files by the pid in their name."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux: the state follows the parenthesised command name, which may itself hold ") "
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def default_socket_dir() -> Path:
    """`$XDG_RUNTIME_DIR/dflash` when that is set (a per-user tmpfs), else `/tmp/dflash-<uid>`."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "dflash"
    return Path(f"/tmp/dflash-{os.getuid()}")


def private_socket_dir(requested: Path) -> Path:
    """Where sockets for a requested socket directory live.

    The directory itself when it is private (ours, no access for group or others) or does not exist
    yet (dflash then creates it 0700); otherwise a private subdirectory ``dflash-<uid>`` in it. dflash
    never changes the mode of a directory it did not create: ``--socket-dir /tmp`` must not make /tmp
    private. Both sides use this rule, so dflash-top looks where the trainer binds.
    """
    try:
        st = os.lstat(requested)
    except OSError:
        return requested
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not stat.S_IMODE(st.st_mode) & 0o077:
        return requested
    return requested / f"dflash-{os.getuid()}"


def owned_by_us(path: Path) -> bool:
    """Whether the file itself (not what a symlink points to) belongs to our uid: a socket someone else
    planted in a directory we read is never served, listed or trusted."""
    try:
        return os.lstat(path).st_uid == os.getuid()
    except OSError:
        return False


_CRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def trusted_uid(uid: int) -> bool:
    """Peers we talk telemetry with, on either side: our own uid, or root."""
    return uid in (os.getuid(), 0)


def socket_filename(run: str, pid: int, rank: int | None = None) -> str:
    """`<run>-<pid>[-r<rank>].sock`, with the run name reduced to safe characters."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run).strip(".") or "run"
    return f"{safe}-{pid}" + (f"-r{rank}" if rank is not None else "") + ".sock"


def parse_socket_filename(name: str) -> SocketName | None:
    """The run, pid and rank encoded in a socket file name, or None for other files."""
    m = _SOCKET_RE.match(name)
    if not m:
        return None
    rank = m.group("rank")
    return SocketName(m.group("run"), int(m.group("pid")), int(rank) if rank is not None else None)


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
    """Our trainer sockets in `directory` (default: ``default_socket_dir()``), oldest run first; where the
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


def read_hello(path: Path, timeout: float = 1.0) -> Hello | None:
    """Connect, read the first frame and hang up: how `--list` and run-dir matching learn who is there."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    deadline = time.monotonic() + timeout
    reader = FrameReader()
    try:
        s.connect(str(path))
        if untrusted_server(s):
            return None
        while time.monotonic() < deadline and (chunk := s.recv(65536)):
            reads = reader.feed(chunk)
            if reads:  # the first line decides: a trainer's first frame is its hello
                frame = reads[0].frame
                return frame if isinstance(frame, Hello) else None
    except OSError:
        return None
    finally:
        s.close()
    return None


def ptrace_scope() -> int | None:
    """Yama's ptrace_scope (0 classic .. 3 no attach), None where Yama is absent: it decides whether
    dflash-top's py-spy may attach to a trainer, which both sides need to explain."""
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


# --------------------------------------------------------------------------- the trainer's side


def ensure_socket_dir(requested: Path) -> Path:
    """The private directory for our sockets (``sockets.private_socket_dir``), created 0700 when missing.

    Refused, in one line: a directory (or a place to make one in) that another user controls. On a
    shared /tmp someone could pre-create /tmp/dflash-<uid> to watch or spoof our sockets, and a shared
    parent without the sticky bit lets anyone replace our subdirectory. The mode of a directory dflash
    did not create is never changed.
    """
    uid = os.getuid()
    path = private_socket_dir(requested)
    if path != requested:
        st = os.stat(requested)
        if not stat.S_ISDIR(st.st_mode):
            raise RuntimeError(
                f"telemetry socket directory {requested} is not a directory; remove it or pass socket_dir")
        if st.st_uid not in (uid, 0):
            raise RuntimeError(f"telemetry socket directory {requested} belongs to uid {st.st_uid}, not to you "
                               f"({uid}); remove it or pass another socket_dir")
        if stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise RuntimeError(f"telemetry socket directory {requested} is writable by others without the sticky "
                               "bit, so anyone could replace dflash's directory in it; chmod +t or 700 it, "
                               "or pass another socket_dir")
    try:
        path.mkdir(mode=0o700, parents=True)
        os.chmod(path, 0o700)  # ours: the umask may have taken bits mkdir asked for
    except FileExistsError:
        pass
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeError(f"telemetry socket directory {path} is not a directory; remove it or pass socket_dir")
    if st.st_uid != uid:
        raise RuntimeError(
            f"telemetry socket directory {path} belongs to uid {st.st_uid}, not to you ({uid}); "
            "remove it or pass another socket_dir"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise RuntimeError(f"telemetry socket directory {path} is open to other users (mode "
                           f"{stat.S_IMODE(st.st_mode):o}); dflash did not create it so: chmod 700 it or remove it")
    return path


def clean_stale_sockets(directory: Path) -> list[Path]:
    """Remove socket files whose owning pid is dead (a trainer killed with SIGKILL leaves one), and any
    that another user put here (root can; nobody else can write a private directory): such a socket
    would be listed next to ours and could serve made-up telemetry."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for p in entries:
        info = parse_socket_filename(p.name)
        if info is None:
            continue
        foreign = not owned_by_us(p)
        if not foreign and (info.pid == os.getpid() or pid_alive(info.pid)):
            continue
        try:
            p.unlink()
            removed.append(p)
            if foreign:
                log.warning("removed %s from the telemetry socket directory: it belongs to another user", p)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove %s telemetry socket %s: %s", "foreign" if foreign else "stale", p, e)
    return removed
