"""The events log: checkpoints, evals and warnings from the trainer, and dflash-top's own notes
(disconnects, reattaches, saved py-spy snapshots), newest at the bottom.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from itertools import islice

from rich.text import Text
from textual.events import Resize
from textual.geometry import Size
from textual.reactive import Reactive
from textual.widgets import RichLog

from dflash_tui.state import MAX_EVENTS, LoggedEvent, RunState

KIND_STYLE = {"checkpoint": "green", "eval": "cyan", "phase": "bold cyan", "warning": "yellow", "error": "bold red",
              "info": "dim"}


class EventsLog(RichLog):
    DEFAULT_CSS = """
    EventsLog { height: 1fr; min-height: 4; }
    """
    #: A new line grows only this log's scrollable height. Textual's own `virtual_size` lays the whole
    #: screen out again on every change, and redraws all of it: each event cost dflash-top as much as
    #: two or three snapshots. The log lays out only when its scrollbar comes or goes (the one change
    #: that moves anything else); otherwise it redraws itself and its scrollbar's thumb.
    virtual_size: Reactive[Size] = Reactive(Size(0, 0), layout=False)

    def __init__(self, **kw) -> None:
        # wrapped at the panel's width: an event's message is what it says, and a cut one says less
        super().__init__(max_lines=MAX_EVENTS, wrap=True, min_width=20, markup=False, highlight=False, **kw)
        #: the state's `events_logged` when this log last caught up
        self._shown = 0
        #: the width the shown lines were wrapped at (0: none yet). A log wraps each line once, when it
        #: is written; lines written while the layout was still settling would keep a width the panel
        #: no longer has, so a change of width rewrites every retained event at the new one.
        self.wrapped_at = 0
        self._state: RunState | None = None

    def watch_virtual_size(self, old: Size, new: Size) -> None:
        room = self.scrollable_content_region.size
        if (old.height > room.height) != (new.height > room.height) or (old.width > room.width) != (
                new.width > room.width):
            self.refresh(layout=True)
        elif self.show_vertical_scrollbar:
            self.vertical_scrollbar.window_virtual_size = new.height

    def refresh_from(self, state: RunState) -> None:
        self._state = state
        width = self.scrollable_content_region.width
        if width and width != self.wrapped_at:
            self._rewrap(width)
            return
        fresh = min(state.events_logged - self._shown, len(state.events))  # more than the deque holds: lost
        self._shown = state.events_logged
        self._write(islice(state.events, len(state.events) - max(0, fresh), None))

    def on_resize(self, event: Resize) -> None:
        super().on_resize(event)
        width = self.scrollable_content_region.width
        if self._state is not None and width and width != self.wrapped_at:
            self._rewrap(width)
        # a panel above that appears (the cluster view) shortens the log without a write: keep the
        # newest event in view, as a write would
        self.scroll_end(animate=False, immediate=False, x_axis=False)

    def _rewrap(self, width: int) -> None:
        assert self._state is not None
        self.clear()
        self.wrapped_at = width
        self._shown = self._state.events_logged
        self._write(self._state.events)

    def _write(self, events: Iterable[LoggedEvent]) -> None:
        for ev in events:
            clock = time.strftime("%H:%M:%S", time.localtime(ev.t))
            self.write(Text.assemble((clock + " ", "dim"), (f"{ev.kind:<10} ", KIND_STYLE.get(ev.kind, "")),
                                     ev.message))
