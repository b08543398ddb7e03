"""Number formatting shared by the panels and the headless summary: short, unit-aware, N/A-safe.
Durations are written by ``dflash.telemetry.wire.table`` (``seconds``, ``clock``), as the trainer's log writes them.

Columns are narrow at 80x24, so every formatter returns at most ~7 characters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from dflash.telemetry.wire.table import NA, clock, seconds

__all__ = ["NA", "age", "clock", "count", "nbytes", "number", "percent", "seconds", "sparkline"]

_BLOCKS = " ▁▂▃▄▅▆▇█"


def age(v: float | None) -> str:
    """How long ago, to the precision that matters: 0.4s, 12s, 0:03:05."""
    if v is None or not math.isfinite(v):
        return NA
    if v < 10:
        return f"{max(0.0, v):.1f}s"
    if v < 100:
        return f"{v:.0f}s"
    return clock(v)


def percent(v: float | None, scale: float = 100.0) -> str:
    """A fraction (scale=100) or an already-percent value (scale=1) as `12.3%`."""
    if v is None or not math.isfinite(v):
        return NA
    p = v * scale
    return f"{p:.0f}%" if p >= 99.5 else f"{p:.1f}%"


def count(v: float | None) -> str:
    """12, 1.2K, 3.4M: counts and rates."""
    if v is None or not math.isfinite(v):
        return NA
    a = abs(v)
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if a >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}" if a >= 10 or v == int(v) else f"{v:.2f}"


def nbytes(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return NA
    a = abs(v)
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if a >= div:
            return f"{v / div:.1f}{unit}"
    return f"{v:.0f}B"


def number(v: float | None, digits: int = 3) -> str:
    if v is None or not math.isfinite(v):
        return NA
    return f"{v:.{digits}g}"


def sparkline(values: Sequence[float], width: int, lo: float | None = None, hi: float | None = None) -> str:
    """The newest `width` values as block characters, scaled to [lo, hi] (default: their min/max)."""
    vals = list(values)[-width:] if width > 0 else []
    if not vals:
        return ""
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    span = hi - lo
    top = len(_BLOCKS) - 1
    if span <= 0:
        level = top // 2 if hi > 0 else 1
        return _BLOCKS[level] * len(vals)
    out = []
    for v in vals:
        x = (v - lo) / span
        out.append(_BLOCKS[max(1, min(top, round(x * (top - 1)) + 1))])
    return "".join(out)
