"""`j` in a replay: jump to a time of the run, typed as m:ss, h:mm:ss, seconds or a percentage."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Input, Static

from dflash_tui.widgets.modal import Dialog


def parse_time(text: str, length: float | None = None) -> float | None:
    """Seconds from the recording's start: "90", "1:30", "1:02:03", or "50%" (needs `length`)."""
    text = text.strip()
    try:
        if text.endswith("%"):
            return None if length is None else float(text[:-1]) / 100.0 * length
        seconds = 0.0
        for part in text.split(":"):
            seconds = seconds * 60 + float(part)
        return seconds if seconds >= 0 and len(text.split(":")) <= 3 else None
    except ValueError:
        return None


class JumpDialog(Dialog[str | None]):
    """Asks for a time; dismissed with what was typed (the app parses it: a bad one is said, not lost)."""

    BINDINGS = [Binding("escape", "dismiss(None)", "cancel")]
    BOX_TITLE = "jump to"

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def body(self) -> ComposeResult:
        yield Static(f"now {self.where}\nm:ss, h:mm:ss, seconds, or a percentage; enter jumps, escape cancels")
        yield Input(placeholder="e.g. 2:30 or 50%", id="jump-to")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)
