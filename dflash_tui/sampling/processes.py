"""Python processes on this machine that use torch: what `dflash-top` offers to sample when no dflash
trainer answers on a socket, and what `--pid` checks before it starts."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import psutil

#: what a process that imported torch has mapped (the CPU and CUDA builds alike)
_TORCH_LIBRARY = ("/torch/lib/libtorch", "/torch/_C.")
#: read at most this much of a process's memory map (a trainer's holds a few thousand lines)
_MAPS_LIMIT = 16 * 1024 * 1024


@dataclass(frozen=True)
class TorchProcess:
    pid: int
    #: its command line, shortened for a one-line list
    command: str
    user: str = ""
    started: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.pid:>8}  {self.user:<10.10} {self.command}"


def uses_torch(pid: int) -> bool:
    """Whether the process has torch's library mapped (it imported torch); False when we cannot look."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            maps = f.read(_MAPS_LIMIT)
    except OSError:
        return False
    return any(lib.encode() in maps for lib in _TORCH_LIBRARY)


def command_line(proc: psutil.Process, width: int = 80) -> str:
    """`python train.py --lr 3e-4`: the interpreter's name, then its arguments, cut at `width`."""
    try:
        argv = proc.cmdline()
    except (psutil.Error, OSError):
        return "?"
    if not argv:
        return proc.name() if proc.is_running() else "?"
    # an argument on several lines (`python -c '...'`) is folded onto one
    args = [" ".join(a.split()) for a in argv[1:]]
    text = " ".join([Path(argv[0]).name, *(shlex.quote(a) if " " in a else a for a in args)])
    return text if len(text) <= width else text[: width - 1] + "…"


def describe(pid: int) -> TorchProcess | None:
    """The process behind `pid` (None: no such process, or not ours to see)."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return TorchProcess(pid=pid, command=command_line(proc), user=proc.username(),
                                started=proc.create_time())
    except (psutil.Error, OSError):
        return None


def torch_processes() -> list[TorchProcess]:
    """Every Python process here (not this one) that imported torch, oldest first."""
    found = []
    for proc in psutil.process_iter(["pid", "exe", "name"]):
        pid = proc.info["pid"]
        # the interpreter's path: a console script's process is named for the script (`dflash`, `speculators`)
        interpreter = Path(proc.info["exe"] or proc.info["name"] or "").name.lower()
        if pid == os.getpid() or "python" not in interpreter or not uses_torch(pid):
            continue
        p = describe(pid)
        if p is not None:
            found.append(p)
    return sorted(found, key=lambda p: p.started)
