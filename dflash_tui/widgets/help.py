"""`?` / F1: every key and what the numbers mean, so a first look needs no README.

The key list is built from the app's own bindings (a new key appears here by itself); the verdicts and
their thresholds come from the shared vocabulary (dflash.telemetry.wire.vocab), so a new verdict appears here
by itself too (dflash-top does not import the analysis: it only reads the verdict the trainer sends).
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.binding import Binding

from dflash.telemetry.wire.verdicts import HOLD_WINDOWS, VERDICT_SPAN_S, VERDICTS
from dflash_tui.widgets.modal import ReportScreen

#: action -> when it works, for keys that depend on the source
WHEN = {"pause": "replay", "step": "replay", "faster": "replay", "slower": "replay", "seek": "replay",
        "snapshot": "live", "record": "live", "trainer_stacks": "live", "rank": "multi-rank",
        "pick_rank": "multi-rank"}

TERMS = [
    ("window", "the time between two snapshots (the trainer's --telemetry-interval, 1 s by default). The "
               "bars and the table describe the latest window; the verdict judges the last "
               f"{VERDICT_SPAN_S:.0f} s of windows (its scope says which time it covers, and its evidence comes "
               "from that time); `dflash stats`, --once and the last snapshot of a finished run judge the whole run."),
    ("machine", "load against cores, CPU used by other processes, steal (a VM's host running other guests), and "
                "the pipeline workers' CPU time against their busy time: far below it means they wait for a core."),
    ("share", "the fraction of a worker's wall time in the window spent in one category (its spans). A "
              "worker's shares and its untracked part add up to 100%."),
    ("untracked", "the part of a worker's wall time no category covered: Python between spans, the GIL, "
                  "a stage without instrumentation. A large one means the spans miss where the time goes."),
    ("busy", "a role's working share: target forward + pack + h2d, drafter forward + backward + optimizer "
             "+ h2d."),
    ("p50 / p95 / max", "percentiles of one span's duration within the window; n is how many spans ended."),
    ("tok/s, ETA", "tokens trained per second over the last 10 s of training (evaluations left out); the "
                   "ETA is the time to the run's first limit (steps at the run's rate, or --max-time)."),
]


def verdicts() -> list[tuple[str, str]]:
    return [
        *((v.name, v.meaning) for v in VERDICTS.values()),
        ("EVALUATING", "training paused for an evaluation (speculative decoding against the target)."),
        ("hysteresis", f"a new verdict shows once it has won {HOLD_WINDOWS} judgements (one per window) in a "
                       "row; until then the standing one keeps its own evidence and its scope says `held`. After "
                       "unknown the next verdict shows at once."),
    ]


def help_rows(bindings: list[Binding]) -> list[tuple[str, list[tuple[str, str]]]]:
    """(section, [(name, explanation)]): every key of `bindings`, the terms, the verdicts."""
    keys = []
    for b in bindings:
        shown = ", ".join(k.strip() for k in (b.key_display or b.key).split(","))
        for name, char in (("question_mark", "?"), ("left_square_bracket", "["), ("right_square_bracket", "]"),
                           ("equals_sign", "=")):
            shown = shown.replace(name, char)
        action = b.action.split("(")[0]
        keys.append((shown, (b.tooltip or b.description) + (f"  ({WHEN[action]} only)" if action in WHEN else "")))
    keys.append(("escape", "close this or any overlay; un-zoom a panel"))
    return [("keys", keys), ("what the numbers mean", TERMS), ("bottleneck verdicts", verdicts())]


def help_renderable(bindings: list[Binding]) -> Group:
    """Each section a two-column grid, so a long explanation wraps under itself, not under the key."""
    parts: list[Text | Table] = []
    for title, rows in help_rows(bindings):
        parts.append(Text(title, style="bold underline"))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold", no_wrap=True)
        grid.add_column()
        for name, text in rows:
            grid.add_row(name, text)
        parts.extend([grid, Text("")])
    return Group(*parts)


class HelpScreen(ReportScreen):
    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "close")]
    BOX_TITLE = "dflash-top help"
    BODY_ID = "help-body"

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self.help = help_renderable(bindings)

    def body(self) -> Group:
        return self.help
