"""The stall watchdog on real threads and a real TelemetryServer: thresholds from history, waits are not
stalls, stacks written, recovery reported, and the stall visible in snapshots, the cluster view,
Prometheus and `dflash-top --once --json`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from conftest import wait_until

from dflash.telemetry import ProfileStats
from dflash.telemetry.export.cluster import _Smoother, build_cluster, make_report
from dflash.telemetry.publish.introspection import thread_map
from dflash.telemetry.publish.server import TelemetryServer
from dflash.telemetry.summary import Summary
from dflash.telemetry.verdict.watchdog import FIRST_GRACE_S, Watchdog
from dflash.telemetry.wire.protocol import CategoryStats, Event, Snapshot, Stall
from dflash.telemetry.wire.reader import read_frames


def blocking_call(release: threading.Event) -> None:
    """The frame the stalled worker is stuck in."""
    release.wait(60)


def _summary(t: float, workers: dict, since_done: dict, inflight: dict | None = None) -> Summary:
    return Summary(t=t, window_s=1.0, workers=workers, since_done=since_done, inflight=inflight or {})


def _cs(mx: float) -> CategoryStats:
    return CategoryStats(n=1, total=mx, mean=mx, p50=mx, p95=mx, max=mx)


def test_timeout_comes_from_history_with_a_floor_and_a_first_step_grace() -> None:
    wd = Watchdog(floor_s=1.0, factor=10.0, first_grace_s=50.0)
    assert wd.timeout_for("drafter-0", "drafter_forward") == (50.0, "first-step grace")
    for i in range(200):
        wd.learn(_summary(i, {"drafter-0": {"drafter_forward": _cs(0.5 if i % 100 else 2.0)}}, {}))
    t, basis = wd.timeout_for("drafter-0", "drafter_forward")
    assert basis == "history" and t == pytest.approx(5.0)  # 10 x p99: 1% of 2 s outliers do not set it
    for i in range(200):
        wd.learn(_summary(i, {"drafter-0": {"drafter_forward": _cs(0.5 if i % 50 else 2.0)}}, {}))
    t, basis = wd.timeout_for("drafter-0", "drafter_forward")
    assert t == pytest.approx(20.0)  # 2% of them do
    assert wd.timeout_for("drafter-0", None) == (t, "history")  # between spans: its slowest category
    assert Watchdog(floor_s=30.0).timeout_for("x", "y")[0] == FIRST_GRACE_S
    assert Watchdog(timeout=4.0).timeout_for("x", "y") == (4.0, "--stall-timeout")
    with pytest.raises(ValueError):
        Watchdog(timeout=0)


def test_waiting_and_finished_workers_are_not_stalled() -> None:
    from dflash.telemetry.wire.protocol import OpenSpan

    wd = Watchdog(timeout=1.0, native=False)
    events = []
    wd.emit = lambda kind, msg, **data: events.append(kind)
    op = OpenSpan(category="hs_queue_wait", start=0.0, elapsed=50.0)
    s = _summary(100.0, {}, {"drafter-0": 50.0, "target-0": 50.0}, {"drafter-0": op})
    stalls = wd.check(s, live={"drafter-0"})  # target-0's thread has ended
    assert stalls == [] and events == []


def test_a_stalled_thread_is_reported_with_its_stack_then_recovers(tmp_path: Path, sock_dir: Path) -> None:
    stats = ProfileStats()
    release, entered = threading.Event(), threading.Event()

    def worker() -> None:
        w = stats.worker("drafter-0")
        for _ in range(5):
            with w.span("drafter_forward"):
                time.sleep(0.002)
        with w.span("drafter_backward"):
            entered.set()
            blocking_call(release)
        for _ in range(3):
            with w.span("drafter_forward"):
                time.sleep(0.002)

    wd = Watchdog(tmp_path, timeout=0.5)
    with TelemetryServer("wd", stats, interval_s=0.1, run_dir=tmp_path, socket_dir=sock_dir, monitors=[wd]) as srv:
        t = threading.Thread(target=worker, name="drafter-0", daemon=True)
        t.start()
        assert entered.wait(10)
        wait_until(lambda: wd.stalled, 20.0)
        st = wd.stalled[0]
        assert st.worker == "drafter-0" and st.category == "drafter_backward" and st.basis == "--stall-timeout"
        assert "blocking_call" in st.frame
        stack = Path(st.stack_file).read_text()
        assert '"drafter-0" (stalled)' in stack.split("\n\n")[1] and "blocking_call" in stack.split("\n\n")[1]
        wait_until(lambda: srv.latest() is not None and srv.latest().stalls, 20.0)
        assert srv.latest().stalls[0].worker == "drafter-0"
        wd.join_dumps()  # while the worker is still stuck
        release.set()
        t.join(10)
        wait_until(lambda: not wd.stalled, 20.0)
    frames = list(read_frames(tmp_path / "telemetry.jsonl"))
    kinds = [f.kind for f in frames if isinstance(f, Event)]
    assert kinds.count("stall") == 1 and kinds.count("recovered") == 1
    snaps = [f for f in frames if isinstance(f, Snapshot)]
    assert any(s.stalls and s.stalls[0].category == "drafter_backward" for s in snaps)
    native = list((tmp_path / "stalls").glob("*-native.txt"))
    assert len(native) == 1
    text = native[0].read_text()
    # py-spy attached (it can here), or the file says why not
    assert "blocking_call" in text or "py-spy" in text


def test_the_cluster_view_names_a_stalled_rank() -> None:
    st = Stall(worker="drafter-0", category="drafter_backward", elapsed=42.0, timeout=30.0)
    live = Summary(t=1.0, window_s=1.0)
    stuck = Summary(t=1.0, window_s=1.0, stalls=[st])
    reports = {0: make_report(0, 1, live, _Smoother(), "training", None),
               1: make_report(1, 1, stuck, _Smoother(), "training", None)}
    assert reports[1].stalled == ["drafter-0/drafter_backward for 42s"]
    view = build_cluster(2, reports, {0: 0.1, 1: 0.1}, stale_after_s=5.0)
    assert view.stalled == [1] and view.stale == []  # alive and reporting, yet stuck
    from dflash_tui.widgets.cluster import cluster_summary, cluster_text

    assert "1 stalled" in cluster_summary(view)
    assert "stalled r1  drafter-0/drafter_backward for 42s" in cluster_text(view, 120).plain


def test_stalls_in_prometheus_and_once_json() -> None:
    from dflash.telemetry.export.prometheus import MetricsExporter
    from dflash_tui.headless import render_text, summarize
    from dflash_tui.state import RunState

    st = Stall(worker="target-0", category="target_forward", elapsed=42.0, timeout=30.0, frame="x.py:3 in f")
    snap = Snapshot(seq=1, t=1.0, interval_s=1.0, stalls=[st])
    ex = MetricsExporter("r")
    ex.update(None, snap)
    from prometheus_client import generate_latest

    text = generate_latest(ex.registry).decode()
    assert "dflash_stalled_workers" in text and 'dflash_stall_seconds{category="target_forward"' in text
    state = RunState()
    state.apply(snap)
    s = summarize(state)
    assert s["stalls"][0]["worker"] == "target-0" and s["stalls"][0]["elapsed"] == 42.0
    assert "STALLED: target-0 in target_forward for 42.00s (timeout 30.00s) at x.py:3 in f" in render_text(s)


def test_thread_map_names_live_threads() -> None:
    assert threading.current_thread().name in thread_map().values()
