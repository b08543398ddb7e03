"""dflash-top's model and formatting: bounded history, derived values, the --once summary contract."""

from __future__ import annotations

import json
import math

from dflash.telemetry import protocol
from dflash_tui import fmt, synthetic
from dflash_tui.headless import render_text, summarize
from dflash_tui.sources import DISCONNECTED, LIVE, SourceUpdate
from dflash_tui.state import MAX_EVENTS, RunState
from dflash_tui.widgets.bottleneck import evidence_value
from dflash_tui.widgets.timebars import bars_text, split_width


def test_history_is_bounded_over_a_long_run() -> None:
    state = RunState(history=50)
    state.apply(synthetic.hello(workers=8))
    for seq in range(1, 1201):
        snap = synthetic.snapshot(seq, workers=8, gpus=2)
        state.apply(snap)
        for ev in synthetic.events(seq, snap.t):
            state.apply(ev)
    assert state.snapshots == 1200
    rings = [*state.category_mean.values(), *state.category_share.values(), *state.untracked.values(),
             *state.gpu_util.values(), *state.gpu_mem.values(), state.loss, state.tau, state.tokens_per_s]
    assert rings and max(len(r) for r in rings) == 50
    assert len(state.category_mean) == 8 * 12
    assert len(state.events) <= MAX_EVENTS
    # newest values are the ones kept
    assert state.loss.values[-1] == state.snapshot.gauges["loss"]


def test_derived_values_follow_the_latest_snapshot() -> None:
    state = RunState()
    state.apply(synthetic.hello())
    snap = synthetic.snapshot(10)
    state.apply(snap)
    assert state.step == int(snap.counters["steps"])
    assert state.tokens_rate == snap.rates["tokens"]
    assert state.loss_value == snap.gauges["loss"]
    assert state.tau_value == snap.metrics["sim_tau"]
    assert state.uptime_s == snap.t - synthetic.T0
    cpu = state.thread_cpu()
    assert cpu and all(isinstance(k, int) for k in cpu)
    assert state.thread_names()[4242] == "MainThread"


def test_step_prefers_the_step_gauge_and_nonfinite_loss_is_visible() -> None:
    state = RunState()
    state.apply(protocol.Snapshot(seq=1, t=1.0, interval_s=1.0, counters={"steps": 3.0},
                                  gauges={"step": 103.0}, nonfinite={"gauges.loss": "nan"}))
    assert state.step == 103
    assert state.loss_value is None
    assert state.nonfinite("gauges.loss") == "nan"


def test_a_category_idle_in_one_window_keeps_its_row() -> None:
    state = RunState()
    a = protocol.CategoryStats(n=1, total=0.1, mean=0.1, p50=0.1, p95=0.1, max=0.1, share=0.1)
    state.apply(protocol.Snapshot(seq=1, t=1.0, interval_s=1.0, workers={"w": {"checkpoint": a, "eval": a}}))
    state.apply(protocol.Snapshot(seq=2, t=2.0, interval_s=1.0, workers={"w": {"eval": a}}))
    assert list(state.known["w"]) == ["checkpoint", "eval"]


def test_updates_apply_frames_then_state_and_count_errors() -> None:
    state = RunState()
    state.apply_update(SourceUpdate(frames=[synthetic.hello(), synthetic.snapshot(1)],
                                    errors=["malformed frame (not JSON): x"], state=LIVE, detail="attached"))
    assert state.connection == LIVE and state.bad_frames == 1 and state.last_error.startswith("malformed")
    # the connection note is stamped with the stream's clock, not the wall clock
    assert state.events[-1].t == synthetic.snapshot(1).t
    state.apply_update(SourceUpdate(state=DISCONNECTED, detail="gone"))
    assert state.snapshot is not None, "the last data is kept while disconnected"
    assert state.events[-1].kind == "warning"


def test_once_summary_has_the_documented_keys() -> None:
    state = RunState()
    for f in synthetic.frames(5, workers=8, gpus=1):
        state.apply(f)
    s = summarize(state)
    json.dumps(s)  # plain data
    for key in ("run", "pid", "workers", "bottleneck", "gpus"):
        assert key in s
    assert s["run"] == "demo" and s["pid"] == 4242
    assert len(s["workers"]) == 8
    row = s["workers"]["target-0"]["target_forward"]
    assert {"n", "mean", "p95", "share"} <= set(row) and "device" in row
    assert s["bottleneck"]["verdict"] == "target-bound"
    assert s["gpus"][0]["name"] == "NVIDIA H200"
    text = render_text(s)
    assert "target_forward" in text and "bottleneck: target-bound" in text and "GPU0" in text


def test_once_text_says_no_driver() -> None:
    state = RunState()
    for f in synthetic.frames(2):
        state.apply(f)
    assert "no NVIDIA driver" in render_text(summarize(state))


def test_split_width_always_fills_the_bar() -> None:
    for parts in ([0.5, 0.25, 0.25], [0.01] * 13, [0.7, 0.0, 0.29], [1.3, 0.4]):
        for width in (7, 40, 51, 133):
            assert sum(split_width(parts, width)) == width
    assert split_width([0, 0], 10) == [0, 0]


def test_bars_show_every_worker_and_untracked() -> None:
    rows = [("target-0", [("target_forward", 0.6), ("pack_hidden", 0.1)], 0.3)]
    text = bars_text(rows, 60).plain
    assert text.startswith("target-0")
    assert "untr 30.0%" in text and "░" in text and "target_forward" in text


def test_formatters_are_short_and_na_safe() -> None:
    assert fmt.seconds(0.0123) == "12.3ms" and fmt.seconds(2.5e-5) == "25.0µs" and fmt.seconds(None) == "-"
    assert fmt.seconds(math.nan) == "-" and fmt.percent(0.123) == "12.3%" and fmt.count(14500) == "14.5K"
    assert fmt.nbytes(3 * 2**30) == "3.0GiB" and fmt.duration(3725) == "1:02:05"
    assert len(fmt.sparkline(range(100), 12)) == 12 and fmt.sparkline([], 5) == ""
    assert evidence_value("drafter.hs_queue_wait", 0.31) == "31.0%"
    assert evidence_value("targets", 1.0) == "1"
