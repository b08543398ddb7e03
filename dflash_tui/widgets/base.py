"""TextPanel: a panel drawn from one Rich Text that is rebuilt from the state, and redrawn only when
that text actually changed (laid out again only when its height did, and otherwise only its changed lines
redrawn).

The text is rendered to Strips once per change and served line by line (Textual's Line API), which
costs a fraction of converting a Text through Textual's content pipeline on every redraw. At 2 Hz
with ten panels, this and skipping unchanged redraws keep dflash-top to a few percent of one core.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.containers import Vertical
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget

from dflash_tui.state import RunState

PLAIN = Style()  # never None: filters such as opacity read every segment's style


class Panel(Vertical):
    """A bordered, titled box around one panel of the dashboard, which the number keys can maximize."""

    ALLOW_MAXIMIZE = True

    def __init__(self, title: str, *children: Widget, **kw) -> None:
        super().__init__(*children, classes="panel", **kw)
        self.border_title = title


def cropped() -> Text:
    """An empty Text whose lines are cut at the panel's width with an ellipsis rather than wrapped: a
    dense panel keeps one row per item however narrow the terminal."""
    return Text(no_wrap=True, overflow="ellipsis")


def waiting_for_system() -> Text:
    """What the panels drawn from the trainer's system sample (GPUs, threads) say before the first one."""
    return cropped().append("waiting for a system sample", style="dim")


class TextPanel(Widget):
    DEFAULT_CSS = """
    TextPanel { height: auto; }
    """
    #: whether the text wraps at the panel's width (else long lines are cropped)
    WRAP = False

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._state: RunState | None = None
        self._text = Text("")
        self._strips: list[Strip] = []
        self._width = 0
        self._base: Style | None = None

    @property
    def content(self) -> Text:
        """The text on show (tests read it)."""
        return self._text

    def build(self, state: RunState, width: int) -> Text:
        raise NotImplementedError

    def refresh_from(self, state: RunState) -> None:
        self._state = state
        self._rebuild()

    def on_resize(self) -> None:
        self._rebuild(force=True)
        self.call_after_refresh(self._rebuild)  # heals a layout that raced this resize (see _rebuild)

    def _rebuild(self, force: bool = False) -> None:
        if self._state is None or not self.is_attached:
            return
        width = max(10, self.content_size.width or 80)
        text = self.build(self._state, width)
        if not force and text == self._text and width == self._width:
            if self.styles.height.is_auto and self.size.height not in (0, max(1, len(self._strips))):
                # a layout pass that raced a resize (seen on a busy machine) left the old height:
                # lay out again rather than show stale blank rows until the text next changes
                self.refresh(layout=True)
            return
        old, old_width = self._strips, self._width
        self._text, self._width = text, width
        self._strips = self._render_strips(text, width)
        if force or width != old_width or len(self._strips) != len(old):
            self.refresh(layout=len(self._strips) != len(old))
            return
        # Only the lines that changed are marked dirty: Textual keeps the others' rendered lines, and
        # re-rendering unchanged lines was most of dflash-top's CPU (a snapshot changes a few numbers).
        changed = [Region(0, y, width, 1) for y, (a, b) in enumerate(zip(old, self._strips, strict=True)) if a != b]
        if changed:
            self.refresh(*changed)

    def _render_strips(self, text: Text, width: int) -> list[Strip]:
        console = self.app.console
        if self.WRAP:
            lines = console.render_lines(text, console.options.update(width=width, height=None), pad=False)
        else:
            lines = list(Segment.split_lines(text.render(console)))
        return [Strip([s if s.style is not None else Segment(s.text, PLAIN) for s in line]) for line in lines]

    def get_content_height(self, container, viewport, width: int) -> int:
        return max(1, len(self._strips))

    def notify_style_update(self) -> None:
        self._base = None
        super().notify_style_update()

    def render_line(self, y: int) -> Strip:
        # the width the strips were made for, not content_size (a region lookup on every line): after a
        # resize they are made again, and Textual fits a line to the content width in any case
        width = self._width
        if self._base is None:  # rich_style walks every ancestor: once per style change, not per line
            self._base = self.rich_style
        strip = self._strips[y] if y < len(self._strips) else Strip.blank(width, PLAIN)
        return strip.crop_extend(0, width, self._base)
