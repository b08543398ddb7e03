"""Hot-thread snapshots: run py-spy against the trainer, parse it, join it with per-thread CPU.

This is the one-key version of what the DFlash team did by hand: `py-spy dump --native` next to
`top -H`, matching threads by their native id to see that the hot threads were target workers in
CUDA launches rather than Python queue code. Everything here blocks (subprocesses, a socket
request), so the app calls it from a background thread; every subprocess has a timeout and is killed
when it passes, so a stuck py-spy can never freeze the UI. No Textual imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash.telemetry.wire.protocol import ProtocolError, Reply, Stacks, stacks_of
from dflash.telemetry.wire.sockets import pid_alive, ptrace_scope
from dflash.telemetry.wire.vocab import TELEMETRY_LOOPS, TELEMETRY_THREADS

#: ask the trainer something and get its reply; raises on failure (LiveSource.request)
Ask = Callable[[str, dict[str, Any]], Reply]


@dataclass
class StackFrame:
    name: str
    filename: str
    line: int
    short: str = ""

    def where(self, full: bool = False) -> str:
        f = self.filename if full or not self.short else self.short
        return f"{f}:{self.line}" if self.line else f


@dataclass
class ThreadStack:
    """One thread's stack, innermost frame last (as a Python traceback reads)."""

    tid: int | None
    name: str
    frames: list[StackFrame]
    active: bool | None = None
    owns_gil: bool | None = None
    cpu_percent: float | None = None


@dataclass
class StackReport:
    """A finished snapshot: where it came from, the threads hottest first, and where it was saved."""

    pid: int
    source: str  # "py-spy --native", "py-spy" or "trainer stacks"
    threads: list[ThreadStack]
    t: float = field(default_factory=time.time)
    notes: list[str] = field(default_factory=list)
    saved: list[str] = field(default_factory=list)


@dataclass
class ProfileFailure:
    """Why a snapshot/recording failed and what the user can do; `permission` offers the trainer's stacks."""

    what: str
    reason: str
    fix: list[str] = field(default_factory=list)
    permission: bool = False
    can_ask_trainer: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class FunctionStat:
    name: str
    where: str
    self_samples: int
    total_samples: int
    #: a Python function (else a native frame: C/C++/CUDA, or raw addresses of one library)
    python: bool = True


@dataclass
class RecordReport:
    pid: int
    seconds: float
    gil: bool
    native: bool
    path: str
    samples: int
    top: list[FunctionStat]
    threads: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


class PySpyError(Exception):
    def __init__(self, failure: ProfileFailure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


# --------------------------------------------------------------------------- locating py-spy


def find_pyspy() -> str | None:
    """py-spy on PATH, else next to this interpreter (a venv's bin/ is often not on PATH over ssh)."""
    exe = shutil.which("py-spy")
    if exe:
        return exe
    candidate = Path(sys.executable).parent / "py-spy"
    return str(candidate) if candidate.exists() else None


def pid_is_local(pid: int, host: str | None) -> bool:
    """Whether `pid` names the trainer on this machine (a socket forwarded with ssh -L does not)."""
    if host and host not in (socket.gethostname(), socket.getfqdn()):
        return False
    return pid_alive(pid)


_SCOPE_MEANING = {0: "classic: any process of the same user", 1: "restricted: only a parent may attach",
                  2: "admin-only: needs CAP_SYS_PTRACE", 3: "no attach at all, even for root"}


def permission_fix(pid: int) -> list[str]:
    """The ways out of a refused ptrace, most specific first."""
    scope = ptrace_scope()
    fixes: list[str] = []
    if scope is not None:
        fixes.append(f"kernel.yama.ptrace_scope is {scope} ({_SCOPE_MEANING.get(scope, '?')}); allow attaching "
                     "for this boot with: echo 0 | sudo tee /proc/sys/kernel/yama/ptrace_scope")
    else:
        fixes.append("if kernel.yama.ptrace_scope is above 0: echo 0 | sudo tee /proc/sys/kernel/yama/ptrace_scope")
    fixes.append('run dflash-top as root: sudo env "PATH=$PATH" dflash-top')
    fixes.append("in a container, start it with --cap-add SYS_PTRACE (docker/podman run)")
    fixes.append("or press t for the trainer's own Python stacks (no ptrace; Python frames only, no CPU join)")
    return fixes


# --------------------------------------------------------------------------- running py-spy


def start_pyspy(exe: str, args: list[str]) -> subprocess.Popen:
    """py-spy started in its own process group (so that killing it kills all of it)."""
    return subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def kill_pyspy(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.communicate()


def wait_pyspy(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a started py-spy; past `timeout` kill its group, raise TimeoutError."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_pyspy(proc)
        raise TimeoutError(f"py-spy did not finish within {timeout:g} s and was killed") from None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def run_pyspy(exe: str, args: list[str], timeout: float) -> tuple[int, str, str]:
    """Run py-spy in its own process group; on timeout kill the group and raise TimeoutError."""
    return wait_pyspy(start_pyspy(exe, args), timeout)


def record_args(pid: int, seconds: float, out: Path, *, rate: int, gil: bool = False, native: bool = False,
                idle: bool = False) -> list[str]:
    """`py-spy record` to a speedscope file: `--gil` only the GIL holder's samples, `--idle` waiting threads
    too. Native unwinding needs the target paused per sample; Python-only sampling need not pause it."""
    args = ["record", "--pid", str(pid), "--duration", str(max(1, round(seconds))), "--rate", str(rate),
            "--format", "speedscope", "--output", str(out)]
    args += ["--gil"] if gil else []
    args += ["--idle"] if idle else []
    return [*args, "--native" if native else "--nonblocking"]


def _first_line(text: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("py-spy>"):
            return line
    return text.strip()[:200]


def _is_permission(err: str) -> bool:
    e = err.lower()
    return any(s in e for s in ("permission denied", "operation not permitted", "os error 1)", "os error 13", "eperm"))


def _is_gone(err: str) -> bool:
    e = err.lower()
    return any(s in e for s in ("no such process", "os error 3)", "failed to find process",
                                "check that the process is running"))


def classify(err: str, pid: int, what: str) -> ProfileFailure:
    """Turn py-spy's stderr into a reason and a fix the user can act on."""
    line = _first_line(err)
    if _is_permission(err):
        return ProfileFailure(what=what, reason=f"not permitted to attach to pid {pid} (ptrace refused): {line}",
                              fix=permission_fix(pid), permission=True, can_ask_trainer=True)
    if _is_gone(err):
        return ProfileFailure(what=what, reason=f"pid {pid} is not running on this host: {line}",
                              fix=["if the socket was forwarded (ssh -L), run dflash-top on the training box",
                                   "or press t for the trainer's own Python stacks"], can_ask_trainer=True)
    return ProfileFailure(what=what, reason=f"py-spy failed: {line}", can_ask_trainer=True,
                          fix=["press t for the trainer's own Python stacks"])


def parse_dump(text: str) -> list[ThreadStack]:
    """py-spy's `dump --json` (frames innermost first) as ThreadStacks (innermost last)."""
    data = json.loads(text)
    threads: list[ThreadStack] = []
    for t in data:
        frames = [StackFrame(name=str(f.get("name", "?")), filename=str(f.get("filename", "?")),
                             line=int(f.get("line") or 0), short=str(f.get("short_filename") or ""))
                  for f in t.get("frames", [])]
        frames.reverse()
        while frames and frames[0].name.startswith("0x"):  # unnamed libc/pthread entry frames: noise
            frames.pop(0)
        threads.append(ThreadStack(tid=t.get("os_thread_id"), name=t.get("thread_name") or "",
                                   frames=frames, active=t.get("active"), owns_gil=t.get("owns_gil")))
    return threads


def trainer_threads(stacks: Stacks) -> list[ThreadStack]:
    """The threads of the trainer's own `stacks` reply, frames innermost last like parse_dump."""
    return [ThreadStack(tid=t.tid or None,  # 0: the trainer could not tell its native id
                        name=t.name,
                        frames=[StackFrame(name=f.function, filename=f.file, line=f.line, short=short_path(f.file))
                                for f in reversed(t.frames)])
            for t in stacks.threads]


#: where an installed module's importable path starts
_IMPORT_ROOTS = re.compile(r".*/(?:site-packages|dist-packages|lib/python\d+\.\d+)/")


def short_path(file: str) -> str:
    """A source file as py-spy's short names read: from its import root (`dflash/train/run/stages.py`,
    `torch/nn/modules/module.py`), else its last three parts; a bare `stages.py` could be anyone's."""
    m = _IMPORT_ROOTS.match(file)
    if m:
        return file[m.end():]
    path = Path(file)
    # a checkout (an editable install): up through the packages' own directories, when they are here
    top = path.parent
    while (top / "__init__.py").is_file() and top.parent != top:
        top = top.parent
    if top != path.parent:
        return path.relative_to(top).as_posix()
    return "/".join(path.parts[-3:])


def join_cpu(threads: list[ThreadStack], cpu: dict[int, float], names: dict[int, str]) -> list[ThreadStack]:
    """Attach each thread's CPU% (by native id) and sort hottest first; unknown CPU sorts last."""
    for t in threads:
        if t.tid is not None:
            t.cpu_percent = cpu.get(t.tid, t.cpu_percent)
            if not t.name:
                t.name = names.get(t.tid, "")
    return sorted(threads, key=lambda t: (-(t.cpu_percent if t.cpu_percent is not None else -1.0),
                                          not t.active, not t.owns_gil))


def dump(pid: int, exe: str, timeout: float = 10.0) -> tuple[list[ThreadStack], str, list[str]]:
    """py-spy dump, native first then Python-only; returns (threads, source label, notes)."""
    notes: list[str] = []
    try:
        rc, out, err = run_pyspy(exe, ["dump", "--json", "--native", "--pid", str(pid)], timeout)
    except TimeoutError as e:
        raise PySpyError(ProfileFailure(what="py-spy dump", reason=str(e), can_ask_trainer=True,
                                        fix=["the trainer may be stuck in a system call; press t for its "
                                             "own Python stacks", "raise --pyspy-timeout"])) from None
    if rc == 0:
        try:
            return parse_dump(out), "py-spy --native", notes
        except (ValueError, TypeError) as e:
            notes.append(f"native dump unreadable ({e}); retried without --native")
    else:
        if _is_permission(err) or _is_gone(err):
            raise PySpyError(classify(err, pid, "py-spy dump"))
        notes.append(f"native unwinding failed ({_first_line(err)}); showing Python frames only")
    try:
        rc, out, err = run_pyspy(exe, ["dump", "--json", "--pid", str(pid)], timeout)
    except TimeoutError as e:
        raise PySpyError(ProfileFailure(what="py-spy dump", reason=str(e), can_ask_trainer=True,
                                        fix=["press t for the trainer's own Python stacks"], notes=notes)) from None
    if rc != 0:
        failure = classify(err, pid, "py-spy dump")
        failure.notes = notes
        raise PySpyError(failure)
    try:
        return parse_dump(out), "py-spy", notes
    except (ValueError, TypeError) as e:
        raise PySpyError(ProfileFailure(what="py-spy dump", reason=f"could not parse py-spy output: {e}",
                                        can_ask_trainer=True, notes=notes)) from None


def hot_thread_snapshot(pid: int, *, local: bool, ask: Ask | None, cpu: dict[int, float],
                        names: dict[int, str], exe: str | None, timeout: float = 10.0,
                        force_trainer: bool = False) -> StackReport:
    """The `s` key: py-spy when we can attach, else (or when asked) the trainer's own stacks.

    Raises PySpyError with a ProfileFailure that explains what went wrong and how to fix it.
    """
    notes: list[str] = []
    if force_trainer or not local:
        if ask is None:
            raise PySpyError(ProfileFailure(what="stacks", reason="no live trainer to ask for its stacks"))
        if not local:
            notes.append(f"pid {pid} is not on this host: showing the trainer's own Python stacks")
        return trainer_stacks(pid, ask, cpu, names, notes)
    if exe is None:
        raise PySpyError(ProfileFailure(what="py-spy dump", reason="py-spy is not installed",
                                        fix=["pip install py-spy (it ships with dflash-trainer)",
                                             "or press t for the trainer's own Python stacks"],
                                        can_ask_trainer=ask is not None))
    if ask is not None:
        try:
            reply = ask("ptrace_allow", {"pid": os.getpid()})
            if not reply.ok:
                notes.append(f"trainer could not allow ptrace: {reply.error}")
        except Exception as e:  # noqa: BLE001 - best effort: py-spy may still be permitted
            notes.append(f"ptrace_allow request failed: {e}")
    try:
        threads, label, dump_notes = dump(pid, exe, timeout)
    except PySpyError as e:
        e.failure.notes = notes + e.failure.notes
        e.failure.can_ask_trainer = e.failure.can_ask_trainer and ask is not None
        raise
    return StackReport(pid=pid, source=label, threads=join_cpu(threads, cpu, names), notes=notes + dump_notes)


def trainer_stacks(pid: int, ask: Ask, cpu: dict[int, float], names: dict[int, str],
                   notes: list[str] | None = None) -> StackReport:
    try:
        reply = ask("stacks", {})
    except Exception as e:  # noqa: BLE001 - RequestFailed, OSError: all mean "no answer"
        raise PySpyError(ProfileFailure(what="stacks", reason=f"the trainer did not send its stacks: {e}")) from None
    if not reply.ok:
        raise PySpyError(ProfileFailure(what="stacks", reason=f"the trainer refused `stacks`: {reply.error}"))
    try:
        threads = trainer_threads(stacks_of(reply))
    except ProtocolError as e:
        raise PySpyError(ProfileFailure(what="stacks", reason=f"the trainer's stacks: {e}")) from None
    return StackReport(pid=pid, source=TRAINER_STACKS, threads=join_cpu(threads, cpu, names),
                       notes=list(notes or []))


# --------------------------------------------------------------------------- reports on disk


def format_report(report: StackReport, full_paths: bool = True) -> str:
    """A readable text dump: hottest threads first, each stack innermost frame last."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.t))
    lines = [f"{report.source} of pid {report.pid} at {when}"]
    lines += [f"note: {n}" for n in report.notes]
    for t in report.threads:
        lines.append("")
        lines.append(thread_title(t))
        if not t.frames:
            lines.append("    (no Python frames)")
        for f in t.frames:
            lines.append(f"    {f.where(full_paths)}  {f.name}")
    return "\n".join(lines) + "\n"


#: StackReport.source of the trainer's own stacks (the others name py-spy)
TRAINER_STACKS = "trainer stacks"


def thread_title(t: ThreadStack) -> str:
    cpu = f"{t.cpu_percent:5.1f}%" if t.cpu_percent is not None else "    -%"
    flags = "".join([" active" if t.active else "", " gil" if t.owns_gil else "",
                     TELEMETRY_MARK if t.name in TELEMETRY_THREADS else ""])
    return f"{cpu}  tid {t.tid if t.tid is not None else '?'}  {t.name or '(unnamed)'}{flags}"


def output_dir(run_dir: str | None, kind: str = "pyspy") -> Path:
    """`<run_dir>/<kind>` (`pyspy`, or `stacks` for the trainer's own) when the run directory is here
    and writable, else a per-user cache directory."""
    if run_dir:
        d = Path(run_dir) / kind
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            pass
    d = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dflash-top" / kind
    d.mkdir(parents=True, exist_ok=True)
    return d


def stamp(t: float) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(t)) + f"-{int((t % 1) * 1000):03d}"


def save_report(report: StackReport, run_dir: str | None) -> list[Path]:
    """Write `pyspy/<time>.json` (the data) and `<time>.txt` (format_report) and record their paths; the
    trainer's own stacks go to `stacks/` (py-spy had nothing to do with them)."""
    d = output_dir(run_dir, "stacks" if report.source == TRAINER_STACKS else "pyspy")
    base = d / stamp(report.t)
    js, txt = base.with_suffix(".json"), base.with_suffix(".txt")
    js.write_text(json.dumps(asdict(report), indent=1))
    txt.write_text(format_report(report))
    report.saved = [str(js), str(txt)]
    return [js, txt]


# --------------------------------------------------------------------------- py-spy record


_ADDRESS = re.compile(r"^(0x)?[0-9a-fA-F]{6,}$")


def short_native_name(name: str) -> str:
    """A C++ symbol a person can read: template arguments and parameter lists folded to `<…>` and
    `(…)`, and only the last two scopes kept (`at::native::add_kernel<…>` stays recognisable; the
    full name is in the speedscope file)."""
    out, depth = [], 0
    for ch in name:
        if ch in "<(":
            if depth == 0:
                out.append(ch + "…" + (">" if ch == "<" else ")"))
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    short = "".join(out).strip()
    scopes = [sc for sc in short.split("::") if sc != "(…)"]  # "(anonymous namespace)" says nothing
    return "::".join(scopes[-2:]) if len(scopes) > 2 else short


def frame_key(frame: dict) -> tuple[str, str, bool]:
    """(name, where, is_python) of a speedscope frame. Python frames keep file:line; native symbols
    are shortened; raw addresses (no symbol) are grouped as one entry per library."""
    name, file = str(frame.get("name", "?")), str(frame.get("file") or "")
    base = Path(file).name
    native = ".so" in base or base.endswith((".dll", ".dylib")) or _ADDRESS.match(name) is not None
    if not native and (file.endswith((".py", ".pyx")) or file.startswith("<") or frame.get("line")):
        return name, (f"{Path(file).name}:{frame.get('line')}" if frame.get("line") else Path(file).name), True
    lib = Path(file).name if file else "?"
    if _ADDRESS.match(name) or name in ("?", ""):
        return f"[{lib}] (no symbols)", lib, False
    return short_native_name(name), lib, False


#: appended to a thread of dflash's own telemetry (the publisher, the GIL probe) in a record's summary
TELEMETRY_MARK = " (dflash telemetry)"


def parse_speedscope(path: Path, limit: int = 25) -> tuple[list[FunctionStat], int, dict[str, int]]:
    """Top functions of a speedscope file: (Python functions first, then native ones, each by self
    samples; total sample count; samples per thread). Frames that read the same after shortening
    (all raw addresses of one library, one template's instantiations) count as one. Stacks through
    dflash's own telemetry loops are left out of the functions (the monitor is not the trainer's
    work), and a thread made mostly of them is named with TELEMETRY_MARK."""
    data = json.loads(Path(path).read_text())
    frames = data.get("shared", {}).get("frames", [])
    keys = [frame_key(f) if isinstance(f, dict) else ("?", "", False) for f in frames]
    own = {i for i, f in enumerate(frames)
           if isinstance(f, dict) and str(f.get("file") or "").replace("\\", "/").endswith(TELEMETRY_LOOPS)}
    self_n: Counter[tuple[str, str, bool]] = Counter()
    total_n: Counter[tuple[str, str, bool]] = Counter()
    per_thread: dict[str, int] = {}
    samples = 0
    for prof in data.get("profiles", []):
        n = mine = 0
        for stack in prof.get("samples", []):
            n += 1
            stack = [i for i in stack if isinstance(i, int) and 0 <= i < len(keys)]
            if own.intersection(stack):
                mine += 1
            elif stack:
                self_n[keys[stack[-1]]] += 1  # speedscope stacks are root first
                for key in {keys[i] for i in stack}:
                    total_n[key] += 1
        per_thread[str(prof.get("name", "?")) + (TELEMETRY_MARK if mine * 2 > n else "")] = n
        samples += n
    ranked = sorted(total_n, key=lambda k: (not k[2], -self_n[k], -total_n[k]))
    top = [FunctionStat(name=k[0], where=k[1], self_samples=self_n[k], total_samples=total_n[k], python=k[2])
           for k in ranked]
    py = [f for f in top if f.python][:limit]
    return py + [f for f in top if not f.python][:limit], samples, per_thread


def record(pid: int, seconds: float, *, gil: bool, native: bool, exe: str | None, run_dir: str | None,
           rate: int = 100, grace_s: float = 15.0) -> RecordReport:
    """`py-spy record` for `seconds`, saved as speedscope under pyspy/, summarized by top functions."""
    if exe is None:
        raise PySpyError(ProfileFailure(what="py-spy record", reason="py-spy is not installed",
                                        fix=["pip install py-spy"]))
    t = time.time()
    out = output_dir(run_dir) / f"{stamp(t)}-record.speedscope.json"
    notes: list[str] = []

    def attempt(native_: bool) -> tuple[int, str]:
        args = record_args(pid, seconds, out, rate=rate, gil=gil, native=native_)
        try:
            rc, _, err = run_pyspy(exe, args, timeout=seconds + grace_s)
        except TimeoutError as e:
            raise PySpyError(ProfileFailure(what="py-spy record", reason=str(e))) from None
        return rc, err

    rc, err = attempt(native)
    if rc != 0 and native and not (_is_permission(err) or _is_gone(err)):
        notes.append(f"native recording failed ({_first_line(err)}); recorded Python frames only")
        native = False
        rc, err = attempt(False)
    if rc != 0 or not out.exists():
        raise PySpyError(classify(err, pid, "py-spy record"))
    top, samples, per_thread = parse_speedscope(out)
    if samples == 0:
        notes.append("no samples: the threads were idle" + (" or never held the GIL" if gil else ""))
    own = sum(n for name, n in per_thread.items() if name.endswith(TELEMETRY_MARK))
    if own:
        notes.append(f"{own} of {samples} samples ({own / samples:.0%}) in dflash's own telemetry threads (the "
                     "publisher, the GIL probe): left out of the functions")
    return RecordReport(pid=pid, seconds=seconds, gil=gil, native=native, path=str(out), samples=samples,
                        top=top, threads=per_thread, notes=notes)
