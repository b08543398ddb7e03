"""The bottleneck verdict (target-, drafter-, data-bound, balanced) with the numbers behind it.

The verdict is computed by the trainer (dflash.telemetry.analysis); showing its evidence next to it
lets a reader check the claim instead of trusting it.
"""

from __future__ import annotations

from rich.text import Text

from dflash_tui import fmt
from dflash_tui.state import RunState
from dflash_tui.widgets.base import TextPanel

VERDICT_STYLE = {"target-bound": "bold white on dark_orange3", "drafter-bound": "bold white on purple4",
                 "data-bound": "bold black on yellow",
                 "input-bound": "bold black on cyan", "GIL-bound": "bold white on red3",
                 "CPU-starved": "bold white on dark_red", "balanced": "bold black on green",
                 "unknown": "bold white on grey35"}


#: evidence keys that count things (workers) rather than give a share of time
COUNT_KEYS = ("targets", "drafters", "workers", "producers", "depth", "count", "_n")


def evidence_value(key: str, v: float) -> str:
    """Shares (the analysis reports fractions of wall time) as percentages, counts as integers."""
    if not isinstance(v, (int, float)):
        return str(v)
    if key.endswith(COUNT_KEYS):
        return f"{v:.0f}" if float(v).is_integer() else fmt.number(v)
    if key.endswith("_s") or key.endswith("_time"):
        return fmt.seconds(v)
    return fmt.percent(v)  # every other figure is a share of wall time (busy can pass 100% on overlap)


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
    t.append(f" {b.verdict.upper()} ", style=VERDICT_STYLE.get(b.verdict, "bold reverse"))
    if b.reason:
        t.append("  " + b.reason)
    if b.evidence:
        t.append("\n")
        t.append("  ".join(f"{k} {evidence_value(k, v)}" for k, v in b.evidence.items()), style="dim")
    return t


class BottleneckPanel(TextPanel):
    WRAP = True

    def build(self, state: RunState, width: int) -> Text:
        return bottleneck_text(state)
