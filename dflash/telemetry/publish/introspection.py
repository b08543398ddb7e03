"""What the trainer can say about its own threads without help: their names, their Python stacks, and
who may trace them.

The telemetry server answers `stacks` and `ptrace_allow` requests with these, and the watchdog writes
the same stacks to disk when a worker stalls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from typing import Any

from dflash.telemetry.wire.protocol import StackEntry, ThreadStacks
from dflash.telemetry.wire.sockets import ptrace_scope

#: prctl option of Yama: "this pid (and its descendants) may ptrace me"
PR_SET_PTRACER = 0x59616D61


def set_ptracer(pid: int) -> int:
    """Let `pid` and its descendants ptrace this process under Yama ptrace_scope=1; prctl's return
    code (0 on success; errno then says why not)."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def thread_map() -> dict[int, str]:
    """native thread id -> Python thread name, for every live Python thread."""
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def python_stacks(max_depth: int = 128) -> list[ThreadStacks]:
    """Every Python thread's stack, innermost frame first (as py-spy dump prints it): the fallback
    view when py-spy cannot attach."""
    threads = {t.ident: t for t in threading.enumerate()}
    out = []
    frames = sys._current_frames()
    try:
        for ident, frame in frames.items():
            t = threads.get(ident)
            stack = []
            f = frame
            while f is not None and len(stack) < max_depth:
                code = f.f_code
                stack.append(StackEntry(file=code.co_filename, line=f.f_lineno or 0, function=code.co_name))
                f = f.f_back
            out.append(ThreadStacks(tid=(t.native_id if t is not None else None) or 0, ident=ident,
                                    name=t.name if t is not None else f"thread-{ident}",
                                    daemon=bool(t.daemon) if t is not None else False, frames=stack))
    finally:
        del frames  # frames keep their locals alive
    out.sort(key=lambda d: (d.name != "MainThread", d.name))
    return out


def ptrace_allow(peer_pid: int, peer_uid: int) -> tuple[bool, dict[str, Any], str | None]:
    """Let `peer_pid` (and its children, e.g. the py-spy it spawns) ptrace this process on Yama
    systems with ptrace_scope=1. EINVAL means Yama is not restricting ptrace: nothing to do."""
    scope = ptrace_scope()
    data: dict[str, Any] = {"pid": peer_pid, "ptrace_scope": scope}
    if scope == 3:
        return False, data, "ptrace_scope=3: ptrace is disabled on this machine; use the 'stacks' request"
    if scope == 2 and peer_uid != 0:
        return False, data, "ptrace_scope=2: only root (CAP_SYS_PTRACE) may attach; run py-spy with sudo"
    if not sys.platform.startswith("linux"):
        return True, {**data, "message": "not needed: no Yama on this platform"}, None
    rc = set_ptracer(peer_pid)
    if rc == 0:
        return True, {**data, "message": f"pid {peer_pid} and its children may now ptrace pid {os.getpid()}"}, None
    err = ctypes.get_errno()
    if err == errno.EINVAL:
        return True, {**data, "message": "not needed: Yama ptrace restrictions are not active"}, None
    return False, data, f"prctl(PR_SET_PTRACER) failed: {os.strerror(err)}"
