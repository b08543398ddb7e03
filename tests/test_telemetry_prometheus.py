"""The Prometheus exporter against a real ProfileStats, a real TelemetryServer and real HTTP scrapes
parsed with prometheus_client's own parser: the series a Grafana board would read, their values,
what happens to NaN/None, a busy port, several exporters in one process, and the cost of `update`."""

from __future__ import annotations

import math
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from prometheus_client.samples import Sample  # noqa: E402

from dflash.telemetry import ProfileStats, TelemetryServer  # noqa: E402
from dflash.telemetry.export.prometheus import MetricsExporter, MetricsServerError  # noqa: E402
from dflash.telemetry.wire import protocol as P  # noqa: E402

FAST = 0.05
#: fake span durations, powers of two so that sums of them are exact in binary floating point
DT_TARGET = 2.0**-9
DT_WAIT = 2.0**-8
TOKENS_PER_STEP = 64
NAN, INF = float("nan"), float("inf")


# --- helpers ------------------------------------------------------------------------------------------


def parse(text: str) -> list[Sample]:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def scrape(port: int) -> list[Sample]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return parse(r.read().decode())


def render(exporter: MetricsExporter) -> list[Sample]:
    return parse(generate_latest(exporter.registry).decode())


def find(samples: list[Sample], metric: str, /, **labels: str) -> list[Sample]:
    return [s for s in samples if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())]


def value(samples: list[Sample], metric: str, /, **labels: str) -> float | None:
    """The value of the one sample matching the metric and labels, None when there is none."""
    hits = find(samples, metric, **labels)
    assert len(hits) <= 1, f"{metric}{labels} matches {len(hits)} samples: {hits}"
    return hits[0].value if hits else None


def wait_for(port: int, ok: Callable[[list[Sample]], bool], timeout: float = 10.0) -> list[Sample]:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port)
        if ok(samples):
            return samples
        if time.monotonic() > deadline:
            names = sorted({s.name for s in samples})
            raise AssertionError(f"condition not met within {timeout} s; series present: {names}")
        time.sleep(FAST / 2)


class Workload:
    """A scripted two-stage pipeline: `target-0` produces (fake target_forward time plus a real
    pack_hidden span, counting tokens and samples), `drafter-0` waits on hidden states far longer than
    it works (so the verdict is target-bound) and sets the training gauges and metrics."""

    def __init__(self, stats: ProfileStats) -> None:
        self.stats = stats
        self.stop = threading.Event()
        self.target_steps = 0
        self.drafter_steps = 0
        self.last_loss = 0.0
        self.threads = [
            threading.Thread(target=self._target, name="target-0", daemon=True),
            threading.Thread(target=self._drafter, name="drafter-0", daemon=True),
        ]

    def _target(self) -> None:
        w = self.stats.worker("target-0")
        while not self.stop.is_set():
            w.add("target_forward", DT_TARGET)
            with w.span("pack_hidden"):
                sum(range(100))
            self.stats.count("tokens", TOKENS_PER_STEP)
            self.stats.count("samples", 2)
            self.target_steps += 1
            time.sleep(0.002)

    def _drafter(self) -> None:
        w = self.stats.worker("drafter-0")
        self.stats.metric("eval_tau", 3.25)
        while not self.stop.is_set():
            w.add("hs_queue_wait", DT_WAIT)
            w.add("drafter_forward", DT_TARGET)
            self.last_loss = 3.0 - 0.001 * self.drafter_steps
            self.stats.gauge("loss", self.last_loss)
            self.stats.gauge("lr", 1e-4)
            self.stats.gauge("hs_queue", 2)
            self.stats.metric("sim_tau", 2.5)
            self.stats.metric("per_position_acc", [0.875, 0.75, 0.5])
            self.stats.count("steps", 1)
            self.drafter_steps += 1
            time.sleep(0.002)

    def __enter__(self) -> Workload:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


@pytest.fixture
def exporter() -> Iterator[MetricsExporter]:
    e = MetricsExporter("prom", rank=0)
    yield e
    e.close()


def _cat(total: float, n: int, share: float = 0.25, device: P.DeviceStats | None = None) -> P.CategoryStats:
    mean = total / n if n else 0.0
    return P.CategoryStats(
        n=n, total=total, mean=mean, p50=mean, p95=mean * 2, max=mean * 3, share=share, device=device
    )


# --- the end-to-end scrape ----------------------------------------------------------------------------


def test_live_scrape_of_a_running_pipeline(sock_dir: Path, exporter: MetricsExporter) -> None:
    stats = ProfileStats()
    port = exporter.serve(0)
    assert port > 0 and exporter.port == port
    server = TelemetryServer(
        "prom",
        stats,
        interval_s=FAST,
        run_dir=None,
        socket_dir=sock_dir,
        nvml=False,
        on_publish=exporter.update,
    ).start()
    try:
        with Workload(stats) as work:
            # while it runs: the window quantiles and the verdict (both describe the current window)
            live = wait_for(
                port,
                lambda s: (
                    value(
                        s, "dflash_span_seconds", worker="target-0", category="target_forward", quantile="0.5"
                    )
                    is not None
                    # target-bound by its waits; its spans are booked with add() and spend no CPU, so where
                    # other processes hold every core the verdict says CPU-starved instead (the rule's job)
                    and 1 in (value(s, "dflash_bottleneck", verdict="target-bound"),
                              value(s, "dflash_bottleneck", verdict="CPU-starved"))
                ),
            )
            while work.target_steps < 20 or work.drafter_steps < 20:
                time.sleep(0.01)
        expected_tokens = work.target_steps * TOKENS_PER_STEP
        final = wait_for(port, lambda s: value(s, "dflash_tokens_total") == expected_tokens)
    finally:
        server.close()

    # window quantiles of a category whose spans all last DT_TARGET are exactly DT_TARGET
    for q in ("0.5", "0.95"):
        assert (
            value(live, "dflash_span_seconds", worker="target-0", category="target_forward", quantile=q)
            == DT_TARGET
        )
    assert sum(s.value for s in find(live, "dflash_bottleneck")) == 1
    share = value(live, "dflash_span_share", worker="drafter-0", category="hs_queue_wait")
    assert share is not None and 0.0 <= share <= 1.0
    assert value(live, "dflash_bottleneck_evidence", name="drafter.hs_queue_wait") > 0.2

    # cumulative counters and span totals equal what the workload recorded
    assert value(final, "dflash_samples_total") == work.target_steps * 2
    assert value(final, "dflash_steps_total") == work.drafter_steps
    cum = {
        ("target-0", "target_forward"): (work.target_steps, DT_TARGET),
        ("drafter-0", "hs_queue_wait"): (work.drafter_steps, DT_WAIT),
        ("drafter-0", "drafter_forward"): (work.drafter_steps, DT_TARGET),
    }
    for (worker, cat), (n, dt) in cum.items():
        assert value(final, "dflash_span_seconds_count", worker=worker, category=cat) == n
        assert value(final, "dflash_span_seconds_sum", worker=worker, category=cat) == pytest.approx(
            n * dt, rel=1e-9
        )
    assert (
        value(final, "dflash_span_seconds_count", worker="target-0", category="pack_hidden")
        == work.target_steps
    )
    assert value(final, "dflash_span_seconds_sum", worker="target-0", category="pack_hidden") > 0
    assert value(final, "dflash_tokens_per_second") is not None

    # gauges and metrics, named and generic
    assert value(final, "dflash_loss") == pytest.approx(work.last_loss)
    assert value(final, "dflash_lr") == pytest.approx(1e-4)
    assert value(final, "dflash_gauge", name="hs_queue") == 2
    assert value(final, "dflash_gauge", name="loss") is None  # loss has its own series, not both
    assert value(final, "dflash_sim_tau") == 2.5
    assert value(final, "dflash_eval_tau") == 3.25
    assert {s.labels["position"]: s.value for s in find(final, "dflash_position_accuracy")} == {
        "1": 0.875,
        "2": 0.75,
        "3": 0.5,
    }

    # the process, the bookkeeping, and the labels every series carries
    assert value(final, "dflash_process_rss_bytes") > 0
    assert value(final, "dflash_process_cpu_percent") is not None
    assert value(final, "dflash_snapshots_total") >= 2
    assert abs(value(final, "dflash_snapshot_timestamp_seconds") - time.time()) < 60
    assert not find(final, "dflash_gpu_utilization_percent")  # nvml=False: omitted, not 0
    for s in final:
        assert s.labels["run"] == "prom" and s.labels["rank"] == "0", s
        assert math.isfinite(s.value), s


# --- values that must be left out -----------------------------------------------------------------------


def test_nan_and_none_are_omitted_not_zero(exporter: MetricsExporter) -> None:
    snap = P.Snapshot(
        seq=1,
        t=time.time(),
        interval_s=1.0,
        workers={
            "target-0": {
                "target_forward": P.CategoryStats(
                    n=3, total=0.3, mean=0.1, p50=NAN, p95=0.2, max=0.2, share=NAN
                )
            }
        },
        cumulative={
            "target-0": {
                "target_forward": P.CategoryStats(n=3, total=NAN, mean=0.1, p50=0.1, p95=0.2, max=0.2),
                "pack_hidden": _cat(0.5, 10),
            }
        },
        counters={"tokens": NAN, "samples": 5},
        rates={"tokens": INF},
        gauges={"loss": NAN, "lr": 1e-4, "grad_norm": -INF, "hs_queue": 2, "odd": "x"},  # type: ignore[dict-item]
        metrics={"sim_tau": NAN, "eval_tau": 2.0, "per_position_acc": [0.9, NAN, 0.5], "some_list": [1.0]},
        nonfinite={"gauges.loss": "nan"},
        system=P.SystemSample(
            cpu_percent=NAN,
            rss_bytes=123,
            gpus=[
                P.GpuSample(
                    index=0, name="H200", util_percent=None, mem_used=5 << 30, power_w=NAN, temp_c=None
                )
            ],
        ),
        bottleneck=P.Bottleneck(verdict="drafter-bound", evidence={"x": NAN, "y": 0.5}),
    )
    exporter.update(None, snap)
    s = render(exporter)

    assert all(math.isfinite(x.value) for x in s)
    for absent in (
        "dflash_loss",
        "dflash_tokens_total",
        "dflash_tokens_per_second",
        "dflash_sim_tau",
        "dflash_process_cpu_percent",
        "dflash_gpu_utilization_percent",
        "dflash_gpu_power_watts",
        "dflash_gpu_temperature_celsius",
        "dflash_gpu_sm_clock_mhz",
    ):
        assert not find(s, absent), absent
    assert value(s, "dflash_gauge", name="grad_norm") is None
    assert value(s, "dflash_gauge", name="odd") is None
    assert value(s, "dflash_gauge", name="hs_queue") == 2
    assert value(s, "dflash_lr") == 1e-4
    assert value(s, "dflash_samples_total") == 5
    assert value(s, "dflash_eval_tau") == 2.0
    assert {x.labels["position"] for x in find(s, "dflash_position_accuracy")} == {"1", "3"}
    assert not find(s, "dflash_metric", name="some_list")
    assert value(s, "dflash_process_rss_bytes") == 123
    assert value(s, "dflash_gpu_memory_used_bytes", gpu="0") == 5 << 30
    # a NaN total takes its count with it (a summary's _sum and _count come as a pair)
    assert value(s, "dflash_span_seconds_sum", category="target_forward") is None
    assert value(s, "dflash_span_seconds_count", category="target_forward") is None
    assert value(s, "dflash_span_seconds", category="target_forward", quantile="0.5") is None
    assert value(s, "dflash_span_seconds", category="target_forward", quantile="0.95") == 0.2
    assert value(s, "dflash_span_seconds_count", category="pack_hidden") == 10
    assert value(s, "dflash_span_share", category="target_forward") is None
    assert value(s, "dflash_span_share", category="pack_hidden") == 0  # known zero: nothing this window
    assert value(s, "dflash_nonfinite", name="gauges.loss") == 1
    assert value(s, "dflash_bottleneck", verdict="drafter-bound") == 1
    assert value(s, "dflash_bottleneck", verdict="target-bound") == 0
    assert value(s, "dflash_bottleneck_evidence", name="y") == 0.5
    assert value(s, "dflash_bottleneck_evidence", name="x") is None


def test_update_never_raises_and_a_bad_snapshot_costs_only_its_series(exporter: MetricsExporter) -> None:
    exporter.update("not a summary", object())  # type: ignore[arg-type]
    exporter.update(None, None)  # type: ignore[arg-type]
    s = render(exporter)
    assert value(s, "dflash_snapshots_total") == 2
    # one malformed part (a worker table that is not a mapping) leaves the other parts intact
    snap = P.Snapshot(seq=1, t=time.time(), interval_s=1.0, workers={"w": 3}, gauges={"loss": 1.5})  # type: ignore[dict-item]
    exporter.update(None, snap)
    s = render(exporter)
    assert value(s, "dflash_loss") == 1.5
    assert not find(s, "dflash_span_share")


def test_gpu_device_time_and_unknown_verdict_series(exporter: MetricsExporter) -> None:
    dev = P.DeviceStats(n=4, total=0.04, mean=0.01, p50=0.01, p95=0.02, max=0.03)
    gpus = [
        P.GpuSample(
            index=i,
            name="H200",
            util_percent=97.0,
            mem_used=80 << 30,
            mem_total=141 << 30,
            power_w=650.0,
            temp_c=61.0,
            sm_clock_mhz=1980.0,
            process_mem=70 << 30,
        )
        for i in range(2)
    ]
    snap = P.Snapshot(
        seq=3,
        t=time.time(),
        interval_s=1.0,
        workers={"target-0": {"target_forward": _cat(0.04, 4, share=0.9, device=dev)}, "idle-0": {}},
        untracked={"target-0": 0.1, "idle-0": 1.0},
        cumulative={
            "target-0": {"target_forward": _cat(0.4, 40, device=dev)},
            "idle-0": {"eval": _cat(1.0, 1)},
        },
        system=P.SystemSample(cpu_percent=150.0, rss_bytes=1 << 30, gpus=gpus),
        bottleneck=P.Bottleneck(verdict="brand-new-verdict"),
    )
    exporter.update(None, snap)
    s = render(exporter)
    for gpu in ("0", "1"):
        assert value(s, "dflash_gpu_utilization_percent", gpu=gpu) == 97.0
        assert value(s, "dflash_gpu_memory_used_bytes", gpu=gpu) == 80 << 30
        assert value(s, "dflash_gpu_memory_total_bytes", gpu=gpu) == 141 << 30
        assert value(s, "dflash_gpu_power_watts", gpu=gpu) == 650.0
        assert value(s, "dflash_gpu_temperature_celsius", gpu=gpu) == 61.0
        assert value(s, "dflash_gpu_sm_clock_mhz", gpu=gpu) == 1980.0
        assert value(s, "dflash_gpu_process_memory_bytes", gpu=gpu) == 70 << 30
        assert value(s, "dflash_gpu_info", gpu=gpu, name="H200") == 1
    assert value(s, "dflash_span_device_seconds_count", worker="target-0") == 4
    assert value(s, "dflash_span_device_seconds_sum", worker="target-0") == 0.04
    assert value(s, "dflash_span_device_seconds", worker="target-0", quantile="0.95") == 0.02
    assert value(s, "dflash_span_seconds_count", worker="target-0") == 40
    # a worker present in the window that spent nothing in a category: share 0, no quantiles
    assert value(s, "dflash_span_share", worker="idle-0", category="eval") == 0
    assert not find(s, "dflash_span_seconds", worker="idle-0", quantile="0.5")
    assert value(s, "dflash_untracked_share", worker="idle-0") == 1.0
    # a verdict this module does not know yet is still exported, next to the known ones at 0
    assert value(s, "dflash_bottleneck", verdict="brand-new-verdict") == 1
    assert value(s, "dflash_bottleneck", verdict="unknown") == 0


# --- serving ---------------------------------------------------------------------------------------------


def test_busy_port_is_a_one_line_error(exporter: MetricsExporter) -> None:
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    try:
        with pytest.raises(MetricsServerError) as ei:
            exporter.serve(port)
        msg = str(ei.value)
        assert "\n" not in msg and f"port {port}" in msg and "in use" in msg and "0 picks a free one" in msg
        assert ei.value.__cause__ is None and ei.value.__suppress_context__
    finally:
        blocker.close()
    assert exporter.port is None
    for bad in (-1, 65536, "9400"):
        with pytest.raises(MetricsServerError, match="0-65535"):
            exporter.serve(bad)  # type: ignore[arg-type]
    served = exporter.serve(0)
    with pytest.raises(MetricsServerError, match=f"already served on port {served}"):
        exporter.serve(0)
    other = MetricsExporter("prom", rank=1)
    try:
        with pytest.raises(MetricsServerError, match="in use"):
            other.serve(served)
    finally:
        other.close()


def test_exporters_do_not_collide_and_close_frees_everything() -> None:
    def snap(tokens: float) -> P.Snapshot:
        return P.Snapshot(seq=1, t=time.time(), interval_s=1.0, counters={"tokens": tokens})

    a, b = MetricsExporter("job", rank=0), MetricsExporter("job", rank=1)
    a.update(None, snap(10))
    b.update(None, snap(20))
    pa, pb = a.serve(0), b.serve(0)
    assert pa != pb
    assert [(x.labels["rank"], x.value) for x in find(scrape(pa), "dflash_tokens_total")] == [("0", 10)]
    assert [(x.labels["rank"], x.value) for x in find(scrape(pb), "dflash_tokens_total")] == [("1", 20)]
    assert "dflash-metrics" in {t.name for t in threading.enumerate()}

    # a shared registry (e.g. one that also holds process metrics) carries both, and close() leaves it
    shared = CollectorRegistry()
    c, d = MetricsExporter("job", 0, registry=shared), MetricsExporter("job", 1, registry=shared)
    c.update(None, snap(1))
    d.update(None, snap(2))
    both = parse(generate_latest(shared).decode())
    assert {x.labels["rank"]: x.value for x in find(both, "dflash_tokens_total")} == {"0": 1, "1": 2}
    c.close()
    left = parse(generate_latest(shared).decode())
    assert {x.labels["rank"] for x in find(left, "dflash_tokens_total")} == {"1"}
    d.close()

    a.close()
    a.close()  # idempotent
    b.close()
    a.update(None, snap(99))  # after close: ignored, never raises
    with pytest.raises(MetricsServerError, match="closed"):
        a.serve(0)
    for port in (pa, pb):  # the ports are free again
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.close()


# --- cost --------------------------------------------------------------------------------------------------


def test_update_is_cheap_when_never_scraped() -> None:
    workers = {
        f"{'target' if i < 6 else 'drafter'}-{i}": {
            f"cat_{j:02d}": _cat(0.01 * (j + 1), 10 + j) for j in range(12)
        }
        for i in range(8)
    }
    snap = P.Snapshot(
        seq=1,
        t=time.time(),
        interval_s=1.0,
        workers=workers,
        cumulative=workers,
        counters={"tokens": 1e6, "samples": 1e3, "steps": 10},
        gauges={"loss": 2.0, "lr": 1e-4},
    )
    threads = threading.active_count()
    e = MetricsExporter("cheap")
    try:
        n = 500
        t0 = time.perf_counter()
        for _ in range(n):
            e.update(None, snap)
        per_call = (time.perf_counter() - t0) / n
        assert per_call < 2e-3, f"update took {per_call * 1e3:.3f} ms"
        assert threading.active_count() == threads  # nothing served: no thread
        # rendering happens at scrape time, and covers all 8 x 12 categories
        s = render(e)
        assert len(find(s, "dflash_span_seconds_count")) == 96
        assert len(find(s, "dflash_span_seconds", quantile="0.95")) == 96
    finally:
        e.close()


def test_importing_telemetry_stays_light(run_python) -> None:
    code = (
        "import sys\n"
        "import dflash.telemetry\n"
        "assert 'prometheus_client' not in sys.modules, 'dflash.telemetry pulled in prometheus_client'\n"
        "from dflash.telemetry.export.prometheus import MetricsExporter\n"
        "MetricsExporter('x').close()\n"
        "bad = [m for m in ('torch', 'textual', 'dflash_tui') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    run_python(code)
