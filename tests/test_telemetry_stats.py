"""ProfileStats, summaries and the log table."""

from __future__ import annotations

import math
import sys
import threading
import time
import types

import pytest

from dflash.telemetry import ProfileStats, format_profile_stats
from dflash.telemetry.reservoir import Reservoir
from dflash.telemetry.summary import merge_windows, percentile, to_snapshot
from dflash.telemetry.wire import protocol as P
from dflash.telemetry.wire.table import merge_category_stats


def test_import_does_not_pull_torch_or_tui(run_python) -> None:
    code = (
        "import sys, dflash.telemetry, dflash.telemetry.publish.server, dflash.telemetry.publish.recorder, "
        "dflash.telemetry.verdict.evidence, dflash.telemetry.wire.system, dflash.commands.stats\n"
        "bad = [m for m in ('torch', 'textual', 'dflash_tui') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "from dflash.telemetry import TelemetryServer\n"
        "assert 'torch' not in sys.modules\n"
    )
    run_python(code)


def test_disabled_is_a_noop() -> None:
    s = ProfileStats(enabled=False)
    w = s.worker("target-0")
    w.add("x", 1.0)
    with w.span("y"), w.cuda_span("z"), s.span("q"):
        pass
    s.add("x", 1.0)
    s.count("tokens", 5)
    s.gauge("loss", 1.0)
    s.metric("acc", [1.0])
    summ = s.drain()
    assert summ.workers == {} and summ.counters == {} and summ.gauges == {} and summ.metrics == {}
    assert s.worker_names() == []


def test_add_and_percentiles_exact() -> None:
    s = ProfileStats()
    w = s.worker("drafter-0")
    assert s.worker("drafter-0") is w  # one handle per name
    for v in range(1, 101):
        w.add("drafter_forward", v / 1000)
    summ = s.drain()
    cs = summ.workers["drafter-0"]["drafter_forward"]
    assert cs.n == 100
    assert cs.total == pytest.approx(5.05)
    assert cs.mean == pytest.approx(0.0505)
    assert cs.p50 == pytest.approx(0.050)
    assert cs.p95 == pytest.approx(0.095)
    assert cs.max == pytest.approx(0.100)
    # the next window is empty; cumulative keeps the run
    summ2 = s.drain()
    assert summ2.workers["drafter-0"] == {}
    assert summ2.cumulative["drafter-0"]["drafter_forward"].n == 100
    assert summ2.cumulative["drafter-0"]["drafter_forward"].total == pytest.approx(5.05)


def test_percentile_nearest_rank() -> None:
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert percentile(list(range(1, 21)), 0.95) == 19


def test_span_measures_host_time_and_thread_attribution() -> None:
    s = ProfileStats()
    w = s.worker("target-0")
    with w.span("target_forward"):
        time.sleep(0.02)

    def other() -> None:
        with s.span("pack_hidden"):
            time.sleep(0.01)
        s.add("hs_queue_put", 0.5)

    t = threading.Thread(target=other, name="target-1")
    t.start()
    t.join()
    with pytest.raises(RuntimeError), w.span("checkpoint"):
        raise RuntimeError("spans still record when the block raises")
    summ = s.drain()
    assert 0.02 <= summ.workers["target-0"]["target_forward"].total < 0.5
    assert summ.workers["target-0"]["checkpoint"].n == 1
    assert 0.01 <= summ.workers["target-1"]["pack_hidden"].total < 0.5
    assert summ.workers["target-1"]["hs_queue_put"].total == 0.5


def test_share_and_untracked() -> None:
    s = ProfileStats()
    w = s.worker("target-0")
    s.drain()  # start a window now
    time.sleep(0.2)
    w.add("target_forward", 0.1)
    summ = s.drain()
    share = summ.workers["target-0"]["target_forward"].share
    assert summ.window_s >= 0.2
    assert share == pytest.approx(0.1 / summ.window_s, rel=1e-6)
    assert summ.untracked["target-0"] == pytest.approx(1 - share)
    # a worker that appeared mid-window is judged on its own lifetime, not the whole window
    time.sleep(0.1)
    born = time.monotonic()
    late = s.worker("drafter-0")
    time.sleep(0.05)
    late.add("drafter_forward", 0.04)
    summ = s.drain()
    lived = time.monotonic() - born  # at least its lifetime in the window, however the sleeps stretched
    share = summ.workers["drafter-0"]["drafter_forward"].share
    assert share >= 0.04 / lived * 0.999 and share > 0.04 / summ.window_s


def test_concurrent_add_and_drain_lose_nothing() -> None:
    """8 writer threads hammer add() (folding too: tiny fold_at) while another thread drains.

    A tiny GIL switch interval makes thread switches land inside drain's take-and-clear, where a
    racy implementation (copy then clear, or swapping the attribute) loses or duplicates samples."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        _hammer()
    finally:
        sys.setswitchinterval(old)


def _hammer() -> None:
    s = ProfileStats(fold_at=257)
    n_threads, per_thread = 8, 20000
    stop = threading.Event()
    drained: list = []

    def writer(i: int) -> None:
        w = s.worker(f"w{i % 4}")  # two threads share each handle
        for k in range(per_thread):
            w.add("c", 1.0)
            if k % 1000 == 0:
                s.count("steps", 1)

    def drainer() -> None:
        while not stop.is_set():
            drained.append(s.drain())

    d = threading.Thread(target=drainer)
    d.start()
    ws = [threading.Thread(target=writer, args=(i,)) for i in range(n_threads)]
    for t in ws:
        t.start()
    for t in ws:
        t.join()
    stop.set()
    d.join()
    drained.append(s.drain())
    n = sum(cs.n for summ in drained for cats in summ.workers.values() for cs in cats.values())
    total = sum(cs.total for summ in drained for cats in summ.workers.values() for cs in cats.values())
    assert n == n_threads * per_thread
    assert total == n_threads * per_thread  # 1.0 per sample: exact in float
    last = drained[-1]
    assert sum(c.n for cats in last.cumulative.values() for c in cats.values()) == n_threads * per_thread
    assert last.counters["steps"] == n_threads * (per_thread // 1000)
    assert len(drained) > 3  # the drainer really interleaved


def test_memory_bounded_without_drain() -> None:
    s = ProfileStats(fold_at=1000, reservoir=512)
    w = s.worker("target-0")
    for i in range(200_000):
        w.add("target_forward", (i % 1000) / 1000)
    assert len(w._buf) < 1000
    pend = s._pending["target-0"]["target_forward"]
    assert len(pend.sample) <= 512
    summ = s.drain()
    cs = summ.workers["target-0"]["target_forward"]
    assert cs.n == 200_000
    assert cs.total == pytest.approx(sum((i % 1000) / 1000 for i in range(200_000)))
    assert cs.max == pytest.approx(0.999)
    # the reservoir is a uniform sample: percentiles of a uniform 0..1 stream land near 0.5 / 0.95
    assert cs.p50 == pytest.approx(0.5, abs=0.08)
    assert cs.p95 == pytest.approx(0.95, abs=0.05)


def test_reservoir_merge_keeps_exact_totals() -> None:
    import random

    rng = random.Random(1)
    a, b = Reservoir(100), Reservoir(100)
    a.extend([1.0] * 1000, rng)
    b.extend([3.0] * 3000, rng)
    a.merge(b, rng)
    assert a.n == 4000 and a.total == 10000 and a.max == 3.0
    assert len(a.sample) == 100
    # 3/4 of the merged sample should come from b
    assert 60 <= sum(1 for v in a.sample if v == 3.0) <= 90


def test_counters_rates_gauges_metrics() -> None:
    s = ProfileStats()
    s.drain()
    s.count("tokens", 1000)
    s.count("tokens", 500)
    s.gauge("loss", 2.5)
    s.metric("per_position_acc", [0.9, 0.7, 0.5])
    s.metric("sim_tau", 3.1)
    time.sleep(0.05)
    summ = s.drain()
    assert summ.counters["tokens"] == 1500
    assert summ.rates["tokens"] == pytest.approx(1500 / summ.window_s)
    assert summ.gauges == {"loss": 2.5}
    assert summ.metrics == {"per_position_acc": [0.9, 0.7, 0.5], "sim_tau": 3.1}
    time.sleep(0.02)
    summ = s.drain()
    assert summ.counters["tokens"] == 1500 and summ.rates["tokens"] == 0.0


def test_nonfinite_values_survive_the_wire() -> None:
    s = ProfileStats()
    w = s.worker("drafter-0")
    w.add("drafter_forward", float("nan"))
    w.add("drafter_forward", 0.5)
    s.gauge("loss", float("nan"))
    s.gauge("lr", 1e-4)
    s.metric("acc", [0.5, float("inf")])
    summ = s.drain()
    assert summ.workers["drafter-0"]["drafter_forward"].n == 1
    assert summ.dropped == 1
    frame = P.decode(P.encode(to_snapshot(summ, 1, 1.0)))
    assert frame.gauges == {"lr": 1e-4}
    assert frame.nonfinite == {"gauges.loss": "nan", "metrics.acc": "non-finite at 1"}
    assert frame.workers["drafter-0"]["drafter_forward"].total == 0.5


def test_cuda_span_without_cuda_is_host_timed() -> None:
    s = ProfileStats()
    w = s.worker("target-0")
    with w.cuda_span("target_forward"):
        time.sleep(0.01)
    with s.cuda_span("h2d", stream=None):
        pass
    summ = s.drain()
    cs = summ.workers["target-0"]["target_forward"]
    assert cs.n == 1 and cs.total >= 0.01 and cs.device is None
    assert s.pending_cuda() == 0


class _FakeEvent:
    """Stands in for torch.cuda.Event (no GPU here): 'completes' when the test says so, and fails
    loudly if anything tries to synchronise."""

    clock = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: float | None = None
        self.done = False
        self.stream = "unset"

    def record(self, stream: object = None) -> None:
        self.stream = stream
        _FakeEvent.clock += 0.005
        self.t = _FakeEvent.clock

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.done and end.done, "elapsed_time before completion would block"
        return (end.t - self.t) * 1000.0

    def synchronize(self) -> None:
        raise AssertionError("telemetry must never synchronise")


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[_FakeEvent]:
    """A torch whose CUDA is "initialised" with _FakeEvent events; returns the events as they are made."""
    events: list[_FakeEvent] = []

    class Ev(_FakeEvent):
        def __init__(self, enable_timing: bool = False) -> None:
            super().__init__(enable_timing)
            events.append(self)

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_initialized=lambda: True, is_current_stream_capturing=lambda: False, Event=Ev)
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    return events


def test_cuda_span_device_time_is_resolved_later_without_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    events = _fake_cuda(monkeypatch)
    s = ProfileStats()
    w = s.worker("target-0")
    with w.cuda_span("target_forward", stream="s1"):
        pass
    assert [e.stream for e in events] == ["s1", "s1"]
    summ = s.drain()  # GPU not done yet: host time now, device time pending
    assert summ.workers["target-0"]["target_forward"].n == 1
    assert summ.workers["target-0"]["target_forward"].device is None
    assert s.pending_cuda() == 1
    for e in events:
        e.done = True
    summ = s.drain()
    dev = summ.workers["target-0"]["target_forward"].device
    assert dev is not None and dev.n == 1 and dev.total == pytest.approx(0.005)
    assert 0 < dev.share <= 1  # the stream's busy share of the worker's wall time: what the verdict reads
    assert summ.workers["target-0"]["target_forward"].n == 0  # host time was in the earlier window
    assert summ.cumulative["target-0"]["target_forward"].device.n == 1
    assert s.pending_cuda() == 0


def test_device_counter_waits_for_its_events_without_syncing() -> None:
    """count_device (the NCCL all-reduce's timing): nothing counted until both events have completed,
    then their device time, resolved by a later drain; the pair is never waited on."""
    s = ProfileStats()
    start, end = _FakeEvent(True), _FakeEvent(True)
    start.record()
    end.record()
    s.count("allreduce_seconds", 0.0)
    s.count_device("allreduce_seconds", start, end)
    assert s.drain().counters["allreduce_seconds"] == 0.0
    start.done = end.done = True
    assert s.drain().counters["allreduce_seconds"] == pytest.approx(0.005)
    assert s.drain().counters["allreduce_seconds"] == pytest.approx(0.005)  # counted once


def test_format_profile_stats_table() -> None:
    s = ProfileStats()
    a, b = s.worker("target-0"), s.worker("drafter-0")
    for _ in range(10):
        a.add("target_forward", 0.010)
        b.add("hs_queue_wait", 0.002)
        b.add("drafter_forward", 0.004)
    a.add("checkpoint", 0.0005)
    summ = s.drain()
    text = format_profile_stats(summ, limit=2)
    lines = text.splitlines()
    assert lines[0].split() == ["category", "n", "total", "mean", "p50", "p95", "max", "share"]
    assert lines[1].startswith("target-0/target_forward")
    assert lines[2].startswith("drafter-0/drafter_forward")
    assert "2 more rows not shown" in lines[-1]
    # right-aligned numeric columns end at the same offset on every row
    assert len({len(line) for line in lines[:3]}) == 1
    by_cat = format_profile_stats(summ, limit=10, by="category", cumulative=True)
    assert by_cat.splitlines()[1].startswith("target_forward")
    with pytest.raises(ValueError):
        format_profile_stats(summ, by="nope")


def test_merge_category_stats() -> None:
    a = P.CategoryStats(n=10, total=1.0, mean=0.1, p50=0.1, p95=0.2, max=0.3, share=0.5)
    b = P.CategoryStats(n=30, total=6.0, mean=0.2, p50=0.2, p95=0.4, max=0.5, share=0.5)
    m = merge_category_stats([a, b], wall_s=14.0)
    assert (m.n, m.total, m.max) == (40, 7.0, 0.5)
    assert m.mean == pytest.approx(7.0 / 40)
    assert m.p50 == pytest.approx((0.1 * 10 + 0.2 * 30) / 40)
    assert m.share == pytest.approx(0.5)
    merged = merge_windows([{"w": {"c": a}}, {"w": {"c": b}, "v": {"d": a}}], wall_s=2.0)
    assert merged["w"]["c"].n == 40 and merged["v"]["d"].share == pytest.approx(0.5)
    assert not math.isnan(merge_category_stats([]).mean)


def test_nested_and_shared_spans_keep_exact_totals() -> None:
    s = ProfileStats()
    w = s.worker("drafter-0")
    with w.span("step"):
        time.sleep(0.01)
        with w.span("step"):  # the same category nested (recursion)
            time.sleep(0.02)
    cats = s.drain().workers["drafter-0"]
    assert cats["step"].n == 2
    assert 0.02 <= cats["step"].p50 < 0.03 + 0.2 and cats["step"].max >= 0.03

    # two threads sharing one handle and category: pairing may cross, totals may not drift
    shared = s.worker("shared")
    barrier = threading.Barrier(2)

    def run() -> None:
        barrier.wait()
        for _ in range(200):
            with shared.span("c"):
                time.sleep(0.0005)

    ts = [threading.Thread(target=run) for _ in range(2)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    c = s.drain().workers["shared"]["c"]
    assert c.n == 400
    assert 400 * 0.0005 <= c.total <= 2 * wall


def test_unfinished_cuda_events_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import dflash.telemetry.stats as st

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_initialized=lambda: True, is_current_stream_capturing=lambda: False,
                                   Event=_FakeEvent)
    )
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(st, "CUDA_BACKLOG", 50)
    s = ProfileStats(fold_at=10)
    w = s.worker("target-0")
    for _ in range(1000):  # a GPU that never finishes, and nobody draining
        with w.cuda_span("target_forward"):
            pass
    assert s.pending_cuda() <= 50 + 10
    summ = s.drain()
    assert summ.workers["target-0"]["target_forward"].n == 1000  # host time is never lost
    assert summ.dropped >= 1000 - 60


@pytest.mark.slow
def test_cuda_span_with_real_cpu_torch(run_python) -> None:
    """With the real (CPU) torch imported, a CUDA span is host-timed, and the torch APIs the CUDA
    path relies on exist under the names it uses."""
    code = (
        "import torch, time\n"
        "from dflash.telemetry import ProfileStats\n"
        "for name in ('Event', 'is_initialized', 'is_current_stream_capturing', 'current_stream'):\n"
        "    assert hasattr(torch.cuda, name), name\n"
        "for name in ('record', 'query', 'elapsed_time'):\n"
        "    assert hasattr(torch.cuda.Event, name), name\n"
        "s = ProfileStats(); w = s.worker('target-0')\n"
        "with w.cuda_span('target_forward'):\n"
        "    torch.ones(64, 64) @ torch.ones(64, 64)\n"
        "summ = s.drain(); cs = summ.workers['target-0']['target_forward']\n"
        "assert cs.n == 1 and cs.total > 0 and cs.device is None and s.pending_cuda() == 0\n"
    )
    run_python(code, timeout=120)


def test_cumulative_percentiles_stay_uniform_over_a_long_run() -> None:
    """Window k holds 20 samples of value k: a uniform cumulative sample has its median near the
    middle window, not biased to early (never replaced) or late (over-replaced) windows."""
    s = ProfileStats()
    w = s.worker("drafter-0")
    for k in range(400):
        for _ in range(20):
            w.add("drafter_forward", float(k))
        summ = s.drain()
    cum = summ.cumulative["drafter-0"]["drafter_forward"]
    assert cum.n == 8000 and cum.total == 20 * sum(range(400)) and cum.max == 399
    # cumulative percentiles may lag by up to 5% of growth (documented), hence the wide p95 band
    assert 200 - 30 <= cum.p50 <= 200 + 25
    assert 345 <= cum.p95 <= 395


class _Clock:
    """perf_counter for stats.py, moved by the test: shares and totals come out exact."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import dflash.telemetry.stats as st

        self.now = 100.0
        monkeypatch.setattr(st, "_perf", lambda: self.now)

    def spend(self, worker, category: str, seconds: float) -> None:
        with worker.span(category):
            self.now += seconds


def test_a_step_records_each_category_once_as_its_spans_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock(monkeypatch)
    s = ProfileStats()
    w = s.worker("drafter-0")
    s.drain()
    with w.step():  # the pass, then the head chunk by chunk with the verifier's logits in between
        for secs in (1.0, 0.25, 0.25):
            clock.spend(w, "drafter_forward", secs)
            clock.spend(w, "verifier_logits", 0.5)
        clock.spend(w, "drafter_backward", 2.0)
    with w.step():
        clock.spend(w, "drafter_forward", 3.0)
    clock.spend(w, "drafter_forward", 0.5)  # outside a step: a sample of its own, as before
    cats = s.drain().workers["drafter-0"]
    fwd = cats["drafter_forward"]
    assert (fwd.n, fwd.total, fwd.max, fwd.p50) == (3, 5.0, 3.0, 1.5)
    assert (cats["verifier_logits"].n, cats["verifier_logits"].total) == (1, 1.5)
    assert (cats["drafter_backward"].n, cats["drafter_backward"].total) == (1, 2.0)
    with w.step(), pytest.raises(RuntimeError, match="do not nest"), w.step():
        pass


def test_a_step_under_way_is_booked_in_the_windows_its_spans_ran_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's time is held until it ends, but each window's share is the time spent in it, and the
    shares add up to the step's sample: nothing is booked twice, open spans inside the step included."""
    clock = _Clock(monkeypatch)
    s = ProfileStats()
    w = s.worker("drafter-0")
    s.drain()
    windows = []
    with w.step():
        clock.spend(w, "drafter_forward", 1.0)
        clock.now += 1.0
        windows.append(s.drain())  # 1 s held of a 2 s window
        with w.span("drafter_forward"):
            clock.now += 1.0
            windows.append(s.drain())  # open all window long
            clock.now += 0.5
        clock.now += 0.5
        windows.append(s.drain())  # the open span's last 0.5 s, now held
    clock.now += 1.0
    windows.append(s.drain())  # the step's sample arrives: all of it booked already
    shares = [win.workers["drafter-0"]["drafter_forward"].share for win in windows]
    assert shares == pytest.approx([0.5, 1.0, 0.5, 0.0])
    assert [win.workers["drafter-0"]["drafter_forward"].n for win in windows] == [0, 0, 0, 1]
    assert windows[-1].workers["drafter-0"]["drafter_forward"].total == pytest.approx(2.5)
    assert sum(sh * win.window_s for sh, win in zip(shares, windows, strict=True)) == pytest.approx(2.5)


def test_a_steps_device_time_is_the_sum_of_its_spans_once_all_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    events = _fake_cuda(monkeypatch)
    s = ProfileStats()
    w = s.worker("drafter-0")
    with w.step():
        for _ in range(3):
            with w.cuda_span("drafter_forward", stream="s"):
                pass
    assert s.pending_cuda() == 1  # one sample: the step's three pairs
    for e in events[:4]:  # the first two spans done, the third still running
        e.done = True
    summ = s.drain()
    assert summ.workers["drafter-0"]["drafter_forward"].n == 1
    assert summ.workers["drafter-0"]["drafter_forward"].device is None
    for e in events:
        e.done = True
    dev = s.drain().workers["drafter-0"]["drafter_forward"].device
    assert dev is not None and dev.n == 1 and dev.total == pytest.approx(3 * 0.005)
