"""The line under the panels that names those out of view: on a small terminal (80x24 over ssh) the
stacked panels do not fit, and a panel scrolled away must still be findable. Each is named with the
number key that zooms it; the line is gone when every panel shows."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget


class PanelHint(Widget):
    DEFAULT_CSS = """
    PanelHint { height: 1; padding: 0 1; color: $text-muted; }
    """
    #: (zoom key, panel name) of the panels out of view, in the panels' order
    hidden: reactive[tuple[tuple[str, str], ...]] = reactive((), layout=True)

    def watch_hidden(self, hidden: tuple[tuple[str, str], ...]) -> None:
        self.display = bool(hidden)

    def render(self) -> Text:
        text = Text("out of view: ", no_wrap=True, overflow="ellipsis")
        for i, (key, name) in enumerate(self.hidden):
            text.append(f"{'  ' if i else ''}{key}", style="bold").append(f" {name}")
        return text.append(" · its number zooms it")
