"""Choosing: a trainer when several sockets answer (a multi-rank job counts once), a rank of the job
(`g`), and a waiting screen while no trainer answers yet."""

from __future__ import annotations

from pathlib import Path
from typing import Generic, TypeVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, OptionList, Static
from textual.widgets.option_list import Option

from dflash.telemetry.wire.sockets import SocketInfo
from dflash_tui.ranks import RankChoice, job_label

T = TypeVar("T")


class ChoiceScreen(ModalScreen[T | None], Generic[T]):
    """A titled list; enter dismisses with the chosen value, escape with None."""

    BINDINGS = [Binding("escape,q", "dismiss(None)", "close")]
    DEFAULT_CSS = """
    ChoiceScreen { align: center middle; }
    ChoiceScreen > Vertical { width: 90%; max-width: 100; height: auto; max-height: 90%;
                              border: round $accent; background: $surface; }
    ChoiceScreen OptionList { height: auto; max-height: 20; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, title: str, choices: list[tuple[str | Text, T]], highlighted: int | None = None) -> None:
        super().__init__()
        self.title_text = title
        self.choices = choices
        self.highlighted = highlighted

    def compose(self) -> ComposeResult:
        with Vertical() as v:
            v.border_title = self.title_text
            options = OptionList(*[Option(label, id=str(i)) for i, (label, _) in enumerate(self.choices)])
            if self.highlighted is not None:
                options.highlighted = self.highlighted
            yield options
        yield Footer()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.choices[int(event.option.id)][1])


def rank_label(c: RankChoice) -> Text:
    """A rank picker line: rank, host, what rank 0 last said of it (STALE in red), its socket or why none."""
    label = Text(f"r{c.rank:<4} {(c.info.host if c.info else '') or '-':<16.16} ")
    label.append(f"{('STALE' if c.info.stale else c.info.state) if c.info else '?':<9}",
                 style="bold red" if c.info and c.info.stale else "")
    label.append(f" {c.path}" if c.path is not None else f" {c.why}", style="" if c.path is not None else "dim")
    return label


class PickerScreen(ChoiceScreen[Path]):
    """Several trainers answer: pick one. A multi-rank job is one entry (its lowest rank here)."""

    BINDINGS = [Binding("escape,q", "dismiss(None)", "quit")]

    def __init__(self, jobs: list[list[SocketInfo]]) -> None:
        super().__init__(f"{len(jobs)} trainers running: pick one",
                         [(f"{job_label(job)}   {job[0].path}", job[0].path) for job in jobs])
        self.jobs = jobs


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
