"""dflash-top shows the health signals: a red STALLED banner (worker, span, time, innermost frame), a
yellow ANOMALY line, the "now" column; hidden when all is well. Screenshots at 80x24 and 160x50."""

from __future__ import annotations

from test_tui_snapshots import settle, utc  # noqa: F401  (utc: autouse, fixes the zone of event times)

from dflash.telemetry.wire.protocol import Anomaly, OpenSpan, Snapshot, Stall
from dflash_tui import synthetic
from dflash_tui.app import DFlashTop
from dflash_tui.sources import MemorySource


def _frames(gpus: int, troubled_from: int = 70) -> list:
    """80 synthetic snapshots; from `troubled_from` on, drafter-0 is stalled in drafter_backward and
    target-0's forward is anomalous."""
    frames = synthetic.frames(80, workers=8, gpus=gpus)
    for f in frames:
        if isinstance(f, Snapshot) and f.seq >= troubled_from:
            elapsed = 31.0 + (f.seq - troubled_from) * f.interval_s
            f.inflight["drafter-0"] = OpenSpan(category="drafter_backward", start=f.t - elapsed, elapsed=elapsed)
            f.stalls = [Stall(worker="drafter-0", category="drafter_backward", elapsed=elapsed, timeout=30.0,
                              basis="history", since=f.t - elapsed + 30,
                              frame="torch/autograd/graph.py:979 in _engine_run_backward",
                              stack_file="runs/demo/stalls/20260101-000000-drafter-0-python.txt")]
            f.anomalies = [Anomaly(worker="target-0", category="target_forward", stat="p95", value=0.041,
                                   baseline=0.012, ratio=3.4, since=f.t - 20,
                                   message="target-0/target_forward p95 3.4x its baseline (41ms vs 12ms) "
                                           "since 00:00:52")]
    return frames


def _app(gpus: int, troubled_from: int = 70) -> DFlashTop:
    return DFlashTop(source=MemorySource(_frames(gpus, troubled_from), path="runs/demo/telemetry.jsonl",
                                         detail="replay of runs/demo"), pyspy_exe="py-spy")


async def test_banner_shows_the_stall_and_the_anomaly_and_hides_when_clear() -> None:
    app = _app(0)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        banner = app.query_one("#alerts")
        assert banner.display
        text = banner.content.plain
        assert "STALLED" in text and "drafter-0 drafter_backward 36.00s >30.00s _engine_run_backward()" in text
        assert "ANOMALY" in text and "target-0/target_forward p95 3.4x baseline (41.0ms vs 12.0ms)" in text
        assert "drafter_backwar" in app.query_one("#bars").content.plain  # the "now" column
    clear = _app(0, troubled_from=10_000)
    async with clear.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert not clear.query_one("#alerts").display


def test_health_screen_80x24(snap_compare) -> None:
    assert snap_compare(_app(0), terminal_size=(80, 24), run_before=settle)


def test_health_screen_160x50(snap_compare) -> None:
    assert snap_compare(_app(2), terminal_size=(160, 50), run_before=settle)
