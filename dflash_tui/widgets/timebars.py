"""Where time goes: one bar per worker, split by each category's share of wall time, plus untracked.

Shares are per snapshot window. Untracked is the part of the window no category covered (the server
reports it; otherwise it is what the shares leave). The bar is drawn with largest-remainder rounding
so its segments always add up to the full width.

When the panel is wide enough, a "now" column (headed so) follows each bar: the worker's innermost open
span and how long it has been open (red when the watchdog calls the worker stalled), so a worker stuck in one
long call is visible while the call lasts, not only when it ends.
"""

from __future__ import annotations

from rich.text import Text

from dflash_tui import fmt
from dflash_tui.state import RunState
from dflash_tui.widgets.base import TextPanel
from dflash_tui.widgets.palette import UNTRACKED, category_color, category_order

LABEL_W = 12
SUFFIX_W = 11  # " untr 12.3%"
NOW_W = 23  # " drafter_backwar  3.21s"
#: narrower than this, the bars keep all the room and the "now" column is left out
NOW_MIN_WIDTH = 60
#: (category, seconds open, stalled) of a worker's innermost open span
NowCell = tuple[str, float, bool]


def split_width(parts: list[float], width: int) -> list[int]:
    """Integer widths proportional to `parts` that sum to exactly `width` (largest remainder)."""
    total = sum(parts)
    if total <= 0 or width <= 0:
        return [0] * len(parts)
    exact = [p / total * width for p in parts]
    widths = [int(x) for x in exact]
    left = width - sum(widths)
    for i in sorted(range(len(parts)), key=lambda i: -(exact[i] - widths[i]))[:left]:
        widths[i] += 1
    return widths


class TimeBars(TextPanel):
    def build(self, state: RunState, width: int) -> Text:
        rows = []
        snap = state.snapshot
        for worker, cats in state.workers.items():
            parts = sorted(((c, max(0.0, st.share)) for c, st in cats.items()), key=lambda p: category_order(p[0]))
            covered = sum(s for _, s in parts)
            untracked = snap.untracked.get(worker) if snap is not None else None
            if untracked is None:
                untracked = max(0.0, 1.0 - covered)
            rows.append((worker, parts, max(0.0, untracked)))
        bars = bars_text(rows, max(20, width), now_cells(state))
        sm = snap.sampling if snap is not None else None
        if sm is None or not rows:
            return bars
        # sampled from outside: a share is a fraction of samples, known to within the margin
        return Text(f"sampled: share of {sm.samples:,} samples per thread, ±{sm.margin:.1%} (95%); untracked: no "
                    "rule names the stack\n", style="italic magenta", no_wrap=True, overflow="crop").append_text(bars)


def now_cells(state: RunState) -> dict[str, NowCell]:
    stalled = {s.worker for s in state.stalls}
    return {w: (op.category, op.elapsed, w in stalled) for w, op in state.inflight.items()}


def bars_text(rows: list[tuple[str, list[tuple[str, float]], float]], width: int,
              now: dict[str, NowCell] | None = None) -> Text:
    t = Text(no_wrap=True, overflow="crop")
    if not rows:
        return t.append("no timings yet", style="dim")
    # as wide as the longest worker name: `batch-producer` must not read `batch-produ`
    label_w = max(LABEL_W, max(len(w) for w, _, _ in rows) + 1)
    show_now = now is not None and width >= NOW_MIN_WIDTH
    bar_w = max(8, width - label_w - SUFFIX_W - (NOW_W if show_now else 0))
    seen: dict[str, None] = {}
    if show_now:  # the column's heading: a bare name and time read as a total, not as what runs now
        t.append(f"{'':<{label_w + bar_w + SUFFIX_W}} {'now (open span)':<15} {'for':>6}\n", style="dim")
    for i, (worker, parts, untracked) in enumerate(rows):
        if i:
            t.append("\n")
        t.append(f"{worker:<{label_w}}", style="bold")
        names = [c for c, _ in parts] + ["(untracked)"]
        shares = [s for _, s in parts] + [untracked]
        for name, w in zip(names, split_width(shares, bar_w), strict=True):
            if not w:
                continue
            if name == "(untracked)":
                t.append("░" * w, style=UNTRACKED)
            else:
                t.append("█" * w, style=category_color(name))
        seen.update(dict.fromkeys(names[:-1]))  # every reported category, drawn or too thin to draw:
        # a legend that changed with rounding would change the panel's height, forcing a full layout
        t.append(f" untr {fmt.percent(untracked):>5}", style="dim")
        if show_now:
            cell = now.get(worker)  # type: ignore[union-attr]
            if cell is None:
                t.append(f" {'-':<15} {'':>6}", style="dim")
            else:
                cat, secs, stalled = cell
                t.append(f" {cat[:15]:<15} {fmt.seconds(secs):>6}",
                         style="bold white on red" if stalled else category_color(cat))
    # legend, wrapped to the width
    t.append("\n")
    col = 0
    for name in sorted(seen, key=category_order):
        item = len(name) + 3
        if col and col + item > width:
            t.append("\n")
            col = 0
        t.append("■ ", style=category_color(name)).append(name + " ", style="dim")
        col += item
    if col + 14 > width:
        t.append("\n")
    t.append("░ ", style=UNTRACKED).append("untracked", style="dim")
    return t
