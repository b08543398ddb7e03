"""The hot-thread snapshot screen (`s`): threads hottest first, each stack innermost frame last, or the
reason py-spy could not attach with the fix and an offer of the trainer's own stacks (`t`).
"""

from __future__ import annotations

from rich.text import Text
from textual.binding import Binding

from dflash_tui.pyspy import TRAINER_STACKS, ProfileFailure, StackReport, thread_title
from dflash_tui.widgets.modal import ReportScreen


def report_text(report: StackReport, max_frames: int = 40) -> Text:
    t = Text()
    t.append(f"{report.source} of pid {report.pid}", style="bold")
    if report.saved:
        t.append(f"\nsaved {report.saved[-1]} (+ .json)", style="dim")
    for note in report.notes:
        t.append(f"\nnote: {note}", style="yellow")
    for th in report.threads:
        cpu = th.cpu_percent or 0.0
        style = "bold red" if cpu >= 80 else "bold yellow" if cpu >= 30 else "bold"
        t.append("\n\n").append(thread_title(th), style=style)
        frames = th.frames[-max_frames:]
        if len(th.frames) > max_frames:
            t.append(f"\n    ... {len(th.frames) - max_frames} outer frames", style="dim")
        if not frames:
            t.append("\n    (no Python frames: idle or in native code)", style="dim")
        for i, f in enumerate(frames):
            last = i == len(frames) - 1
            t.append("\n    ").append(f"{f.where():<32}", style="cyan" if last else "dim cyan")
            t.append(" " + f.name, style="bold" if last else "")
    return t


def failure_text(failure: ProfileFailure) -> Text:
    t = Text()
    t.append(f"{failure.what} failed\n", style="bold red")
    t.append(failure.reason + "\n")
    for note in failure.notes:
        t.append(f"note: {note}\n", style="yellow")
    if failure.fix:
        t.append("\nhow to fix:\n", style="bold")
        for fix in failure.fix:
            t.append(f"  • {fix}\n")
    return t


class StacksScreen(ReportScreen):
    """Shows one StackReport or ProfileFailure; the app swaps in a new result when `t`/`s` finish."""

    BINDINGS = [
        Binding("escape,q", "dismiss", "close"),
        Binding("t", "app.trainer_stacks", "trainer's stacks"),
        Binding("s", "app.snapshot", "py-spy again"),
    ]
    BOX_TITLE = "hot-thread snapshot"
    BODY_ID = "stacks-body"

    def __init__(self, result: StackReport | ProfileFailure) -> None:
        super().__init__()
        self.result = result
        self.BOX_TITLE = box_title(result)

    def body(self) -> Text:
        r = self.result
        return report_text(r) if isinstance(r, StackReport) else failure_text(r)

    def show(self, result: StackReport | ProfileFailure) -> None:
        """A new result (`t` or `s` pressed here): its own title, read from the top."""
        self.result = result
        self.BOX_TITLE = box_title(result)
        self.redraw(from_top=True)


def box_title(result: StackReport | ProfileFailure) -> str:
    if isinstance(result, ProfileFailure):
        return f"{result.what} failed"
    return "the trainer's own stacks" if result.source == TRAINER_STACKS else f"hot-thread snapshot ({result.source})"
