"""Per-thread CPU like `top -H`: native thread id, CPU%, Python thread name, hottest first.

These are the ids py-spy reports as os_thread_id, so a hot row here is the stack to look at in `s`.
dflash's own telemetry threads (the publisher, the GIL probe) are marked: their CPU is the monitor's,
not the trainer's.
"""

from __future__ import annotations

from rich.text import Text

from dflash.telemetry.wire.vocab import TELEMETRY_THREADS
from dflash_tui import fmt
from dflash_tui.state import RunState
from dflash_tui.widgets.base import TextPanel, cropped, waiting_for_system

BAR_W = 10


class ThreadsPanel(TextPanel):
    def __init__(self, max_rows: int = 12, **kw) -> None:
        super().__init__(**kw)
        self.max_rows = max_rows

    def build(self, state: RunState, width: int) -> Text:
        maximized = self.screen.maximized is not None and self.screen.maximized is self.parent
        rows = max(3, self.app.size.height - 8) if maximized else self.max_rows
        return threads_text(state, rows)


def threads_text(state: RunState, max_rows: int) -> Text:
    sys_ = state.system
    if sys_ is None:
        return waiting_for_system()
    t = cropped()
    names = state.thread_names()
    t.append("process ", style="dim").append(fmt.percent(sys_.cpu_percent, scale=1), style="bold")
    spark = fmt.sparkline(state.process_cpu.values, 12, lo=0)
    if spark:
        t.append(" " + spark, style="green")
    t.append("  rss ", style="dim").append(fmt.nbytes(sys_.rss_bytes))
    t.append("  threads ", style="dim").append(str(len(sys_.threads)))
    sampling = state.snapshot.sampling if state.snapshot is not None else None
    gil = sampling.gil if sampling is not None else {}
    if sampling is not None and sampling.gil_held is not None:
        t.append("  gil held ", style="dim").append(f"{sampling.gil_held:.0%}")
    t.append(f"\n{'TID':>8} {'CPU%':>6} {'':<{BAR_W}} NAME", style="bold dim")
    top = sorted(sys_.threads, key=lambda th: -th.cpu_percent)
    for th in top[:max_rows]:
        filled = min(BAR_W, round(th.cpu_percent / 100 * BAR_W))
        style = "red" if th.cpu_percent >= 80 else "yellow" if th.cpu_percent >= 30 else "green"
        t.append(f"\n{th.tid:>8} {th.cpu_percent:>6.1f} ")
        t.append("▇" * filled, style=style).append(" " * (BAR_W - filled))
        name = th.name or names.get(th.tid, "?")
        t.append(" " + name)
        if name in TELEMETRY_THREADS:
            t.append(" (dflash telemetry)", style="dim")
        if name in gil:  # sampled: the share of samples this thread held the GIL
            t.append(f"  gil {gil[name]:.0%}", style="dim")
    if len(top) > max_rows:
        t.append(f"\n{'':>8} ... {len(top) - max_rows} more (press 4 to enlarge)", style="dim")
    return t
