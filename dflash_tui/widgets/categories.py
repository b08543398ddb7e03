"""The per-category table: n, mean, p50, p95, max and share per worker, device time where the trainer
resolved CUDA events, and a sparkline of each row's recent mean.

A Line-API widget rather than a DataTable: with 8 workers x 12 categories every cell changes every
window, and re-rendering a DataTable that often cost more than the rest of the app together. Here
each row is one cached Strip, rebuilt only when its text changed, and only visible lines are drawn.
Rows keep a stable order (workers as first seen, categories in pipeline order) so a row does not
jump while you read it; the share column and the bars say which is hottest.
"""

from __future__ import annotations

from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from dflash_tui import fmt
from dflash_tui.state import Ring, RunState
from dflash_tui.widgets.palette import category_color, category_order

TREND_W = 12
#: (key, label, width, right-aligned); the first six fit in 80 columns, the rest scroll horizontally
COLUMNS = [("worker", "worker", 10, False), ("category", "category", 19, False), ("share", "share", 6, True),
           ("mean", "mean", 7, True), ("p95", "p95", 7, True), ("trend", "trend (mean)", TREND_W, False),
           ("p50", "p50", 7, True), ("max", "max", 7, True), ("n", "n", 6, True),
           ("dmean", "dev mean", 8, True), ("dp95", "dev p95", 8, True)]
GAP = 2
WIDTH = sum(w for _, _, w, _ in COLUMNS) + GAP * (len(COLUMNS) - 1)
HEADER = Style(bold=True, underline=True)
WORKER = Style(bold=True)
PLAIN = Style()  # never None: filters such as opacity read every segment's style
BLANK = Segment(" " * GAP, PLAIN)

Cells = tuple[str, ...]


@lru_cache(maxsize=256)
def _color(name: str) -> Style:
    return Style(color=category_color(name))


def _fit(text: str, width: int, right: bool) -> str:
    text = text[:width]
    return text.rjust(width) if right else text.ljust(width)


def row_strip(cells: Cells, category: str) -> Strip:
    """One table row as segments: the category's colour on its marker and its sparkline."""
    segs: list[Segment] = []
    color = _color(category)
    for i, ((key, _, width, right), text) in enumerate(zip(COLUMNS, cells, strict=True)):
        if i:
            segs.append(BLANK)
        if key == "category":
            segs.append(Segment("■ ", color))
            segs.append(Segment(_fit(text, width - 2, False), PLAIN))
        elif key == "trend":
            segs.append(Segment(_fit(text, width, False), color))
        elif key == "worker":
            segs.append(Segment(_fit(text, width, False), WORKER))
        else:
            segs.append(Segment(_fit(text, width, right), PLAIN))
    return Strip(segs, WIDTH)


def header_strip() -> Strip:
    segs: list[Segment] = []
    for i, (_, label, width, right) in enumerate(COLUMNS):
        if i:
            segs.append(BLANK)
        segs.append(Segment(_fit(label, width, right), HEADER))
    return Strip(segs, WIDTH)


class CategoryTable(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    CategoryTable { height: 1fr; }
    """

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.worker_filter: str | None = None
        self._header = header_strip()
        self._keys: list[str] = []
        #: key -> (cells without the trend, the category, its history ring)
        self._rows: dict[str, tuple[Cells, str, Ring | None]] = {}
        self._change: dict[str, tuple] = {}
        #: strips are built lazily, for the rows that are actually drawn
        self._strips: dict[str, Strip] = {}
        self._base: Style | None = None

    @property
    def row_count(self) -> int:
        return len(self._keys)

    def row_text(self, index: int) -> str:
        """A row's plain text (for tests and copy-paste)."""
        return self._strip(self._keys[index]).text

    def cycle_worker(self, state: RunState) -> str | None:
        """All workers -> each worker in turn -> all; returns the new filter."""
        names = list(state.known)
        if self.worker_filter is None:
            self.worker_filter = names[0] if names else None
        elif self.worker_filter in names and names.index(self.worker_filter) + 1 < len(names):
            self.worker_filter = names[names.index(self.worker_filter) + 1]
        else:
            self.worker_filter = None
        self.refresh_from(state)
        return self.worker_filter

    def refresh_from(self, state: RunState) -> None:
        keys: list[str] = []
        changed = False
        current = state.workers
        for worker, known in state.known.items():
            if self.worker_filter is not None and worker != self.worker_filter:
                continue
            cats = current.get(worker, {})
            for i, cat in enumerate(sorted(known, key=category_order)):
                ring = state.category_mean.get((worker, cat))
                st = cats.get(cat)
                label = worker if i == 0 else ""
                if st is None:  # idle in this window: keep the row, blank the numbers
                    cells: Cells = (label, cat, "0%", "", "", "", "", "", "0", "", "")
                else:
                    dev = st.device
                    cells = (label, cat, fmt.percent(st.share), fmt.seconds(st.mean), fmt.seconds(st.p95), "",
                             fmt.seconds(st.p50), fmt.seconds(st.max), fmt.count(st.n),
                             fmt.seconds(dev.mean) if dev is not None else "",
                             fmt.seconds(dev.p95) if dev is not None else "")
                key = f"{worker}\x00{cat}"
                keys.append(key)
                mark = (cells, len(ring.values), ring.values[-1]) if ring is not None and ring.values else (cells,)
                if self._change.get(key) != mark:
                    self._change[key] = mark
                    self._rows[key] = (cells, cat, ring)
                    self._strips.pop(key, None)
                    changed = True
        if keys != self._keys:
            for gone in set(self._keys) - set(keys):
                self._rows.pop(gone, None)
                self._change.pop(gone, None)
                self._strips.pop(gone, None)
            self._keys = keys
            self.virtual_size = Size(WIDTH, len(keys) + 1)
            changed = True
        if changed:
            self.refresh()
        title = "per-category timings"
        if self.worker_filter:
            title += f" [{self.worker_filter}] (w: next worker)"
        if self.parent is not None and self.parent.border_title != title:
            self.parent.border_title = title

    def _strip(self, key: str) -> Strip:
        strip = self._strips.get(key)
        if strip is None:
            cells, cat, ring = self._rows[key]
            trend = fmt.sparkline(ring.values, TREND_W) if ring is not None else ""
            strip = self._strips[key] = row_strip((*cells[:5], trend, *cells[6:]), cat)
        return strip

    def notify_style_update(self) -> None:
        self._base = None
        super().notify_style_update()

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.scrollable_content_region.width
        if self._base is None:
            self._base = self.rich_style
        if y == 0:
            strip = self._header
        else:
            index = scroll_y + y - 1
            strip = self._strip(self._keys[index]) if 0 <= index < len(self._keys) else Strip.blank(WIDTH, PLAIN)
        return strip.crop_extend(scroll_x, scroll_x + width, self._base)
