"""dflash-top's model and formatting: bounded history, derived values, the --once summary contract."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

from dflash.telemetry.wire import protocol
from dflash.telemetry.wire.table import evidence_value
from dflash_tui import fmt, synthetic
from dflash_tui.headless import render_text, summarize
from dflash_tui.ranks import step_rank
from dflash_tui.sources import Connection, SourceUpdate
from dflash_tui.state import MAX_EVENTS, RunState
from dflash_tui.widgets.cluster import STRAGGLER, cluster_summary, cluster_text, pick_ranks
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
                                    errors=["malformed frame (not JSON): x"], state=Connection.LIVE, detail="attached"))
    assert state.connection == Connection.LIVE and state.bad_frames == 1 and state.last_error.startswith("malformed")
    # the connection note is stamped with the stream's clock, not the wall clock
    assert state.events[-1].t == synthetic.snapshot(1).t
    state.apply_update(SourceUpdate(state=Connection.DISCONNECTED, detail="gone"))
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
    # a verdict is said once: no "unknown" line beside it, whether or not a machine line came with it
    assert "no verdict yet" not in text and "no verdict yet" not in render_text({**s, "machine": None})
    assert "bottleneck: unknown (no verdict yet)" in render_text({**s, "bottleneck": None})


def test_once_says_the_mfu_and_na_without_a_peak() -> None:
    """`dflash-top --once` carries the trainer's MFU and TFLOP/s as the header shows them: `MFU 41.2%` with
    a known peak, `MFU n/a` without one (only `tflops` sent), nothing from a trainer that sends neither."""
    import msgspec

    for gauges, shown in (({"tflops": 407.4, "mfu": 0.412}, "  MFU 41.2% 407 TFLOP/s  loss "),
                          ({"tflops": 0.0213}, "  MFU n/a 0.0213 TFLOP/s  loss "), ({}, None)):
        state = RunState()
        for f in synthetic.frames(5, workers=3, gpus=0):
            is_snapshot = isinstance(f, protocol.Snapshot)
            state.apply(msgspec.structs.replace(f, gauges={**f.gauges, **gauges}) if is_snapshot else f)
        s = summarize(state)
        assert (s["tflops"], s["mfu"]) == (gauges.get("tflops"), gauges.get("mfu"))
        line = render_text(s).splitlines()[1]
        if shown is None:
            assert "MFU" not in line and "TFLOP/s" not in line, line
        else:
            assert line.startswith("tokens/s ") and shown in line, line


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
    assert fmt.nbytes(3 * 2**30) == "3.0GiB" and fmt.clock(3725) == "1:02:05"
    assert len(fmt.sparkline(range(100), 12)) == 12 and fmt.sparkline([], 5) == ""
    assert evidence_value("drafter.hs_queue_wait", 0.31) == "31.0%"
    assert evidence_value("targets", 1.0) == "1"
    # busy is a share even past 100% (overlapping categories): never a bare 1.02
    assert evidence_value("target.busy", 1.02) == "102%" and evidence_value("drafter.busy", 0.5) == "50.0%"
    # a stage's device milliseconds per step (CUDA events) are milliseconds: the first GPU run's log
    # printed "target.device_ms_per_step 111382%"
    assert evidence_value("target.device_ms_per_step", 1113.82) == "1,113.8 ms"


# ----------------------------------------------------------------------------- multi-rank


def _cluster_snapshot(seq: int, world_size: int = 2, **kw) -> protocol.Snapshot:
    snap = synthetic.snapshot(seq)
    snap.cluster = synthetic.cluster(seq, world_size, **kw)
    return snap


def test_the_cluster_view_outlives_a_rank_switch_but_not_a_new_run() -> None:
    state = RunState()
    state.apply(synthetic.hello(world_size=2))
    state.apply(_cluster_snapshot(1))
    assert state.multi_rank and state.cluster.straggler == 1 and state.cluster_t == synthetic.snapshot(1).t
    state.forget_source()  # the panels now follow rank 1
    assert state.hello is None and state.snapshot is None and not state.category_mean
    assert state.cluster is not None, "rank 0's view stays while rank 1's stream starts"
    state.apply(synthetic.hello(rank=1, world_size=2))
    state.apply(synthetic.snapshot(2))  # other ranks publish no cluster view: the last one stays
    assert state.cluster.ranks[0].step == synthetic.cluster(1).ranks[0].step
    # the second connection, to rank 0, refreshes the view and only the view
    state.apply_cluster_update(SourceUpdate(frames=[synthetic.hello(world_size=2), _cluster_snapshot(3)],
                                            state=Connection.LIVE, detail="attached"))
    assert state.cluster_t == synthetic.snapshot(3).t and state.cluster_connection == Connection.LIVE
    assert state.hello.rank == 1 and state.snapshot.seq == 2
    state.apply(synthetic.hello(run="another", world_size=1))
    assert state.cluster is None and not state.multi_rank


def test_job_ranks_come_from_the_hello_the_cluster_view_and_local_sockets() -> None:
    state = RunState()
    assert state.job_ranks() == [] and state.job_ranks([3]) == [3]
    state.apply(synthetic.hello(rank=1, world_size=3))
    assert state.job_ranks() == [0, 1, 2] and state.shown_rank == 1
    state.apply(_cluster_snapshot(1, world_size=4))
    assert state.job_ranks([5]) == [0, 1, 2, 3, 5]
    assert state.cluster_rank(3).rank == 3 and state.cluster_rank(9) is None


def test_step_rank_wraps_and_starts_from_either_end() -> None:
    ranks = [0, 1, 2, 5]
    assert step_rank(ranks, 0, 1) == 1 and step_rank(ranks, 5, 1) == 0 and step_rank(ranks, 0, -1) == 5
    assert step_rank(ranks, None, 1) == 0 and step_rank(ranks, None, -1) == 5
    assert step_rank(ranks, 3, 1) == 5 and step_rank(ranks, 3, -1) == 2  # a rank that left the list
    assert step_rank(ranks, 9, 1) == 0 and step_rank([], 0, 1) is None


def test_cluster_text_flags_the_straggler_stale_ranks_and_the_selection() -> None:
    cluster = synthetic.cluster(10, 3, stale=(2,))
    wide = cluster_text(cluster, 120, selected=2, shown=0)
    lines = wide.plain.splitlines()
    assert "rank" in lines[0] and "worker/category" in lines[0], "side by side when wide"
    assert lines[1].startswith("• r0") and lines[3].startswith("▶ r2") and "STALE" in lines[3]
    assert "straggler r1" in wide.plain and "stale r2" in wide.plain
    assert {wide.plain[s.start:s.end] for s in wide.spans if str(s.style) == STRAGGLER} >= {"r1", " straggler r1 "}
    narrow = cluster_text(cluster, 76).plain.splitlines()
    assert "worker/category" not in narrow[0] and any(line.startswith("worker/category") for line in narrow)
    assert cluster_summary(cluster).startswith("3 ranks") and cluster_summary(cluster).endswith("1 stale")
    broken = protocol.Cluster(world_size=2, error="store unreachable")
    assert cluster_text(broken, 120).plain.startswith("⚠ cross-rank exchange: store unreachable")


def test_many_ranks_keep_the_straggler_stale_and_selected_rows() -> None:
    cluster = synthetic.cluster(10, 64, straggler=40, stale=(50,))
    rows, hidden = pick_ranks(cluster, 8, keep=(33, 0))
    assert len(rows) == 8 and hidden == 56
    assert {0, 33, 40, 50} <= {r.rank for r in rows} and [r.rank for r in rows] == sorted(r.rank for r in rows)
    assert "… 56 more ranks" in cluster_text(cluster, 120, selected=33, shown=0).plain


def test_once_summary_and_text_carry_the_cluster_view() -> None:
    state = RunState()
    for f in synthetic.frames(3, world_size=2):
        state.apply(f)
    s = summarize(state)
    json.dumps(s)
    assert s["world_size"] == 2 and s["cluster"]["straggler"] == 1
    assert [r["rank"] for r in s["cluster"]["ranks"]] == [0, 1]
    text = render_text(s)
    assert "cluster (rank 0's view): 2 ranks" in text and "straggler r1" in text and "▶ r0" in text
    single = RunState()
    for f in synthetic.frames(2):
        single.apply(f)
    assert summarize(single)["cluster"] is None and "cluster" not in render_text(summarize(single))


def test_dflash_top_takes_only_the_wire_from_dflash_and_never_torch(run_python):
    code = ("import sys, dflash_tui.app, dflash_tui.cli, dflash_tui.headless, dflash_tui.pyspy, dflash_tui.ranks\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dflash', 'torch')))")
    loaded = ast.literal_eval(run_python(code).strip())
    outside = [m for m in loaded if m not in ("dflash", "dflash.telemetry", "dflash.telemetry.wire")
               and not m.startswith("dflash.telemetry.wire.")]
    assert outside == [], "dflash-top loaded more of dflash than the wire package (or torch)"
    assert "dflash.telemetry.wire.protocol" in loaded and "dflash.telemetry.wire.vocab" in loaded


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def test_the_wire_is_the_only_door_between_the_trainer_and_dflash_top() -> None:
    """Every import of dflash in dflash_tui (lazy ones included) names the wire package, and the wire
    imports nothing of dflash but itself: the two sides share only frames, sockets, the table and words."""
    root = Path(__file__).resolve().parents[1]
    tui = {str(f.relative_to(root)): m for f in (root / "dflash_tui").rglob("*.py") for m in _imports(f)
           if m.split(".")[0] == "dflash" and not m.startswith("dflash.telemetry.wire")}
    assert tui == {}
    wire = {str(f.relative_to(root)): m for f in (root / "dflash" / "telemetry" / "wire").rglob("*.py")
            for m in _imports(f) if m.split(".")[0] in ("dflash", "torch", "dflash_tui")
            and not m.startswith("dflash.telemetry.wire")}
    assert wire == {}


def test_gpu_panel_shows_cuda_ordinal_gpm_activity_and_mig_instances() -> None:
    from dflash_tui.widgets.gpus import gpu_text

    gpu = protocol.GpuSample(index=3, name="NVIDIA H200", util_percent=95.0, mem_used=2**30, mem_total=2**37,
                             cuda_index=0, sm_active=71.5, tensor_active=42.0,
                             mig=[protocol.MigSample(index=1, name="H200 MIG 3g.71gb", cuda_index=1,
                                                     mem_used=2**30, mem_total=2**36)])
    plain = protocol.GpuSample(index=4, name="NVIDIA H200")
    state = RunState()
    state.apply(protocol.Snapshot(seq=1, t=0.0, interval_s=1.0,
                                  system=protocol.SystemSample(gpus=[gpu, plain])))
    text = gpu_text(state, 120).plain
    assert "GPU3 cuda:0 NVIDIA H200" in text
    assert "SM active 71.5%" in text and "tensor 42.0%" in text
    assert "MIG1 H200 MIG 3g.71gb cuda:1" in text
    assert "GPU4 NVIDIA H200" in text and text.count("SM active") == 1


def test_bars_show_what_each_worker_does_now() -> None:
    rows = [("target-0", [("target_forward", 0.8)], 0.2), ("drafter-0", [("hs_queue_wait", 0.5)], 0.5)]
    now = {"target-0": ("target_forward", 3.2, False), "drafter-0": ("drafter_backward", 41.0, True)}
    text = bars_text(rows, 100, now)
    heading, *lines = text.plain.splitlines()
    assert heading.split() == ["now", "(open", "span)", "for"]
    assert "target_forward" in lines[0] and "3.20s" in lines[0]
    assert "drafter_backwar" in lines[1] and "41.00s" in lines[1]
    # the stalled worker's cell is drawn red
    start = text.plain.index("drafter_backwar")
    assert any(sp.start <= start < sp.end and "red" in str(sp.style) for sp in text.spans)
    # too narrow for the column: the bars keep the room
    assert "target_forward 3" not in bars_text(rows, 50, now).plain


def test_tok_per_s_is_over_training_time_not_one_window() -> None:
    """One 1 s window holds one drafter step or two (per-window rates 2,000 or 4,000 tok/s, never the true
    3,000); the rate over the last 10 s of training is within a few percent of it, and an evaluation
    (training paused, no tokens) neither drags it down nor shows as a rate of zero."""
    state = RunState()
    state.apply(protocol.Hello(proto=protocol.PROTO, run="r", pid=1, host="h"))
    tokens, t = 0.0, 0.0
    shown = []
    for i in range(60):
        made = 2000.0 if i % 2 else 4000.0
        tokens, t = tokens + made, t + 1.0
        state.apply(protocol.Snapshot(seq=i, t=t, interval_s=1.0, window_s=1.0, counters={"tokens": tokens},
                                      rates={"tokens": made}))
        shown.append(state.tokens_rate)
    assert {s for s in shown[:1]} == {4000.0}  # the first window: its own rate, nothing to average yet
    assert all(abs(s - 3000.0) <= 300.0 for s in shown[12:]), shown
    for i in range(20):  # an evaluation: training paused
        t += 1.0
        state.apply(protocol.Snapshot(seq=100 + i, t=t, interval_s=1.0, window_s=1.0, counters={"tokens": tokens},
                                      rates={"tokens": 0.0}, gauges={"eval_done": float(i), "eval_total": 30.0}))
        assert abs(state.tokens_rate - 3000.0) <= 300.0
