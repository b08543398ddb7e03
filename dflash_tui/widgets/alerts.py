"""The alert banner under the header: stalled workers in red, anomalous timings in yellow.

Hidden while there is nothing to say, so a healthy run's layout is the usual one. A stall names the
worker, the span it is stuck in, for how long, and its innermost Python frame (the stacks of every
thread are in the file the trainer wrote to `<run_dir>/stalls/`).
"""

from __future__ import annotations

from typing import Any

import msgspec
from rich.text import Text

from dflash.telemetry.wire.protocol import Anomaly
from dflash_tui import fmt
from dflash_tui.state import RunState
from dflash_tui.widgets.base import TextPanel, cropped

STALL_STYLE = "bold white on red"
ANOMALY_STYLE = "bold black on yellow"
#: lines of each kind before "+N more" (the banner must not push the panels off an 80x24 screen)
MAX_LINES = 2


def stall_line(st: dict[str, Any], compact: bool = False) -> str:
    """One line per stalled worker (the --once report and the banner say the same). `compact` (80
    columns): the innermost function of the code that waits instead of the full frame."""
    where = f"in {st['category']}" if st.get("category") else "between spans"
    frame = st.get("frame") or ""
    if compact:
        line = f"{st['worker']} {st.get('category') or '(between spans)'} {fmt.seconds(st['elapsed'])} " \
               f">{fmt.seconds(st['timeout'])}"
        return line + (f" {frame.rsplit(' in ', 1)[-1]}()" if frame else "")
    line = f"{st['worker']} {where} for {fmt.seconds(st['elapsed'])} (timeout {fmt.seconds(st['timeout'])})"
    return line + (f" at {frame}" if frame else "")


def anomaly_line(a: Anomaly, compact: bool = False) -> str:
    """The trainer's message, or (80 columns) the same without the time it began."""
    if a.message and not compact:
        return a.message
    if a.stat.endswith("_per_s"):  # a rate against its limit (the allocator's churn), not a duration
        return f"{a.worker}/{a.category} {a.stat} {a.value:.0f}/s ({a.ratio:.1f}x the {a.baseline:.0f}/s limit)"
    return (f"{a.worker}/{a.category} {a.stat} {a.ratio:.1f}x baseline ({fmt.seconds(a.value)} vs "
            f"{fmt.seconds(a.baseline)})")


def alerts_text(state: RunState, width: int = 200) -> Text:
    t = cropped()
    rows: list[tuple[str, str, str]] = []
    stalls, anomalies = state.stalls, state.anomalies
    compact = width < 120
    rows += [(" STALLED ", STALL_STYLE, stall_line(msgspec.to_builtins(s), compact)) for s in stalls[:MAX_LINES]]
    if len(stalls) > MAX_LINES:
        rows.append((" STALLED ", STALL_STYLE, f"+{len(stalls) - MAX_LINES} more workers"))
    rows += [(" ANOMALY ", ANOMALY_STYLE, anomaly_line(a, compact)) for a in anomalies[:MAX_LINES]]
    if len(anomalies) > MAX_LINES:
        rows.append((" ANOMALY ", ANOMALY_STYLE, f"+{len(anomalies) - MAX_LINES} more"))
    for i, (tag, style, msg) in enumerate(rows):
        if i:
            t.append("\n")
        t.append(tag, style=style).append(" " + msg, style="bold")
    return t


class AlertBanner(TextPanel):
    DEFAULT_CSS = """
    AlertBanner { height: auto; padding: 0 1; background: $error 15%; }
    """

    def build(self, state: RunState, width: int) -> Text:
        return alerts_text(state, width)

    def refresh_from(self, state: RunState) -> None:
        show = bool(state.stalls or state.anomalies)
        if self.display != show:
            self.display = show
        super().refresh_from(state)
