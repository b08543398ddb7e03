"""The two profiling jobs the keys start (`s`/`t`: a stack snapshot, `r`: a py-spy recording), as plain
functions the app runs on a worker thread.

Each returns its result, a report or the reason it failed, and never raises: the app posts whatever
comes back as one message, so a failure is shown on the stacks screen instead of killing a thread.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dflash_tui.pyspy import (
    Ask,
    ProfileFailure,
    PySpyError,
    RecordReport,
    StackReport,
    hot_thread_snapshot,
    record,
    save_report,
)
from dflash_tui.sources import LiveLink


@dataclass
class RecordSettings:
    """What the record dialog asks: how long, and py-spy's --gil and --native."""

    seconds: float
    gil: bool
    native: bool


def take_snapshot(pid: int, *, local: bool, ask: Ask | None, cpu: dict[int, float], names: dict[int, str],
                  exe: str | None, timeout: float, force_trainer: bool,
                  run_dir: str | None) -> StackReport | ProfileFailure:
    """A hot-thread snapshot (py-spy, or the trainer's own stacks: see `hot_thread_snapshot`), saved next
    to the run; a failed save is a note on the report, not a failure."""
    try:
        result = hot_thread_snapshot(pid, local=local, ask=ask, cpu=cpu, names=names, exe=exe, timeout=timeout,
                                     force_trainer=force_trainer)
        try:
            save_report(result, run_dir)
        except OSError as e:
            result.notes.append(f"could not save the snapshot: {e}")
        return result
    except PySpyError as e:
        return e.failure
    except Exception as e:  # noqa: BLE001 - a bug here must show up as a message, not kill the app
        return ProfileFailure(what="snapshot", reason=f"unexpected error: {e!r}")


def take_record(link: LiveLink | None, pid: int, settings: RecordSettings, *, exe: str | None, run_dir: str | None,
                request_timeout: float) -> RecordReport | ProfileFailure:
    """py-spy record of `pid`, after asking the trainer (when there is one: `link`; a process sampled from
    outside has none) to let this process trace it (Yama ptrace scope 1)."""
    try:
        try:
            if link is not None:
                link.request("ptrace_allow", {"pid": os.getpid()}, timeout=request_timeout)
        except Exception:  # noqa: BLE001 - best effort, py-spy may be allowed anyway
            pass
        return record(pid, settings.seconds, gil=settings.gil, native=settings.native, exe=exe, run_dir=run_dir)
    except PySpyError as e:
        return e.failure
    except Exception as e:  # noqa: BLE001
        return ProfileFailure(what="py-spy record", reason=f"unexpected error: {e!r}")
