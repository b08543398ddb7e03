"""Training curves: loss, simulated tau and tokens/s over the kept history, one chart each.

Drawn with block characters (8 levels per row), several rows tall when the panel has the room, so
the curves read in a plain SSH terminal without any graphics protocol.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from dflash_tui import fmt
from dflash_tui.state import Ring, RunState
from dflash_tui.widgets.base import TextPanel

_LEVELS = " ▁▂▃▄▅▆▇█"
LABEL_W = 16


def chart(values: Sequence[float], width: int, height: int) -> list[str]:
    """The newest `width` values as `height` rows of block characters (top row first)."""
    vals = list(values)[-width:]
    if not vals:
        return [""] * height
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    steps = height * 8
    levels = [max(1, round((v - lo) / span * (steps - 1)) + 1) for v in vals]
    rows = []
    for r in range(height - 1, -1, -1):
        base = r * 8
        rows.append("".join(_LEVELS[min(8, max(0, lv - base))] for lv in levels))
    return rows


class CurvesPanel(TextPanel):
    def rows_per_chart(self) -> int:
        if self.screen.maximized is not None and self.screen.maximized is self.parent:
            return max(1, (self.app.size.height - 8) // 3)
        return 2 if self.screen.has_class("-wide") else 1

    def build(self, state: RunState, width: int) -> Text:
        return curves_text([("loss", state.loss, fmt.number), ("sim tau", state.tau, fmt.number),
                            ("tokens/s", state.tokens_per_s, fmt.count)], width, self.rows_per_chart())


def curves_text(series: list[tuple[str, Ring, object]], width: int, height: int) -> Text:
    t = Text(no_wrap=True, overflow="crop")
    chart_w = max(8, width - LABEL_W - 1)
    colors = {"loss": "magenta", "sim tau": "cyan", "tokens/s": "green"}
    for i, (name, ring, f) in enumerate(series):
        vals = ring.values
        rows = chart(vals, chart_w, height)
        last = f(vals[-1]) if vals else fmt.NA
        lo = f(min(vals)) if vals else fmt.NA
        hi = f(max(vals)) if vals else fmt.NA
        for r, row in enumerate(rows):
            if i or r:
                t.append("\n")
            if r == 0:
                label = f"{name} {last}"
                t.append(f"{label[:LABEL_W]:<{LABEL_W}} ", style="bold")
            elif r == len(rows) - 1:
                t.append(f"{(lo + '..' + hi)[:LABEL_W]:<{LABEL_W}} ", style="dim")
            else:
                t.append(" " * (LABEL_W + 1))
            t.append(row if row else "no data yet", style=colors.get(name, "white") if row else "dim")
        if height == 1:
            t.append(f"  {lo}..{hi}", style="dim")
    return t
