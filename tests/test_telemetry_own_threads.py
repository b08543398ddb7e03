"""dflash's own telemetry threads (the publisher, the GIL probe) are the monitor's work, not the trainer's:
left out of a py-spy record's functions and marked in its threads and in the threads panel."""

from __future__ import annotations

import json
from pathlib import Path

from dflash.telemetry.wire import protocol as P
from dflash.telemetry.wire.vocab import GIL_PROBE_THREAD, PUBLISHER_THREAD
from dflash_tui.pyspy import TELEMETRY_MARK, ThreadStack, parse_speedscope, thread_title
from dflash_tui.state import RunState
from dflash_tui.widgets.threads import threads_text


def test_a_record_leaves_the_gil_probe_out_of_the_functions_and_marks_its_thread(tmp_path: Path) -> None:
    """In a real `make train` record GilProbe._run was the third-hottest function (13.9% of samples)."""
    frames = [
        {"name": "run", "file": "/usr/lib/python3.11/threading.py", "line": 982},
        {"name": "_run", "file": "/app/dflash/telemetry/verdict/gil.py", "line": 80},
        {"name": "_publish", "file": "/app/dflash/telemetry/publish/server.py", "line": 390},
        {"name": "drain", "file": "/app/dflash/telemetry/stats.py", "line": 420},
        {"name": "step", "file": "/app/dflash/train/run/stages.py", "line": 200},
        {"name": "__exit__", "file": "/app/dflash/telemetry/stats.py", "line": 240},
    ]
    profiles = [
        {"name": "drafter-0", "samples": [[0, 4]] * 60 + [[0, 4, 5]] * 5},  # its spans are its own cost
        {"name": GIL_PROBE_THREAD, "samples": [[0, 1]] * 14},
        {"name": PUBLISHER_THREAD, "samples": [[0, 2, 3]] * 6},
    ]
    path = tmp_path / "r.speedscope.json"
    path.write_text(json.dumps({"shared": {"frames": frames}, "profiles": profiles}))
    top, samples, threads = parse_speedscope(path)
    assert samples == 85
    names = {f.name for f in top}
    assert "_run" not in names and "_publish" not in names and "drain" not in names
    assert {"step", "__exit__"} <= names  # a worker's span bookkeeping stays: the workers pay it
    assert threads == {"drafter-0": 65, GIL_PROBE_THREAD + TELEMETRY_MARK: 14, PUBLISHER_THREAD + TELEMETRY_MARK: 6}


def test_the_threads_panel_marks_the_monitors_threads() -> None:
    state = RunState()
    state.apply(P.Snapshot(seq=1, t=0.0, interval_s=1.0, system=P.SystemSample(cpu_percent=120.0, threads=[
        P.ThreadSample(tid=11, name="target-0", cpu_percent=95.0),
        P.ThreadSample(tid=12, name=GIL_PROBE_THREAD, cpu_percent=14.0),
        P.ThreadSample(tid=13, name=PUBLISHER_THREAD, cpu_percent=3.0)])))
    lines = threads_text(state, 10).plain.splitlines()
    assert next(x for x in lines if "target-0" in x).endswith("target-0")
    assert next(x for x in lines if GIL_PROBE_THREAD in x).endswith("(dflash telemetry)")
    assert next(x for x in lines if PUBLISHER_THREAD in x).endswith("(dflash telemetry)")


def test_a_hot_thread_snapshot_marks_the_monitors_threads() -> None:
    assert thread_title(ThreadStack(tid=12, name=GIL_PROBE_THREAD, frames=[])).endswith(TELEMETRY_MARK)
    assert not thread_title(ThreadStack(tid=11, name="target-0", frames=[])).endswith(TELEMETRY_MARK)


def test_once_marks_the_monitors_threads_and_shows_the_machine() -> None:
    from dflash_tui.headless import render_text, summarize

    state = RunState()
    state.apply(P.Snapshot(seq=1, t=0.0, interval_s=1.0, workers={"target-0": {"target_forward": P.CategoryStats(
        n=3, total=0.9, mean=0.3, p50=0.3, p95=0.3, max=0.3, share=0.9)}}, roles={"target-0": "target"},
        system=P.SystemSample(cpu_percent=60.0, machine=P.MachineSample(
            cores=2, load1=7.5, busy_percent=200.0, others_percent=140.0, steal_percent=0.0), threads=[
            P.ThreadSample(tid=11, name="target-0", cpu_percent=30.0),
            P.ThreadSample(tid=12, name=GIL_PROBE_THREAD, cpu_percent=14.0)])))
    s = summarize(state)
    assert {t["name"]: t["telemetry"] for t in s["threads"]} == {"target-0": False, GIL_PROBE_THREAD: True}
    assert s["machine"].startswith("machine: load 7.5 on 2 cores | other processes 1.4 cores | idle 0.0")
    assert "workers on a CPU 30% of the time, busy 90%" in s["machine"] and s["machine"] in render_text(s)
