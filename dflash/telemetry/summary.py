"""Window summaries: percentiles, merging windows, snapshot building and the log table.

Kept apart from stats.py so that readers of a recording (`dflash stats`, tests, the bench) can build
and print summaries without a live ProfileStats.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dflash.telemetry.protocol import (
    Anomaly,
    Bottleneck,
    CategoryStats,
    DeviceStats,
    OpenSpan,
    Snapshot,
    Stall,
    SystemSample,
)

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


def merge_category_stats(parts: Sequence[CategoryStats], wall_s: float | None = None) -> CategoryStats:
    """Combine several windows (or workers) of one category.

    n, total, mean and max are exact. Percentiles cannot be recovered from summaries, so p50/p95 are
    the n-weighted mean of the parts' percentiles: an approximation, good enough for a log table and
    documented as such in docs/telemetry.md. `share` is total/wall_s when wall_s is given.
    """
    n = sum(p.n for p in parts)
    total = sum(p.total for p in parts)
    maximum = max((p.max for p in parts), default=0.0)
    w = n or 1
    p50 = sum(p.p50 * p.n for p in parts) / w
    p95 = sum(p.p95 * p.n for p in parts) / w
    share = min(1.0, total / wall_s) if wall_s else 0.0
    dev_parts = [p.device for p in parts if p.device is not None]
    device = None
    if dev_parts:
        dn = sum(d.n for d in dev_parts)
        dt = sum(d.total for d in dev_parts)
        dw = dn or 1
        device = DeviceStats(
            n=dn,
            total=dt,
            mean=dt / dw,
            p50=sum(d.p50 * d.n for d in dev_parts) / dw,
            p95=sum(d.p95 * d.n for d in dev_parts) / dw,
            max=max(d.max for d in dev_parts),
            share=min(1.0, dt / wall_s) if wall_s else 0.0,
        )
    return CategoryStats(
        n=n, total=total, mean=total / w if n else 0.0, p50=p50, p95=p95, max=maximum, share=share, device=device
    )


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
    )


# --- the log table ------------------------------------------------------------------------------------


def format_duration(seconds: float) -> str:
    """Short human duration: 850ns, 12.3us, 4.56ms, 1.23s, 2m03s."""
    s = abs(seconds)
    if s == 0:
        return "0"
    if s < 1e-6:
        return f"{seconds * 1e9:.0f}ns"
    if s < 1e-3:
        return f"{seconds * 1e6:.3g}us"
    if s < 1:
        return f"{seconds * 1e3:.3g}ms"
    if s < 120:
        return f"{seconds:.3g}s"
    m, sec = divmod(int(round(seconds)), 60)
    return f"{m}m{sec:02d}s"


def format_profile_stats(
    summary: Summary | Snapshot | Mapping[str, Mapping[str, CategoryStats]],
    limit: int = 12,
    *,
    cumulative: bool = False,
    by: str = "worker",
) -> str:
    """The aligned per-category table for the trainer log, heaviest first.

    Accepts a drained Summary, a Snapshot (live or replayed) or a bare worker -> category mapping.
    `by="worker"` gives one row per worker/category (share is of that worker's time);
    `by="category"` merges workers (share is then the mean over the workers that ran it).
    `limit` keeps the top rows by total time; the footer says how many were left out.
    """
    if isinstance(summary, (Summary, Snapshot)):
        table = summary.cumulative if cumulative else summary.workers
        window = getattr(summary, "window_s", 0.0) or getattr(summary, "interval_s", 0.0)
        untracked = {} if cumulative else summary.untracked
    else:
        table, window, untracked = summary, 0.0, {}

    rows: list[tuple[str, CategoryStats]] = []
    if by == "category":
        grouped: dict[str, list[CategoryStats]] = {}
        for cats in table.values():
            for cat, cs in cats.items():
                grouped.setdefault(cat, []).append(cs)
        for cat, lst in grouped.items():
            merged = merge_category_stats(lst)
            merged.share = sum(c.share for c in lst) / len(lst)
            rows.append((cat, merged))
    elif by == "worker":
        for worker, cats in table.items():
            for cat, cs in cats.items():
                rows.append((f"{worker}/{cat}", cs))
    else:
        raise ValueError(f"by must be 'worker' or 'category', not {by!r}")

    rows.sort(key=lambda r: r[1].total, reverse=True)
    shown = rows[: max(0, limit)]
    has_device = any(cs.device is not None for _, cs in shown)
    header = ["category", "n", "total", "mean", "p50", "p95", "max", "share"]
    if has_device:
        header += ["dev total", "dev mean"]
    lines = [header]
    for name, cs in shown:
        row = [
            name,
            str(cs.n),
            format_duration(cs.total),
            format_duration(cs.mean),
            format_duration(cs.p50),
            format_duration(cs.p95),
            format_duration(cs.max),
            f"{cs.share * 100:.1f}%",
        ]
        if has_device:
            d = cs.device
            row += [format_duration(d.total), format_duration(d.mean)] if d else ["-", "-"]
        lines.append(row)
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    out = []
    for r in lines:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        out.append("  ".join(cells).rstrip())
    notes = []
    if window and not cumulative:
        notes.append(f"window {format_duration(window)}")
    if len(rows) > len(shown):
        notes.append(f"{len(rows) - len(shown)} more rows not shown")
    if untracked:
        notes.append(
            "untracked: " + ", ".join(f"{w} {u * 100:.0f}%" for w, u in sorted(untracked.items()))
        )
    if notes:
        out.append("(" + "; ".join(notes) + ")")
    return "\n".join(out)
