"""`r`: ask how long to record (and whether to sample only GIL holders), then show the top functions
of the resulting speedscope profile.
"""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Button, Checkbox, Input, Label, Static

from dflash_tui.jobs import RecordSettings
from dflash_tui.pyspy import RecordReport
from dflash_tui.widgets.modal import Dialog, ReportScreen


class RecordDialog(Dialog[RecordSettings | None]):
    BINDINGS = [Binding("escape", "dismiss(None)", "cancel"), Binding("g", "toggle_gil", "toggle --gil")]
    BOX_TITLE = "py-spy record"
    DEFAULT_CSS = """
    RecordDialog > Vertical { width: 76; }
    RecordDialog Horizontal { height: auto; }
    RecordDialog Input { width: 12; }
    RecordDialog Label { padding: 1 1 0 0; }
    RecordDialog Checkbox { border: none; padding: 0; height: auto; margin: 0 0 1 0; }
    RecordDialog Button { margin: 0 0 1 0; }
    """

    def __init__(self, defaults: RecordSettings) -> None:
        super().__init__()
        self.defaults = defaults

    def body(self) -> ComposeResult:
        with Horizontal():
            yield Label("seconds")
            yield Input(f"{self.defaults.seconds:g}", id="seconds", type="number")
        yield Checkbox("--gil (only threads holding the GIL)", self.defaults.gil, id="gil")
        yield Checkbox("--native: C/CUDA frames too, but py-spy then pauses every trainer thread at each "
                       "sample (100 a second): training slows while it records", self.defaults.native, id="native")
        yield Static("default: Python frames only, sampled without pausing the trainer", classes="dim")
        yield Button("record (enter)", variant="primary", id="start")

    def action_toggle_gil(self) -> None:
        box = self.query_one("#gil", Checkbox)
        box.value = not box.value

    def _settings(self) -> RecordSettings:
        try:
            seconds = float(self.query_one("#seconds", Input).value)
        except ValueError:
            seconds = self.defaults.seconds
        return RecordSettings(seconds=min(600.0, max(1.0, seconds)), gil=self.query_one("#gil", Checkbox).value,
                              native=self.query_one("#native", Checkbox).value)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(self._settings())

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(self._settings())


def record_text(r: RecordReport, limit: int = 25) -> Text:
    t = Text()
    mode = " --gil" if r.gil else ""
    mode += " --native" if r.native else ""
    t.append(f"py-spy record{mode} of pid {r.pid} for {r.seconds:g} s: {r.samples} samples\n", style="bold")
    # its directory and its name on lines of their own (from here when under here): a path that does not
    # fit an 80-column box breaks between the two, not in the middle of a name
    where = Path(shown_path(r.path))
    t.append("speedscope file (open it at https://www.speedscope.app):\n", style="dim")
    t.append(f"  {where.parent}/\n  {where.name}\n")
    for note in r.notes:
        t.append(f"note: {note}\n", style="yellow")
    total = max(1, r.samples)
    for python, title in ((True, "Python functions"), (False, "native frames (C/C++/CUDA; [lib] = no symbols)")):
        rows = [f for f in r.top if f.python == python][:limit]
        if not rows:
            continue
        t.append(f"\n{'self%':>6} {'total%':>7}  {title}\n", style="bold")
        for f in rows:
            t.append(f"{100 * f.self_samples / total:>6.1f} {100 * f.total_samples / total:>7.1f}  ")
            t.append(f.name, style="bold").append(f"  {f.where}\n", style="dim cyan")
    if r.threads:
        t.append("\nsamples per thread\n", style="bold")
        for name, n in sorted(r.threads.items(), key=lambda kv: -kv[1])[:16]:
            t.append(f"{n:>8}  {name}\n")
    return t


def shown_path(path: str) -> str:
    """`path` relative to the working directory when it lies under it (what a user can paste)."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


class ProfileScreen(ReportScreen):
    BINDINGS = [Binding("escape,q", "dismiss", "close"), Binding("r", "app.record", "record again")]
    BOX_TITLE = "top functions"
    BODY_ID = "profile-body"

    def __init__(self, report: RecordReport) -> None:
        super().__init__()
        self.report = report

    def body(self) -> Text:
        return record_text(self.report)
