"""The per-category table as plain text, and the one way durations (and model TFLOP/s) are written.

The trainer's log, `dflash stats` and `dflash-top --once` print the same table from here, and
dflash-top's panels write their numbers with the same ``seconds``/``clock``, so a figure reads the
same wherever it appears; so do a verdict's evidence and the machine's one-line view. Pure: it imports
only the protocol and the vocabulary, and dflash-top may import it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from dflash.telemetry.wire.protocol import CategoryStats, DeviceStats, MachineSample
from dflash.telemetry.wire.vocab import WAIT_SUFFIXES, roles_of

NA = "-"


def seconds(v: float | None) -> str:
    """A span of time with the unit that keeps about 3 significant digits (ns, µs, ms, s), past 100 s
    as a clock (h:mm:ss); ``-`` for nothing or a non-finite value."""
    if v is None or not math.isfinite(v):
        return NA
    a = abs(v)
    if a == 0:
        return "0"
    if a < 1e-6:
        return f"{v * 1e9:.0f}ns"
    if a < 1e-3:
        return f"{v * 1e6:.1f}µs" if a < 1e-4 else f"{v * 1e6:.0f}µs"
    if a < 1:
        return f"{v * 1e3:.1f}ms" if a < 0.1 else f"{v * 1e3:.0f}ms"
    if a < 100:
        return f"{v:.2f}s"
    return clock(v)


def clock(v: float | None, short: bool = False) -> str:
    """Elapsed time as h:mm:ss; `short` drops the hours while there are none (1:25)."""
    if v is None or not math.isfinite(v) or v < 0:
        return NA
    h, rem = divmod(int(round(v)), 3600)
    m, sec = divmod(rem, 60)
    return f"{m}:{sec:02d}" if short and not h else f"{h}:{m:02d}:{sec:02d}"


def tflops(v: float | None) -> str:
    """Model TFLOP/s as the log line and dflash-top's header write them: whole past 100 (`407`), else
    three significant digits (`31.6`, `0.0213` on a CPU)."""
    if v is None or not math.isfinite(v):
        return NA
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


#: evidence keys that count things (workers, cores) rather than give a share of time
COUNT_KEYS = ("targets", "drafters", "workers", "producers", "depth", "count", "_n", "cores", "device_time")


def evidence_value(key: str, v: float) -> str:
    """One figure of a verdict's evidence: shares (fractions of wall time) as percentages, counts and
    cores as numbers, seconds as durations, milliseconds (a stage's device time per step) as such."""
    if not isinstance(v, (int, float)) or not math.isfinite(v):
        return str(v)
    if key.endswith(COUNT_KEYS):
        return f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"
    if key.endswith(("_s", "_time")):
        return seconds(v)
    if key.endswith(("_ms", "_ms_per_step")):
        return f"{v:,.1f} ms"
    p = v * 100  # every other figure is a share of wall time (busy can pass 100% on overlap)
    return f"{p:.0f}%" if p >= 99.5 else f"{p:.1f}%"


def evidence_text(evidence: dict[str, float]) -> str:
    """A verdict's evidence in one line, as the log and dflash-top print it."""
    return "  ".join(f"{k} {evidence_value(k, v)}" for k, v in evidence.items())


def busy_share(categories: Mapping[str, CategoryStats]) -> float:
    """The share of wall time a worker spent in spans that are not queue waits (its work)."""
    return sum(st.share for c, st in categories.items() if not c.endswith(WAIT_SUFFIXES))


def pipeline_cpu(workers: Mapping[str, Mapping[str, CategoryStats]], roles: Mapping[str, str] | None,
                 thread_cpu: Mapping[str, float]) -> tuple[float, float] | None:
    """(mean share of wall time a pipeline worker's thread ran on a CPU, mean share it was busy in spans
    that are not queue waits), from per-thread CPU percent; None without the workers' threads."""
    pipeline = [w for w, r in roles_of(workers, roles).items() if r is not None and w in thread_cpu]
    if not pipeline:
        return None
    cpu = sum(thread_cpu[w] for w in pipeline) / 100.0
    busy = sum(busy_share(workers[w]) for w in pipeline)
    return cpu / len(pipeline), busy / len(pipeline)


def machine_text(m: MachineSample, process_cpu: float, workers: tuple[float, float] | None = None) -> str:
    """The machine's view in one line: is the trainer getting the cores it asks for."""
    steal = f" | steal {m.steal_percent / 100:.1f}" if m.steal_percent is not None else ""
    idle = max(0.0, m.cores - m.busy_percent / 100)
    line = (f"machine: load {m.load1:.1f} on {m.cores} cores | other processes {m.others_percent / 100:.1f} cores"
            f" | idle {idle:.1f}{steal} | trainer {process_cpu / 100:.1f}")
    if workers is not None:
        line += f" | workers on a CPU {workers[0]:.0%} of the time, busy {workers[1]:.0%}"
    return line


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


def category_table(
    workers: Mapping[str, Mapping[str, CategoryStats]],
    limit: int = 12,
    *,
    by: str = "worker",
    window_s: float = 0.0,
    untracked: Mapping[str, float] | None = None,
) -> str:
    """The aligned per-category table, heaviest first.

    `by="worker"` gives one row per worker/category (share is of that worker's time);
    `by="category"` merges workers (share is then the mean over the workers that ran it).
    `limit` keeps the top rows by total time; the footer says how many were left out, the window's
    length (`window_s`, 0: a whole run) and each worker's untracked share.
    """
    rows: list[tuple[str, CategoryStats]] = []
    if by == "category":
        grouped: dict[str, list[CategoryStats]] = {}
        for cats in workers.values():
            for cat, cs in cats.items():
                grouped.setdefault(cat, []).append(cs)
        for cat, lst in grouped.items():
            merged = merge_category_stats(lst)
            merged.share = sum(c.share for c in lst) / len(lst)
            rows.append((cat, merged))
    elif by == "worker":
        rows = [(f"{worker}/{cat}", cs) for worker, cats in workers.items() for cat, cs in cats.items()]
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
        row = [name, str(cs.n), *(seconds(v) for v in (cs.total, cs.mean, cs.p50, cs.p95, cs.max)),
               f"{cs.share * 100:.1f}%"]
        if has_device:
            d = cs.device
            row += [seconds(d.total), seconds(d.mean)] if d else [NA, NA]
        lines.append(row)
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    out = []
    for r in lines:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        out.append("  ".join(cells).rstrip())
    notes = []
    if window_s:
        notes.append(f"window {seconds(window_s)}")
    if len(rows) > len(shown):
        notes.append(f"{len(rows) - len(shown)} more rows not shown")
    if untracked:
        notes.append("untracked: " + ", ".join(f"{w} {u * 100:.0f}%" for w, u in sorted(untracked.items())))
    if notes:
        out.append("(" + "; ".join(notes) + ")")
    return "\n".join(out)
