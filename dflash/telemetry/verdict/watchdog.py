"""Stall watchdog: a worker that completes no span for longer than its own history allows is stalled.

It runs on the telemetry publisher thread, once per snapshot, from what `ProfileStats.drain()` already
reports (each worker's innermost open span and the time since it last completed one), so a hung
worker costs the hot path nothing and the watchdog keeps working while every worker is stuck.

The timeout is per worker and category, derived from that category's own history: 10 x the 99th
percentile of its window maxima, never under 30 s (a hung collective or a deadlock lasts minutes; a
slow step lasts a few times its usual length). A category that has never completed gets a longer
grace (a first step compiles kernels and fills caches). `--stall-timeout S` replaces all of this with
one number. A worker blocked on a queue (`*_wait`, `*_put`) is waiting for another worker, not stalled
itself: the stall is reported where the pipeline is stuck.

On a stall it captures every thread's Python stack in-process (`sys._current_frames`, which always
works: no ptrace) and, in a background thread, a native `py-spy dump` where ptrace is permitted; both
go to `<run_dir>/stalls/`. The stall is in every snapshot until the worker completes a span again,
which ends it with a `recovered` event.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from dflash.telemetry.publish.introspection import python_stacks, set_ptracer
from dflash.telemetry.summary import Summary, percentile
from dflash.telemetry.wire.protocol import StackEntry, Stall, ThreadStacks
from dflash.telemetry.wire.table import seconds
from dflash.telemetry.wire.vocab import STALL_DUMP_THREAD, WAIT_SUFFIXES

log = logging.getLogger("dflash.telemetry")

#: the shortest history-derived timeout: below this, slow steps would be called stalls
FLOOR_S = 30.0
#: timeout = FACTOR x the 99th percentile of the category's window maxima
FACTOR = 10.0
#: timeout for a category that has not completed once yet (first step: compilation, cache warm-up)
FIRST_GRACE_S = 300.0
#: window maxima kept per (worker, category)
HISTORY = 512
#: how long a native dump may take before it is abandoned
NATIVE_TIMEOUT_S = 30.0
EmitFn = Callable[..., None]


def frame_text(frame: StackEntry) -> str:
    """`file.py:42 in function`, with the file's last two path parts (enough to find it)."""
    path = Path(frame.file)
    short = "/".join(path.parts[-2:]) if len(path.parts) >= 2 else str(path)
    return f"{short}:{frame.line} in {frame.function}"


_STDLIB = sysconfig.get_paths()["stdlib"]


def where_stuck(frames: list[StackEntry]) -> str:
    """The innermost frame; when that is in the standard library (a lock's or a queue's wait), also
    the first frame of the code that called it, which is the one a reader can act on."""
    if not frames:
        return ""
    text = frame_text(frames[0])
    if frames[0].file.startswith(_STDLIB):
        caller = next((f for f in frames[1:] if not f.file.startswith(_STDLIB)), None)
        if caller is not None:
            text += f" < {frame_text(caller)}"
    return text


def format_stacks(threads: list[ThreadStacks], first: str | None = None) -> str:
    """py-spy-like text: one block per thread, the stalled worker's first."""
    ordered = sorted(threads, key=lambda th: th.name != first)
    blocks = []
    for th in ordered:
        lines = [f'Thread {th.tid} "{th.name}"' + (" (stalled)" if th.name == first else "")]
        lines += [f"    {f.function} ({f.file}:{f.line})" for f in th.frames]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def _pyspy_exe() -> str | None:
    beside = Path(sys.executable).with_name("py-spy")  # the venv's own, when py-spy is installed there
    return str(beside) if beside.exists() else shutil.which("py-spy")


def _allow_own_children_to_ptrace() -> None:
    """Under Yama ptrace_scope=1 a process may only trace its descendants; declaring ourselves our
    own ptracer lets the py-spy we spawn attach to us. (dflash-top asks again before each of its
    dumps, so replacing its grant here costs it nothing.)"""
    if not sys.platform.startswith("linux"):
        return
    try:
        set_ptracer(os.getpid())
    except (OSError, AttributeError):
        pass


def native_dump(path: Path, pid: int | None = None, timeout: float = NATIVE_TIMEOUT_S) -> str:
    """`py-spy dump --native` of `pid` (default: this process) into `path`; returns a one-line outcome.
    A failure (no py-spy, ptrace refused) is written into the file too, so the stall's record says
    why the native stacks are missing."""
    exe = _pyspy_exe()
    pid = os.getpid() if pid is None else pid
    if exe is None:
        outcome = "py-spy is not installed (pip install py-spy); the Python stacks are in the other file"
    else:
        _allow_own_children_to_ptrace()
        try:
            r = subprocess.run([exe, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                               timeout=timeout)
            if r.returncode == 0:
                path.write_text(r.stdout)
                return f"native stacks in {path}"
            err = (r.stderr.strip() or r.stdout.strip()).splitlines()
            outcome = f"py-spy dump failed: {err[-1] if err else f'exit {r.returncode}'}"
        except subprocess.TimeoutExpired:
            outcome = f"py-spy dump did not finish in {timeout:g} s"
        except OSError as e:
            outcome = f"py-spy dump could not run: {e}"
    try:
        path.write_text(outcome + "\n")
    except OSError:
        pass
    return outcome


class Watchdog:
    """Decides, once per published window, which workers are stalled; reports each stall once and its
    end once. Call `check()` from the publisher thread only."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        timeout: float | None = None,
        *,
        floor_s: float = FLOOR_S,
        factor: float = FACTOR,
        first_grace_s: float = FIRST_GRACE_S,
        native: bool = True,
        emit: EmitFn | None = None,
        on_stall: Callable[[Stall], None] | None = None,
        rank: int | None = None,
    ) -> None:
        """`timeout`: fixed seconds for every worker (`--stall-timeout`); None derives it from history;
        0 is refused (the caller simply does not create a watchdog). `emit(kind, message, **data)`
        publishes an event; `on_stall` is called once per new stall (e.g. `--on-stall exit`). `rank`: this
        process's global rank in a multi-rank run (None in a single process), put in the stack files' names."""
        if timeout is not None and timeout <= 0:
            raise ValueError("a watchdog timeout must be positive (0 means: no watchdog)")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.timeout = timeout
        self.floor_s, self.factor, self.first_grace_s = floor_s, factor, first_grace_s
        self.native = native
        self.emit = emit
        self.on_stall = on_stall
        self.rank = rank
        self._maxima: dict[tuple[str, str], collections.deque[float]] = {}
        self._active: dict[str, Stall] = {}
        self._native_threads: list[threading.Thread] = []

    # --- thresholds ---------------------------------------------------------------------------------

    def learn(self, summary: Summary) -> None:
        """Add this window's span maxima to each category's history."""
        for worker, cats in summary.workers.items():
            for cat, st in cats.items():
                if st.n and math.isfinite(st.max):
                    q = self._maxima.get((worker, cat))
                    if q is None:
                        q = self._maxima[(worker, cat)] = collections.deque(maxlen=HISTORY)
                    q.append(st.max)

    def timeout_for(self, worker: str, category: str | None) -> tuple[float, str]:
        """(seconds, how they were chosen) for `worker` inside `category` (None: between spans, where
        the worker's slowest category sets the limit)."""
        if self.timeout is not None:
            return self.timeout, "--stall-timeout"
        if category is not None:
            hist: Iterable[float] = self._maxima.get((worker, category), ())
        else:
            hist = [v for (w, _), q in self._maxima.items() if w == worker for v in q]
        values = sorted(hist)
        if not values:
            return max(self.first_grace_s, self.floor_s), "first-step grace"
        return max(self.floor_s, self.factor * percentile(values, 0.99)), "history"

    # --- the check ----------------------------------------------------------------------------------

    @property
    def stalled(self) -> list[Stall]:
        return list(self._active.values())

    def check(self, summary: Summary, live: set[str] | None = None) -> list[Stall]:
        """Update from one drained window; returns the stalls in force now (also put on the summary).
        `live`: names of the threads that exist now; a worker whose thread has ended is not watched."""
        self.learn(summary)
        now = summary.t
        for worker, idle in summary.since_done.items():
            if live is not None and worker not in live:
                self._end(worker, now, "its thread ended")
                continue
            op = summary.inflight.get(worker)
            if op is not None and op.category.endswith(WAIT_SUFFIXES):
                self._end(worker, now, f"now waiting in {op.category}")
                continue
            category = op.category if op is not None else None
            # since_done has one window's resolution; the open span's age is exact
            elapsed = min(op.elapsed, idle) if op is not None else idle
            timeout, basis = self.timeout_for(worker, category)
            if elapsed <= timeout:
                self._end(worker, now, "completed a span")
                continue
            st = self._active.get(worker)
            if st is not None and st.category == (category or ""):
                st.elapsed = elapsed
                continue
            self._end(worker, now, "moved on")
            self._begin(worker, category or "", elapsed, timeout, basis, now)
        for worker in [w for w in self._active if w not in summary.since_done]:
            self._end(worker, now, "it is gone")
        summary.stalls = self.stalled
        return summary.stalls

    def _begin(self, worker: str, category: str, elapsed: float, timeout: float, basis: str, now: float) -> None:
        threads = python_stacks()
        mine = next((th for th in threads if th.name == worker), None)
        frame = where_stuck(mine.frames) if mine is not None else ""
        where = f"in {category}" if category else "between spans"
        stack_file = self._write(worker, where, elapsed, timeout, basis, now, threads)
        st = Stall(worker=worker, category=category, elapsed=elapsed, timeout=timeout, basis=basis, since=now,
                   frame=frame, stack_file=str(stack_file) if stack_file is not None else None)
        self._active[worker] = st
        msg = (f"{worker} stalled {where} for {seconds(elapsed)} (timeout {seconds(timeout)}, "
               f"{basis})" + (f" at {frame}" if frame else "") + (f"; stacks in {stack_file}" if stack_file else ""))
        if self.emit is None:
            log.warning(msg)
        else:
            self.emit("stall", msg, worker=worker, category=category, elapsed=round(elapsed, 3),
                      timeout=round(timeout, 3), frame=frame, stack_file=st.stack_file)
        if self.on_stall is not None:
            try:
                self.on_stall(st)
            except Exception:
                log.exception("on_stall hook failed")

    def _end(self, worker: str, now: float, why: str) -> None:
        st = self._active.pop(worker, None)
        if st is None:
            return
        where = f"in {st.category}" if st.category else "between spans"
        lasted = st.elapsed + max(0.0, now - st.since)
        msg = f"{worker} recovered: {why} after about {seconds(lasted)} stalled {where}"
        if self.emit is None:
            log.warning(msg)
        else:
            self.emit("recovered", msg, worker=worker, category=st.category, stalled_s=round(lasted, 3))

    def _write(self, worker: str, where: str, elapsed: float, timeout: float, basis: str, now: float,
               threads: list[ThreadStacks]) -> Path | None:
        if self.run_dir is None:
            return None
        d = self.run_dir / "stalls"
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in worker)
        if self.rank is not None:
            # The ranks share one run directory and have the same worker names; a hung collective stalls
            # them all within the same second, and without the rank one rank's stacks overwrote another's.
            safe = f"r{self.rank}-{safe}"
        path = d / f"{stamp}-{safe}-python.txt"
        header = (f"{worker} stalled {where} for {elapsed:.1f} s (timeout {timeout:.1f} s, {basis}); "
                  f"pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(now))}\n\n")
        try:
            d.mkdir(parents=True, exist_ok=True)
            path.write_text(header + format_stacks(threads, first=worker))
        except OSError as e:
            log.warning("cannot write stall stacks to %s: %s", d, e)
            return None
        if self.native:
            native = d / f"{stamp}-{safe}-native.txt"
            t = threading.Thread(target=native_dump, args=(native,), name=STALL_DUMP_THREAD, daemon=True)
            t.start()
            self._native_threads = [x for x in self._native_threads if x.is_alive()] + [t]
        return path

    def join_dumps(self, timeout: float = NATIVE_TIMEOUT_S) -> None:
        """Wait for native dumps still running (tests, and a clean exit after --on-stall exit)."""
        deadline = time.monotonic() + timeout
        for t in self._native_threads:
            t.join(max(0.0, deadline - time.monotonic()))
