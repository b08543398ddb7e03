"""Choosing a trainer: a picker when several sockets answer, a waiting screen when none does yet."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option

from dflash_tui.sources import SocketInfo


class PickerScreen(ModalScreen[Path | None]):
    BINDINGS = [Binding("escape,q", "dismiss(None)", "quit")]
    DEFAULT_CSS = """
    PickerScreen { align: center middle; }
    PickerScreen > Vertical { width: 90%; max-width: 100; height: auto; max-height: 90%;
                              border: round $accent; background: $surface; }
    PickerScreen OptionList { height: auto; max-height: 20; }
    """

    def __init__(self, sockets: list[SocketInfo]) -> None:
        super().__init__()
        self.sockets = sockets

    def compose(self) -> ComposeResult:
        with Vertical() as v:
            v.border_title = f"{len(self.sockets)} trainers running: pick one"
            yield OptionList(*[Option(f"{i.label}   {i.path}", id=str(i.path)) for i in self.sockets])
        yield Footer()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(Path(event.option.id))


class WaitingScreen(Screen[list[SocketInfo]]):
    """Shown while no trainer socket answers; the app polls discovery and dismisses it with what it finds."""

    BINDINGS = [Binding("q", "app.quit", "quit")]
    DEFAULT_CSS = """
    WaitingScreen { align: center middle; }
    WaitingScreen #waiting-text { width: auto; max-width: 100%; height: auto; border: round $accent; padding: 1 2; }
    """

    def __init__(self, directory: Path, run: Path | str | None = None) -> None:
        super().__init__()
        self.directory = directory
        self.run = run

    def compose(self) -> ComposeResult:
        what = "a trainer" if self.run is None else f"the trainer of {self.run}"
        yield Static(Text.assemble((f"waiting for {what}", "bold"),
                                   f"\n\nlooking for sockets in {self.directory} every second\n"
                                   "start one with:  dflash train --target tiny --data demo --run-dir runs/demo\n"
                                   "or replay a run: dflash-top runs/demo"), id="waiting-text")
        yield Footer()
