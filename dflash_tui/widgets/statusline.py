"""One line at the bottom: what dflash-top is doing (py-spy running, replay speed) and the last problem
with the stream (a malformed frame is reported here and reading goes on).
"""

from __future__ import annotations

from rich.text import Text

from dflash_tui.state import RunState
from dflash_tui.widgets.base import TextPanel, cropped


class StatusLine(TextPanel):
    DEFAULT_CSS = """
    StatusLine { height: 1; background: $boost; padding: 0 1; }
    """

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.job_text: str | None = None
        #: a replay's position / length / speed, set by the app on each refresh
        self.replay_text: str | None = None

    def build(self, state: RunState, width: int) -> Text:
        t = cropped()
        if self.job_text:
            t.append(self.job_text + "  ", style="bold cyan")
        if state.rank_note:
            t.append(state.rank_note + "  ", style="bold yellow")
        if self.replay_text and state.connection in ("paused", "replay", "ended"):
            t.append("replay ", style="dim").append(self.replay_text + "  ", style="bold")
            if state.connection == "ended":
                t.append("ended  ", style="dim")
        elif state.connection in ("incompatible", "disconnected", "ended", "paused", "replay", "connecting"):
            t.append(state.connection_detail + "  ", style="bold red" if state.connection == "incompatible" else "")
        if state.last_error:
            t.append(f"⚠ {state.bad_frames} bad frame{'s' if state.bad_frames != 1 else ''}: {state.last_error}",
                     style="yellow")
        elif not self.job_text and state.connection == "live" and state.hello is not None:
            # the cadence, not a count: a number that ticks every snapshot at the screen's last row would
            # make every frame redraw everything between the header and here (Textual redraws the box
            # around all the changed lines); the header's uptime already shows the stream moving
            t.append(f"a snapshot every {state.hello.interval_s:g} s", style="dim")
        return t
