"""Window summaries: percentiles, merging windows, snapshot building and the log table.

Kept apart from stats.py so that readers of a recording (`dflash stats`, tests, the bench) can build
and print summaries without a live ProfileStats.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dflash.telemetry.wire.protocol import (
    Anomaly,
    Bottleneck,
    CategoryStats,
    DeviceStats,
    OpenSpan,
    Snapshot,
    Stall,
    SystemSample,
)
from dflash.telemetry.wire.table import category_table, merge_category_stats

WorkerStats = dict[str, dict[str, CategoryStats]]
MetricValue = float | list[float]


@dataclass
class Summary:
    """What ProfileStats.drain() hands the publisher: one window plus the running totals.

    It reuses the protocol's CategoryStats so that building a snapshot is a field copy, not a
    conversion (the publisher does this every interval).
    """

    #: unix time of the drain
    t: float
    #: measured length of the window (seconds since the previous drain)
    window_s: float
    #: worker -> category -> stats over this window (share = fraction of the worker's window wall time)
    workers: WorkerStats = field(default_factory=dict)
    #: worker -> fraction of the window not covered by any category
    untracked: dict[str, float] = field(default_factory=dict)
    #: worker -> category -> stats since the worker first appeared (share of its lifetime)
    cumulative: WorkerStats = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    rates: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, MetricValue] = field(default_factory=dict)
    #: samples or CUDA span pairs that were discarded (non-finite values, CUDA backlog overflow, errors)
    dropped: int = 0
    #: worker -> its innermost open span at the drain
    inflight: dict[str, OpenSpan] = field(default_factory=dict)
    #: worker -> seconds since it last completed a span (resolution: one window)
    since_done: dict[str, float] = field(default_factory=dict)
    #: worker -> its pipeline role (dflash.telemetry.wire.vocab.Role), as the worker registered it
    roles: dict[str, str] = field(default_factory=dict)
    #: worker -> the CUDA ordinal its stage computes on, as the worker registered it (host workers absent)
    devices: dict[str, int] = field(default_factory=dict)
    #: set by the publisher on the run's last window (monitors end what they have in force)
    final: bool = False
    #: filled in by the publisher: stalled workers (watchdog) and deviating timings (anomalies)
    stalls: list[Stall] = field(default_factory=list)
    anomalies: list[Anomaly] = field(default_factory=list)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (0.0 when empty).

    Nearest-rank always returns a value that was actually observed, which keeps p95 honest for the
    small windows (tens of samples) that a 1 s interval typically holds.
    """
    n = len(sorted_values)
    if n == 0:
        return 0.0
    rank = math.ceil(q * n)
    return sorted_values[min(n - 1, max(0, rank - 1))]


def category_stats(
    n: int, total: float, maximum: float, p50: float, p95: float, wall_s: float, device: DeviceStats | None = None
) -> CategoryStats:
    """Stats for one category; share is of `wall_s` (clamped to 1: a span may outlast the window)."""
    share = min(1.0, total / wall_s) if wall_s > 0 else 0.0
    mean = total / n if n else 0.0
    return CategoryStats(n=n, total=total, mean=mean, p50=p50, p95=p95, max=maximum, share=share, device=device)


def merge_windows(windows: Iterable[Mapping[str, Mapping[str, CategoryStats]]], wall_s: float) -> WorkerStats:
    """Merge per-window worker stats (e.g. the last N snapshots) into one worker -> category table."""
    parts: dict[str, dict[str, list[CategoryStats]]] = {}
    for window in windows:
        for worker, cats in window.items():
            wp = parts.setdefault(worker, {})
            for cat, cs in cats.items():
                wp.setdefault(cat, []).append(cs)
    return {
        worker: {cat: merge_category_stats(lst, wall_s) for cat, lst in cats.items()}
        for worker, cats in parts.items()
    }


def untracked_of(workers: Mapping[str, Mapping[str, CategoryStats]]) -> dict[str, float]:
    """Fraction of each worker's wall time that no category covers (nested spans can push the sum of
    shares past 1, hence the clamp)."""
    return {w: max(0.0, 1.0 - sum(c.share for c in cats.values())) for w, cats in workers.items()}


def _split_finite(values: Mapping[str, object]) -> tuple[dict[str, object], dict[str, str]]:
    """JSON has no NaN/inf (msgspec writes null, which then fails validation on the reader), so
    non-finite values leave the numeric maps and are reported by name instead: a NaN loss must be
    visible, not crash the TUI."""
    ok: dict[str, object] = {}
    bad: dict[str, str] = {}
    for k, v in values.items():
        if isinstance(v, list):
            if all(math.isfinite(x) for x in v):
                ok[k] = v
            else:
                bad[k] = "non-finite at " + ",".join(str(i) for i, x in enumerate(v) if not math.isfinite(x))
        elif math.isfinite(v):  # type: ignore[arg-type]
            ok[k] = v
        else:
            bad[k] = str(v)
    return ok, bad


def to_snapshot(
    summary: Summary,
    seq: int,
    interval_s: float,
    system: SystemSample | None = None,
    bottleneck: Bottleneck | None = None,
) -> Snapshot:
    """The snapshot frame for one drained window."""
    nonfinite: dict[str, str] = {}
    maps = {}
    for name in ("counters", "rates", "gauges", "metrics"):
        ok, bad = _split_finite(getattr(summary, name))
        maps[name] = ok
        nonfinite.update({f"{name}.{k}": v for k, v in bad.items()})
    return Snapshot(
        seq=seq,
        t=summary.t,
        interval_s=interval_s,
        window_s=summary.window_s,
        workers=summary.workers,
        untracked=summary.untracked,
        cumulative=summary.cumulative,
        counters=maps["counters"],
        rates=maps["rates"],
        gauges=maps["gauges"],
        metrics=maps["metrics"],
        nonfinite=nonfinite,
        system=system,
        bottleneck=bottleneck,
        inflight=summary.inflight,
        stalls=summary.stalls,
        anomalies=summary.anomalies,
        roles=summary.roles,
        devices=summary.devices,
    )


# --- the log table ------------------------------------------------------------------------------------


def format_profile_stats(
    summary: Summary | Snapshot | Mapping[str, Mapping[str, CategoryStats]],
    limit: int = 12,
    *,
    cumulative: bool = False,
    by: str = "worker",
) -> str:
    """The per-category table (``table.category_table``) of a drained Summary, a Snapshot (live or
    replayed) or a bare worker -> category mapping; `cumulative` takes the run's totals instead of
    the window."""
    if isinstance(summary, (Summary, Snapshot)):
        return category_table(summary.cumulative if cumulative else summary.workers, limit, by=by,
                              window_s=0.0 if cumulative else (summary.window_s or getattr(summary, "interval_s", 0.0)),
                              untracked=None if cumulative else summary.untracked)
    return category_table(summary, limit, by=by)
