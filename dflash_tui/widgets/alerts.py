"""The alert banner under the header: stalled workers in red, anomalous timings in yellow.

Hidden while there is nothing to say, so a healthy run's layout is the usual one. A stall names the
worker, the span it is stuck in, for how long, and its innermost Python frame (the stacks of every
thread are in the file the trainer wrote to `<run_dir>/stalls/`).
"""

from __future__ import annotations

from typing import Any

import msgspec
from rich.text import Text

from dflash_tui import fmt
from dflash_tui.state import RunState
from dflash_tui.widgets.base import TextPanel

STALL_STYLE = "bold white on red"
ANOMALY_STYLE = "bold black on yellow"
#: lines of each kind before "+N more" (the banner must not push the panels off an 80x24 screen)
MAX_LINES = 2


def stall_line(st: dict[str, Any]) -> str:
    """One line per stalled worker (the --once report and the banner say the same)."""
    where = f"in {st['category']}" if st.get("category") else "between spans"
    line = f"{st['worker']} {where} for {fmt.seconds(st['elapsed'])} (timeout {fmt.seconds(st['timeout'])})"
    if st.get("frame"):
        line += f" at {st['frame']}"
    return line


def alerts_text(state: RunState) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    rows: list[tuple[str, str, str]] = []
    stalls, anomalies = state.stalls, state.anomalies
    rows += [(" STALLED ", STALL_STYLE, stall_line(msgspec.to_builtins(s))) for s in stalls[:MAX_LINES]]
    if len(stalls) > MAX_LINES:
        rows.append((" STALLED ", STALL_STYLE, f"+{len(stalls) - MAX_LINES} more workers"))
    rows += [(" ANOMALY ", ANOMALY_STYLE, a.message or f"{a.worker}/{a.category} {a.stat} {a.ratio:.1f}x baseline")
             for a in anomalies[:MAX_LINES]]
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
        return alerts_text(state)

    def refresh_from(self, state: RunState) -> None:
        show = bool(state.stalls or state.anomalies)
        if self.display != show:
            self.display = show
        super().refresh_from(state)
