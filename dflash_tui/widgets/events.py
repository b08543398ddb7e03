"""The events log: checkpoints, evals and warnings from the trainer, and dflash-top's own notes
(disconnects, reattaches, saved py-spy snapshots), newest at the bottom.
"""

from __future__ import annotations

import time
from itertools import islice

from rich.text import Text
from textual.widgets import RichLog

from dflash_tui.state import MAX_EVENTS, RunState

KIND_STYLE = {"checkpoint": "green", "eval": "cyan", "phase": "bold cyan", "warning": "yellow", "error": "bold red", "info": "dim"}


class EventsLog(RichLog):
    DEFAULT_CSS = """
    EventsLog { height: 1fr; min-height: 4; }
    """

    def __init__(self, **kw) -> None:
        # wrapped at the panel's width: an event's message is what it says, and a cut one says less
        super().__init__(max_lines=MAX_EVENTS, wrap=True, min_width=20, markup=False, highlight=False, **kw)
        #: the state's `events_logged` when this log last caught up
        self._shown = 0

    def refresh_from(self, state: RunState) -> None:
        fresh = min(state.events_logged - self._shown, len(state.events))  # more than the deque holds: lost
        self._shown = state.events_logged
        for ev in islice(state.events, len(state.events) - max(0, fresh), None):
            clock = time.strftime("%H:%M:%S", time.localtime(ev.t))
            self.write(Text.assemble((clock + " ", "dim"), (f"{ev.kind:<10} ", KIND_STYLE.get(ev.kind, "")),
                                     ev.message))
