"""The bottleneck verdict with the numbers behind it, the time they cover, and the machine's view.

The verdict is computed by the trainer (dflash.telemetry.verdict.published); showing its evidence and scope next to
it lets a reader check the claim instead of trusting it, and the machine line shows whether the trainer
gets the cores it asks for (what top and btop would show).
"""

from __future__ import annotations

from rich.text import Text

from dflash.telemetry.wire.table import evidence_text, machine_text, pipeline_cpu
from dflash.telemetry.wire.verdicts import style_of
from dflash_tui.state import RunState
from dflash_tui.widgets.base import TextPanel


def bottleneck_text(state: RunState) -> Text:
    b = state.bottleneck
    t = Text()
    ev = state.evaluating
    if ev is not None:  # the verdict would only say "too little timed work"
        t.append(" EVALUATING ", style="bold black on cyan")
        return t.append(f"  prompt {ev[0]}/{ev[1]}: training has paused for speculative decoding against the "
                        "target; the verdict returns with training")
    if b is None:
        return t.append("no verdict yet (needs a few snapshot windows)", style="dim")
    t.append(f" {b.verdict.upper()} ", style=style_of(b.verdict))
    if b.scope:
        t.append(f" {b.scope}", style="italic")
    if b.reason:
        t.append("  " + b.reason)
    if b.evidence:
        t.append("\n")
        t.append(evidence_text(b.evidence), style="dim")
    line = machine_line(state)
    if line:
        t.append("\n" + line + " (last window)", style="dim")
    return t


def machine_line(state: RunState) -> str | None:
    """The machine's view over the latest window, with the pipeline workers' CPU time against their busy time."""
    snap, sys_ = state.snapshot, state.system
    if snap is None or sys_ is None or sys_.machine is None:
        return None
    threads = {th.name: th.cpu_percent for th in sys_.threads}
    return machine_text(sys_.machine, sys_.cpu_percent, pipeline_cpu(snap.workers, snap.roles, threads))


class BottleneckPanel(TextPanel):
    WRAP = True

    def build(self, state: RunState, width: int) -> Text:
        return bottleneck_text(state)
