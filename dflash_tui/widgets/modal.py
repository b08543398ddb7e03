"""The two kinds of overlay dflash-top opens: a small titled dialog that asks one thing (record, jump),
and a large titled scrolling report with its keys in a footer (help, stacks, a recorded profile).

Each overlay gives only its title and its body; the box, its look and the scrolling are here once.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from rich.console import RenderableType
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import Footer, Static

T = TypeVar("T")


class Dialog(ModalScreen[T], Generic[T]):
    """A centred box titled `BOX_TITLE` holding `body()`; the subclass dismisses it with the answer."""

    BOX_TITLE = ""
    DEFAULT_CSS = """
    Dialog { align: center middle; }
    Dialog > Vertical { width: 60; max-width: 100%; height: auto; border: round $accent; background: $surface;
                        padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        with Vertical() as v:
            v.border_title = self.BOX_TITLE
            yield from self.body()
        yield Footer()

    def body(self) -> ComposeResult:
        raise NotImplementedError


class ReportScreen(ModalScreen[None]):
    """A large box titled `BOX_TITLE` that scrolls one renderable (the Static `#BODY_ID`)."""

    BOX_TITLE = ""
    BODY_ID = "report-body"
    DEFAULT_CSS = """
    ReportScreen { align: center middle; }
    ReportScreen > Vertical { width: 96%; height: 92%; border: round $accent; background: $surface; }
    ReportScreen VerticalScroll { height: 1fr; padding: 0 1; }
    """

    def compose(self) -> ComposeResult:
        with Vertical() as v:
            v.border_title = self.BOX_TITLE
            with VerticalScroll():
                yield Static(self.body(), id=self.BODY_ID)
        yield Footer()

    def body(self) -> RenderableType:
        raise NotImplementedError

    def redraw(self, from_top: bool = False) -> None:
        """Show `body()` and `BOX_TITLE` again (its data changed), `from_top` scrolled back to the start;
        before compose, compose will draw them."""
        try:
            self.query_one(f"#{self.BODY_ID}", Static).update(self.body())
            self.query_one(Vertical).border_title = self.BOX_TITLE
            if from_top:
                self.query_one(VerticalScroll).scroll_home(animate=False)
        except NoMatches:
            pass
