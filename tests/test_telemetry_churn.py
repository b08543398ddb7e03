"""Allocator churn: the caching allocator's driver calls (segment maps and frees) as per-second gauges read
by the main thread once per interval, and an anomaly while they stay high. No GPU here: the readings are
constructed `memory_stats` counts, with torch's real key names (checked against the installed torch)."""

from __future__ import annotations

import torch
from test_train_logline import _Pipeline, _Stats

from dflash.telemetry.summary import Summary
from dflash.telemetry.verdict.anomalies import AnomalyDetector
from dflash.telemetry.verdict.churn import CHURN_HIGH, END_S, SUSTAIN_S, ChurnMonitor, ChurnRates
from dflash.telemetry.wire.protocol import Anomaly
from dflash.telemetry.wire.vocab import SEGMENT_FREES_PER_S, SEGMENT_MAPS_PER_S, device_gauge, device_gauges
from dflash.train.config import TrainConfig
from dflash.train.config.schema import updated
from dflash.train.device import memory
from dflash.train.device.memory import segment_calls
from dflash.train.device.metrics import StepMetrics
from dflash.train.reporting import Reporter
from dflash.train.reporting.logline import LogLines
from dflash.train.run.pipeline import TrainCounters


def test_the_driver_call_counts_use_torchs_own_key_names() -> None:
    doc = torch.cuda.memory_stats.__doc__ or ""
    # the keys the reading prefers are the ones this torch documents (cuMemMap and cudaMalloc, their frees)
    assert '"num_device_alloc"' in doc and "cuMemMap" in doc and '"num_device_free"' in doc
    assert "segment.{all,large_pool,small_pool}.{current,peak,allocated,freed}" in doc
    stats = {"num_device_alloc": 41, "num_device_free": 40, "segment.all.allocated": 3, "segment.all.freed": 2}
    assert segment_calls(stats) == (41, 40)  # expandable segments' maps count, not only cudaMalloc's segments
    assert segment_calls({"segment.all.allocated": 3, "segment.all.freed": 2}) == (3, 2)  # an older torch
    assert segment_calls({}) == (0, 0)


def test_rates_from_cumulative_counts_read_at_irregular_times() -> None:
    r = ChurnRates(min_dt_s=0.5)
    assert r.rates(0, 10.0, 100, 90) is None  # the first reading is the baseline
    assert r.rates(0, 11.0, 130, 110) == (30.0, 20.0)
    assert r.rates(0, 11.05, 131, 110) is None  # too soon: one call would read as 20 a second
    assert r.rates(0, 13.0, 131, 110) == (0.5, 0.0)  # ... and it counts in the next rate instead
    assert r.rates(1, 13.0, 5, 5) is None  # another device has its own baseline
    assert r.rates(0, 14.0, 3, 1) == (0.0, 0.0)  # counts reset (reset_peak_memory_stats ...): no negative rate
    assert r.rates(0, 15.0, 13, 6) == (10.0, 5.0)


def test_the_main_threads_harvest_publishes_rates_not_counts(monkeypatch) -> None:
    """The main thread reads the allocator once per telemetry interval (never a worker per step) and
    publishes the rates under the vocabulary's names; a log line's harvest a moment later adds no spike."""
    readings = iter([(100, 100), (160, 150), (161, 150), (200, 170)])

    def fake(devices):  # what allocator_gauges reads from torch.cuda.memory_stats on a GPU
        assert [str(d) for d in devices] == ["cuda:0"]
        maps, frees = next(readings)
        return {0: {"allocated_bytes": 1, "reserved_bytes": 2, "alloc_retries": 0, "segment_maps": maps,
                    "segment_frees": frees}}

    monkeypatch.setattr("dflash.train.reporting.logline.allocator_gauges", fake)
    now, stats = [0.0], _Stats()
    lines = LogLines(updated(TrainConfig(), telemetry_interval=1.0), TrainCounters(), stats, StepMetrics(),
                     _Pipeline([0.0]), latest=lambda: None, verdict=lambda whole_run=None: None,
                     report=Reporter(lambda line: None), devices=[torch.device("cuda", 0)], clock=lambda: now[0])
    maps, frees = device_gauge(0, SEGMENT_MAPS_PER_S), device_gauge(0, SEGMENT_FREES_PER_S)
    lines.harvest()
    assert maps not in stats.values and stats.values["cuda0_reserved_bytes"] == 2
    now[0] = 2.0
    lines.harvest()
    assert stats.values[maps] == 30.0 and stats.values[frees] == 25.0
    now[0] = 2.01  # the log line's own harvest, right after the interval's
    lines.harvest()
    assert stats.values[maps] == 30.0
    now[0] = 4.0
    lines.harvest()
    assert stats.values[maps] == 20.0 and stats.values[frees] == 10.0
    assert not any("segment_maps" == k.removeprefix("cuda0_") for k in stats.values)  # no running count
    assert device_gauges(stats.values, SEGMENT_MAPS_PER_S) == {0: 20.0}
    assert memory.DEVICE_CALLS[0] == ("num_device_alloc", "num_device_free")


def window(t: float, rates: dict[int, tuple[float, float]], **gauges: float) -> Summary:
    g = {**gauges}
    for i, (m, f) in rates.items():
        g[device_gauge(i, SEGMENT_MAPS_PER_S)], g[device_gauge(i, SEGMENT_FREES_PER_S)] = m, f
    return Summary(t=t, window_s=1.0, gauges=g)


def test_churn_that_stays_high_is_one_anomaly_until_it_calms() -> None:
    events: list[tuple[str, str, dict]] = []
    mon = ChurnMonitor(emit=lambda kind, msg, **data: events.append((kind, msg, data)))
    t = 0.0

    def run(seconds: int, rates: dict[int, tuple[float, float]]) -> list[list[Anomaly]]:
        nonlocal t
        out = []
        for _ in range(seconds):
            t += 1.0
            out.append(mon.check(window(t, rates)))
        return out

    assert run(20, {0: (0.0, 0.0)}) == [[]] * 20  # a steady cache makes no driver calls
    assert not any(run(3, {0: (40.0, 30.0)})[-1]) and not events  # a burst (warm-up, a longer batch) passes
    run(15, {0: (0.0, 0.0)})
    high = run(int(SUSTAIN_S) + 2, {0: (12.0, 9.0), 1: (0.0, 1.0)})
    assert high[-1] and events[0][0] == "anomaly" and len(events) == 1
    a = high[-1][0]
    assert (a.worker, a.category, a.stat) == ("cuda:0", "allocator", "segment_calls_per_s")
    assert a.value == 21.0 and a.baseline == CHURN_HIGH and a.ratio == 21.0 / CHURN_HIGH
    assert "cuda:0 allocator churns: 12 segment maps and 9 frees a second" in a.message
    assert events[0][2]["maps_per_s"] == 12.0 and events[0][2]["device"] == "cuda:0"
    assert all(x[0].worker == "cuda:0" for x in high if x)  # device 1 (1 free a second) is not churning
    # it holds while high, and through a few calm seconds (hysteresis: the span must calm, then stay calm
    # END_S), then ends with one event
    run(10, {0: (12.0, 9.0)})
    calm = run(int(SUSTAIN_S + END_S), {0: (0.0, 0.0)})
    assert calm[int(END_S) - 1] and not calm[-1], [bool(x) for x in calm]
    assert [e[0] for e in events] == ["anomaly", "anomaly_end"] and "calm again" in events[1][1]


def test_churn_adds_to_the_timing_anomalies_and_ends_with_the_phase_and_the_run() -> None:
    events: list[str] = []
    mon = ChurnMonitor(sustain_s=3.0, sustain_windows=3, emit=lambda kind, msg, **data: events.append(kind))
    timing = Anomaly(worker="target-0", category="target_forward", stat="p95", value=0.04, baseline=0.01, ratio=4.0,
                     since=0.0)
    for i in range(5):
        s = window(float(i + 1), {0: (20.0, 20.0)})
        s.anomalies = [timing]  # what the timing detector set on this window (it runs first)
        mon.check(s)
    assert [a.worker for a in s.anomalies] == ["target-0", "cuda:0"]
    paused = window(6.0, {0: (20.0, 20.0)}, eval_done=0.0, eval_total=4.0)
    assert mon.check(paused) == [] and events == ["anomaly", "anomaly_end"]
    for i in range(7, 12):
        mon.check(window(float(i), {0: (20.0, 20.0)}, eval_done=4.0, eval_total=4.0))
    last = window(12.0, {0: (20.0, 20.0)})
    last.final = True
    assert mon.check(last) == [] and events == ["anomaly", "anomaly_end", "anomaly", "anomaly_end"]
    # the timing detector sets the window's anomalies: run first, it does not drop the churn's
    s = window(13.0, {})
    AnomalyDetector().check(s)
    assert s.anomalies == []


def test_dflash_top_writes_a_rate_anomaly_as_a_rate() -> None:
    from dflash_tui.widgets.alerts import anomaly_line

    a = Anomaly(worker="cuda:0", category="allocator", stat="segment_calls_per_s", value=21.0, baseline=5.0,
                ratio=4.2, since=0.0, message="cuda:0 allocator churns: ...")
    assert anomaly_line(a) == "cuda:0 allocator churns: ..."
    assert anomaly_line(a, compact=True) == "cuda:0/allocator segment_calls_per_s 21/s (4.2x the 5/s limit)"
