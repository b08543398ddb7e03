"""Prometheus exposition of the trainer's telemetry (`dflash train --metrics-port`).

Clusters that already run Prometheus and Grafana should see a dflash job without dflash-top, so each
rank can serve `/metrics` over HTTP. The exporter is fed by the TelemetryServer's `on_publish` hook and
renders the latest snapshot only when Prometheus scrapes:

* `update()` stores a reference and returns: a trainer that nobody scrapes pays nothing per interval,
  and the publisher thread never waits on HTTP.
* A custom collector in the exporter's own CollectorRegistry (not the global default registry), so
  several exporters in one process (tests, several ranks) never collide, and every value comes from
  one consistent snapshot rather than from metric objects updated piecemeal.

Why spans are a *summary* and not a histogram: telemetry reaches us as per-window statistics
(n, total, p50, p95, max), never as raw span durations, so cumulative bucket counts cannot be built
honestly. `dflash_span_seconds{worker,category}` is therefore a Prometheus summary whose `_sum` and
`_count` are the cumulative (since start) total seconds and span count, exact, and whose
`quantile="0.5"|"0.95"` samples are the p50/p95 of the last telemetry window. That matches the
summary convention (quantiles over a recent sliding window, sum and count since start):
`rate(dflash_span_seconds_sum[1m])` is the fraction of a worker's time spent in a category, and
`rate(..._sum) / rate(..._count)` the mean span. Quantiles are omitted for windows without spans,
and they cannot be aggregated across workers or ranks (no summary quantile can). Device (CUDA event)
time, where resolved, is the same shape in `dflash_span_device_seconds`.

Series (every one labelled `run` and `rank`):

======================================  =====================================================
dflash_span_seconds{worker,category}     summary: cumulative _sum/_count, window p50/p95
dflash_span_device_seconds{...}          the same for device time of CUDA spans
dflash_span_share{worker,category}       window share of the worker's wall time
dflash_untracked_share{worker}           window share covered by no category
dflash_tokens/samples/steps_total        counters from ProfileStats.count()
dflash_counter_total{name}               any other counter
dflash_tokens_per_second                 tokens rate over the last window
dflash_loss, dflash_lr                   gauges
dflash_gauge{name}                       any other gauge (grad_norm, queue depths, cuda bytes)
dflash_sim_tau, dflash_eval_tau          metrics, when the trainer has set them
dflash_position_accuracy{position}       per_position_acc[k-1] as position="k" (block slot k)
dflash_metric{name}                      any other scalar metric
dflash_nonfinite{name}                   1 for a value the trainer produced as NaN/inf
dflash_process_cpu_percent, _rss_bytes   the trainer process; dflash_process_threads
dflash_gpu_*{gpu}                        utilization, memory used/total, power, temperature,
                                         SM clock, this process's memory; dflash_gpu_info{gpu,name}
dflash_bottleneck{verdict}               1 for the current verdict, 0 for the other known ones
dflash_bottleneck_evidence{name}         the shares the verdict was decided from
dflash_snapshot_timestamp_seconds        unix time of the latest snapshot (to alert on staleness)
dflash_snapshots_total                   snapshots received
dflash_telemetry_dropped_samples_total   samples telemetry discarded (non-finite, CUDA backlog)
======================================  =====================================================

A value that is missing (None) is omitted rather than exported as 0, and a non-finite value is
skipped (NaN would poison Grafana aggregates); `dflash_nonfinite` says which ones the trainer produced.

Torch-free, and `dflash.telemetry` does not import this module: prometheus_client is only loaded by
code that asks for the exporter.
"""

from __future__ import annotations

import errno
import logging
import math
import numbers
import threading
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dflash.telemetry.wire.verdicts import VERDICTS
from dflash.telemetry.wire.vocab import Counter

if TYPE_CHECKING:
    from prometheus_client.registry import CollectorRegistry

    from dflash.telemetry.summary import Summary
    from dflash.telemetry.wire.protocol import Snapshot, SpanStats

log = logging.getLogger("dflash.telemetry")

#: counters with a series of their own (the rest go to dflash_counter_total{name})
NAMED_COUNTERS = (Counter.TOKENS, Counter.SAMPLES, Counter.STEPS)
#: gauges with a series of their own (the rest go to dflash_gauge{name})
NAMED_GAUGES = {"loss": "dflash_loss", "lr": "dflash_lr"}
#: scalar metrics with a series of their own (the rest go to dflash_metric{name})
NAMED_METRICS = {"sim_tau": "dflash_sim_tau", "eval_tau": "dflash_eval_tau"}
POSITION_METRIC = "per_position_acc"
#: (field of GpuSample, metric name, help)
GPU_FIELDS = (
    ("util_percent", "dflash_gpu_utilization_percent", "GPU utilization (NVML), percent."),
    ("mem_used", "dflash_gpu_memory_used_bytes", "GPU memory in use by all processes, bytes."),
    ("mem_total", "dflash_gpu_memory_total_bytes", "GPU memory size, bytes."),
    ("power_w", "dflash_gpu_power_watts", "GPU power draw, watts."),
    ("temp_c", "dflash_gpu_temperature_celsius", "GPU temperature, degrees Celsius."),
    ("sm_clock_mhz", "dflash_gpu_sm_clock_mhz", "GPU SM clock, MHz."),
    ("process_mem", "dflash_gpu_process_memory_bytes", "GPU memory used by the trainer process, bytes."),
    ("sm_active", "dflash_gpu_sm_active_percent", "SMs busy (NVML GPM, Hopper and later), percent."),
    ("tensor_active", "dflash_gpu_tensor_active_percent", "Time tensor cores were in use (NVML GPM), percent."),
)

_SPAN_HELP = (
    "Time spent in a telemetry category: _sum/_count since start (exact), quantiles over the last "
    "telemetry window."
)
_DEVICE_HELP = (
    "Device (CUDA event) time of CUDA spans: _sum/_count since start, quantiles over the last window."
)


class MetricsServerError(RuntimeError):
    """The metrics endpoint could not be served; the message (one line) says what to change."""


def _num(value: object) -> float | None:
    """`value` as a float when it is a finite real number, else None (missing, NaN, inf, not a number)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    f = float(value)
    return f if math.isfinite(f) else None


def _client() -> Any:
    """prometheus_client.core, imported on first use so that an environment without it fails with
    advice (and only when metrics are asked for), not with a traceback at import."""
    try:
        import prometheus_client.core as core
    except ImportError:
        raise MetricsServerError(
            "prometheus_client is not installed; `pip install prometheus_client` to use --metrics-port"
        ) from None
    return core


class _Families:
    """The metric families of one scrape, created on first use so that a series with no valid value
    leaves no empty family behind. Every add skips missing and non-finite values."""

    def __init__(self, core: Any, base: Mapping[str, str]) -> None:
        self._core = core
        self._base_names = tuple(base)
        self._base_values = tuple(base.values())
        self._fams: dict[str, Any] = {}

    def _family(self, kind: str, name: str, doc: str, labels: Iterable[str]) -> Any:
        fam = self._fams.get(name)
        if fam is None:
            cls = {
                "gauge": self._core.GaugeMetricFamily,
                "counter": self._core.CounterMetricFamily,
                "summary": self._core.SummaryMetricFamily,
            }[kind]
            fam = self._fams[name] = cls(name, doc, labels=[*self._base_names, *labels])
        return fam

    def gauge(self, name: str, doc: str, value: object, labels: Mapping[str, str] | None = None) -> None:
        self._sample("gauge", name, doc, value, labels or {})

    def counter(self, name: str, doc: str, value: object, labels: Mapping[str, str] | None = None) -> None:
        self._sample("counter", name, doc, value, labels or {})

    def gauge_each(self, name: str, doc: str, values: Mapping[Any, object], label: str = "name") -> None:
        """One gauge series per key of `values`, labelled `label`=key (the "any other X, by name" families)."""
        for key, value in values.items():
            self._sample("gauge", name, doc, value, {label: str(key)})

    def _sample(self, kind: str, name: str, doc: str, value: object, labels: Mapping[str, str]) -> None:
        v = _num(value)
        if v is not None:
            self._family(kind, name, doc, labels).add_metric([*self._base_values, *labels.values()], v)

    def summary(
        self,
        name: str,
        doc: str,
        count: object,
        total: object,
        quantiles: Mapping[str, object],
        labels: Mapping[str, str],
    ) -> None:
        n, s = _num(count), _num(total)
        qs = [(q, v) for q, v in ((q, _num(v)) for q, v in quantiles.items()) if v is not None]
        if (n is None or s is None) and not qs:
            return
        fam = self._family("summary", name, doc, labels)
        values = [*self._base_values, *labels.values()]
        if qs:
            full = dict(zip((*self._base_names, *labels), values, strict=True))
            for q, v in qs:
                # SummaryMetricFamily has no public way to add quantiles; a sample is what it stores
                fam.add_sample(name, {**full, "quantile": q}, v)
        if n is not None and s is not None:
            fam.add_metric(values, n, s)

    def families(self) -> list[Any]:
        return list(self._fams.values())


class _AfterWrite:
    """A WSGI response body that calls `done` after the server has written it (a WSGI server calls
    the body's close() last, once every chunk is sent)."""

    def __init__(self, body: Any, done: Any) -> None:
        self.body, self.done = body, done

    def __iter__(self) -> Any:
        return iter(self.body)

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            self.done()


class MetricsExporter:
    """Serves the latest telemetry snapshot of one rank as Prometheus metrics.

        exporter = MetricsExporter(run, rank)
        port = exporter.serve(9400)          # or 0 for a free port
        TelemetryServer(run, stats, ..., on_publish=exporter.update).start()
        ...
        exporter.close()

    `update` runs on the telemetry publisher thread and `collect` on HTTP server threads; they share
    one reference, swapped atomically, so no lock is needed and a scrape never sees half a snapshot.
    """

    def __init__(self, run: str, rank: int = 0, registry: CollectorRegistry | None = None) -> None:
        core = _client()
        from prometheus_client.registry import CollectorRegistry

        self.run = run
        self.rank = rank
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self._core = core
        self._base = {"run": str(run), "rank": str(rank)}
        self._snapshot: Snapshot | None = None
        self._updates = 0
        self._dropped = 0.0
        self._warned: set[str] = set()
        self._httpd: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False
        #: set by a scrape that rendered the latest snapshot (see `wait_for_scrape`)
        self._scraped = threading.Event()
        self.registry.register(self)

    # --- feeding ------------------------------------------------------------------------------------

    def update(self, summary: Summary | None, snapshot: Snapshot) -> None:
        """Keep `snapshot` for the next scrape. Cheap and never raises: it is the TelemetryServer's
        `on_publish` hook, called on the publisher thread every interval."""
        try:
            if self._closed:
                return
            dropped = getattr(summary, "dropped", 0)
            if isinstance(dropped, int) and dropped > 0:
                self._dropped += dropped
            self._snapshot = snapshot
            self._updates += 1
            self._scraped.clear()
        except Exception:  # pragma: no cover - nothing above should raise; the hook must not anyway
            log.exception("metrics exporter: update failed")

    # --- serving ------------------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        """The port being served, or None."""
        return self._httpd.server_address[1] if self._httpd is not None else None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve `/metrics` on addr:port from a daemon thread and return the bound port (port 0 picks
        a free one). The default address is loopback: pass "0.0.0.0" (or "::") for a Prometheus on
        another host. Raises MetricsServerError with a one-line reason when it cannot bind."""
        if self._closed:
            raise MetricsServerError("this metrics exporter was closed; create a new one")
        if self._httpd is not None:
            raise MetricsServerError(f"metrics are already served on port {self.port}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise MetricsServerError(
                f"metrics port must be an integer 0-65535 (0 picks a free one), not {port!r}"
            )
        from prometheus_client.exposition import start_http_server

        try:
            httpd, thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise MetricsServerError(
                    f"metrics port {port} on {addr} is already in use; choose another --metrics-port "
                    "(0 picks a free one)"
                ) from None
            reason = e.strerror or str(e) or type(e).__name__
            raise MetricsServerError(f"cannot serve metrics on {addr}:{port}: {reason}") from None
        thread.name = "dflash-metrics"  # what dflash-top's thread list and py-spy show
        httpd.set_app(self._counting_scrapes(httpd.get_app()))
        self._httpd, self._thread = httpd, thread
        return int(httpd.server_address[1])

    def _counting_scrapes(self, inner: Any) -> Any:
        """prometheus_client's WSGI app, wrapped so that a scrape counts as having read the latest
        snapshot only once its response is written: the trainer exits right after `wait_for_scrape`,
        and a response cut off mid-body is no scrape at all."""

        def app(environ: Any, start_response: Any) -> Any:
            seen = self._snapshot

            def written() -> None:
                if seen is not None and seen is self._snapshot:
                    self._scraped.set()

            return _AfterWrite(inner(environ, start_response), written)

        return app

    def wait_for_scrape(self, timeout: float) -> bool:
        """Until a scrape has read the latest snapshot, at most `timeout` seconds; whether one did.
        Prometheus pulls, so a run's last numbers (the final evaluation's tau) exist for it only if the
        endpoint outlives them until the next scrape."""
        if self._httpd is None or timeout <= 0:
            return False
        return self._scraped.wait(timeout)

    def close(self) -> None:
        """Stop serving and leave the registry. Idempotent; takes up to the HTTP server's 0.5 s poll."""
        if self._closed:
            return
        self._closed = True
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        if httpd is not None:
            try:
                httpd.shutdown()
                httpd.server_close()
            except Exception:
                log.exception("metrics exporter: HTTP server shutdown failed")
            if thread is not None:
                thread.join(timeout=2.0)
        try:
            self.registry.unregister(self)
        except KeyError:
            pass

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the collector protocol (called by prometheus_client on each scrape) ------------------------

    def describe(self) -> list[Any]:
        """Nothing up front: the series depend on the snapshot (registering must not render one)."""
        return []

    def collect(self) -> list[Any]:
        """Render the latest snapshot. A section that fails is logged once and left out, so one bad
        value costs its own series, not the scrape."""
        fams = _Families(self._core, self._base)
        fams.counter("dflash_snapshots", "Telemetry snapshots received by the exporter.", self._updates)
        fams.counter(
            "dflash_telemetry_dropped_samples",
            "Telemetry samples discarded (non-finite durations, CUDA event backlog, errors).",
            self._dropped,
        )
        snap = self._snapshot
        if snap is not None:
            for section in (_snapshot_meta, _spans, _counters, _gauges, _metrics, _system, _bottleneck, _health):
                try:
                    section(fams, snap)
                except Exception as e:
                    if section.__name__ not in self._warned:
                        self._warned.add(section.__name__)
                        log.warning("metrics exporter: cannot export %s: %r", section.__name__.strip("_"), e)
        return fams.families()


# --- sections: one snapshot part each ------------------------------------------------------------------


def _snapshot_meta(f: _Families, snap: Snapshot) -> None:
    f.gauge("dflash_snapshot_timestamp_seconds", "Unix time of the latest telemetry snapshot.", snap.t)
    # "<map>.<name>" of counters, rates, gauges and metrics that were NaN/inf: a NaN loss must stay
    # alertable even though its own series is left out
    f.gauge_each("dflash_nonfinite",
                 "1 for a value the trainer produced as NaN or inf (left out of its own series).",
                 dict.fromkeys(snap.nonfinite or {}, 1))


def _spans(f: _Families, snap: Snapshot) -> None:
    window = snap.workers or {}
    cumulative = snap.cumulative or {}
    for worker in dict.fromkeys([*cumulative, *window]):
        cum_cats = cumulative.get(worker) or {}
        win_cats = window.get(worker)
        for cat in dict.fromkeys([*cum_cats, *(win_cats or {})]):
            labels = {"worker": str(worker), "category": str(cat)}
            c = cum_cats.get(cat)
            w = win_cats.get(cat) if win_cats is not None else None
            _span_summary(f, "dflash_span_seconds", _SPAN_HELP, c, w, labels)
            _span_summary(f, "dflash_span_device_seconds", _DEVICE_HELP, c.device if c is not None else None,
                          w.device if w is not None else None, labels)
            if win_cats is not None:
                # a worker that reported this window and spent nothing in `cat` really has share 0
                f.gauge("dflash_span_share",
                        "Fraction of the worker's wall time spent in the category over the last window.",
                        w.share if w is not None else 0.0, labels)
    f.gauge_each("dflash_untracked_share",
                 "Fraction of the worker's wall time covered by no category over the last window.",
                 snap.untracked or {}, label="worker")


def _span_summary(f: _Families, name: str, doc: str, cum: SpanStats | None, win: SpanStats | None,
                  labels: Mapping[str, str]) -> None:
    """One worker/category as a summary: _sum/_count since start from `cum`, quantiles of the window
    `win` when it had spans. Neither: no series (a category without CUDA spans has no device time)."""
    quantiles = {"0.5": win.p50, "0.95": win.p95} if win is not None and win.n else {}
    n, total = (cum.n, cum.total) if cum is not None else (None, None)
    f.summary(name, doc, n, total, quantiles, labels)


def _counters(f: _Families, snap: Snapshot) -> None:
    for name, value in (snap.counters or {}).items():
        if name in NAMED_COUNTERS:
            f.counter(f"dflash_{name}", f"{name.capitalize()} processed since the trainer started.", value)
        else:
            f.counter("dflash_counter", "Other trainer counters, by name.", value, {"name": str(name)})
    f.gauge("dflash_tokens_per_second", "Tokens per second over the last telemetry window.",
            (snap.rates or {}).get("tokens"))


def _gauges(f: _Families, snap: Snapshot) -> None:
    for name, value in (snap.gauges or {}).items():
        metric = NAMED_GAUGES.get(name)
        if metric is not None:
            f.gauge(metric, f"Latest training {name}.", value)
        else:
            f.gauge("dflash_gauge", "Other trainer gauges (grad_norm, queue depths, CUDA allocator).", value,
                    {"name": str(name)})


def _metrics(f: _Families, snap: Snapshot) -> None:
    for name, value in (snap.metrics or {}).items():
        if name == POSITION_METRIC and isinstance(value, list):
            f.gauge_each("dflash_position_accuracy", "Top-1 accuracy of block slot k (teacher-forced).",
                         {i + 1: acc for i, acc in enumerate(value)}, label="position")
        elif isinstance(value, list):
            continue  # no generic shape for other list metrics
        elif name in NAMED_METRICS:
            f.gauge(NAMED_METRICS[name], f"Latest {name} (tokens per verify round).", value)
        else:
            f.gauge("dflash_metric", "Other scalar training metrics, by name.", value, {"name": str(name)})


def _system(f: _Families, snap: Snapshot) -> None:
    sys_ = snap.system
    if sys_ is None:
        return
    f.gauge("dflash_process_cpu_percent", "CPU use of the trainer process (100 = one core).", sys_.cpu_percent)
    if sys_.rss_bytes:  # 0 is the field's default, not a real RSS
        f.gauge("dflash_process_rss_bytes", "Resident memory of the trainer process, bytes.", sys_.rss_bytes)
    if sys_.threads:
        f.gauge("dflash_process_threads", "Threads in the trainer process.", len(sys_.threads))
    for g in sys_.gpus or []:
        labels = {"gpu": str(g.index)}
        f.gauge("dflash_gpu_info", "GPU model, by index (always 1).", 1, {**labels, "name": str(g.name)})
        for field, metric, doc in GPU_FIELDS:
            f.gauge(metric, doc, getattr(g, field, None), labels)


def _bottleneck(f: _Families, snap: Snapshot) -> None:
    b = snap.bottleneck
    if b is None:
        return
    f.gauge_each("dflash_bottleneck",
                 "1 for the pipeline stage that bounds throughput now (see docs/telemetry.md).",
                 {v: int(v == b.verdict) for v in dict.fromkeys([*VERDICTS, str(b.verdict)])}, label="verdict")
    f.gauge_each("dflash_bottleneck_evidence", "Waits and busy shares the bottleneck verdict was decided from.",
                 b.evidence or {})


def _health(f: _Families, snap: Snapshot) -> None:
    """What each worker is in now, stalls and anomalies: the series to alert on."""
    for worker, op in (snap.inflight or {}).items():
        f.gauge("dflash_inflight_seconds", "How long each worker's innermost open span has been open.",
                op.elapsed, {"worker": str(worker), "category": str(op.category)})
    f.gauge("dflash_stalled_workers", "Workers the stall watchdog calls stalled now (alert on > 0).",
            len(snap.stalls or []))
    for st in snap.stalls or []:
        f.gauge("dflash_stall_seconds", "Seconds a stalled worker has completed no span.", st.elapsed,
                {"worker": str(st.worker), "category": str(st.category)})
    f.gauge("dflash_anomalies", "Worker/category timings deviating from their baseline now.",
            len(snap.anomalies or []))
    for a in snap.anomalies or []:
        f.gauge("dflash_anomaly_ratio", "A deviating timing over its baseline.", a.ratio,
                {"worker": str(a.worker), "category": str(a.category), "stat": str(a.stat)})


__all__ = ["MetricsExporter", "MetricsServerError"]
