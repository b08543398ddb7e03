"""The per-category table: n, mean, p50, p95, max and share per worker, device time where the trainer
resolved CUDA events, and a sparkline of each row's recent mean.

A Line-API widget rather than a DataTable: with 8 workers x 12 categories every cell changes every
window, and re-rendering a DataTable that often cost more than the rest of the app together. Here
each row is one cached Strip, rebuilt only when its text changed, and only visible lines are drawn.
Rows keep a stable order by default (workers as first seen, categories in pipeline order) so a row
does not jump while you read it; `o` sorts them by share, p95 or name instead (then every row names
its worker). The worker column is as wide as the longest worker name, so no name is cut.
"""

from __future__ import annotations

from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual.geometry import Region, Size
from textual.scroll_view import ScrollView
from textual.strip import Strip

from dflash_tui import fmt
from dflash_tui.state import Ring, RunState
from dflash_tui.widgets.base import PLAIN
from dflash_tui.widgets.palette import category_color, category_order

#: the trend column takes the room the others leave, within these bounds
TREND_MIN, TREND_MAX = 8, 24
#: (key, label, width, right-aligned), in the order shown; every row's cells are in this order
COLUMNS = [("worker", "worker", 10, False), ("category", "category", 19, False), ("share", "share", 6, True),
           ("mean", "mean", 7, True), ("p95", "p95", 7, True), ("trend", "trend (mean)", TREND_MIN, False),
           ("p50", "p50", 7, True), ("max", "max", 7, True), ("n", "n", 6, True),
           ("dmean", "dev mean", 8, True), ("dp95", "dev p95", 8, True)]
#: shown whenever the panel is wide enough for them whole (from 72 columns); narrower, it scrolls sideways
ALWAYS = ("worker", "category", "share", "mean", "p95", "trend")
#: the others, most wanted first, each shown only where it fits whole (device times only where the
#: trainer resolved CUDA events): a column cut at the panel's edge read as a wrong number
OPTIONAL = ("max", "p50", "n", "dmean", "dp95")
DEVICE = ("dmean", "dp95")
CELL = {key: i for i, (key, *_) in enumerate(COLUMNS)}
GAP = 2
#: the table's row orders, in the order `o` cycles through them
SORTS = ("pipeline", "share", "p95", "name")
HEADER = Style(bold=True, underline=True)
WORKER = Style(bold=True)
BLANK = Segment(" " * GAP, PLAIN)

Cells = tuple[str, ...]


@lru_cache(maxsize=256)
def _color(name: str) -> Style:
    return Style(color=category_color(name))


def _fit(text: str, width: int, right: bool) -> str:
    text = text[:width]
    return text.rjust(width) if right else text.ljust(width)


def columns(worker_w: int, width: int = 10_000, device: bool = True) -> list[tuple[str, str, int, bool]]:
    """The columns that fit `width` whole, in COLUMNS' order: the worker column as wide as the longest
    worker name (`worker_w`), ALWAYS, then OPTIONAL ones while they fit; the trend gets what is left."""
    widths = {k: max(w, worker_w) if k == "worker" else TREND_MIN if k == "trend" else w for k, _, w, _ in COLUMNS}
    chosen = set(ALWAYS)
    used = sum(widths[k] for k in chosen) + GAP * (len(chosen) - 1)
    for key in OPTIONAL:
        if (device or key not in DEVICE) and used + GAP + widths[key] <= width:
            chosen.add(key)
            used += GAP + widths[key]
    widths["trend"] = trend = max(TREND_MIN, min(TREND_MAX, TREND_MIN + width - used))
    labels = {"trend": "trend (mean)" if trend >= len("trend (mean)") else "trend"}
    return [(k, labels.get(k, label), widths[k], right) for k, label, _, right in COLUMNS if k in chosen]


def table_width(cols: list[tuple[str, str, int, bool]]) -> int:
    return sum(w for _, _, w, _ in cols) + GAP * (len(cols) - 1)


def row_strip(cells: Cells, category: str, cols: list[tuple[str, str, int, bool]] = COLUMNS) -> Strip:
    """One table row as segments (`cells` in COLUMNS' order, `cols` the ones shown): the category's
    colour on its marker and its sparkline."""
    segs: list[Segment] = []
    color = _color(category)
    for i, (key, _, width, right) in enumerate(cols):
        text = cells[CELL[key]]
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
    return Strip(segs, table_width(cols))


def header_strip(cols: list[tuple[str, str, int, bool]] = COLUMNS, sort: str = "pipeline") -> Strip:
    segs: list[Segment] = []
    for i, (key, label, width, right) in enumerate(cols):
        if i:
            segs.append(BLANK)
        if key == sort or (sort == "name" and key == "category"):
            label = label + "▼" if key != "category" else label + " ▲"
        segs.append(Segment(_fit(label, width, right), HEADER))
    return Strip(segs, table_width(cols))


class CategoryTable(ScrollView, can_focus=True):
    DEFAULT_CSS = """
    CategoryTable { height: 1fr; }
    """

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.worker_filter: str | None = None
        self.sort = "pipeline"
        self._cols = COLUMNS
        self._header = header_strip()
        self._keys: list[str] = []
        #: key -> (cells without the trend, the category, its history ring)
        self._rows: dict[str, tuple[Cells, str, Ring | None]] = {}
        self._change: dict[str, tuple] = {}
        #: strips are built lazily, for the rows that are actually drawn
        self._strips: dict[str, Strip] = {}
        self._base: Style | None = None
        self._header_sort = "pipeline"
        self._state: RunState | None = None
        self._box_height = 0

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

    def cycle_sort(self, state: RunState) -> str:
        """pipeline order -> share -> p95 -> name -> pipeline order; returns the new order."""
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        self._change.clear()  # every row's label may change
        self.refresh_from(state)
        return self.sort

    def _ordered(self, state: RunState) -> list[tuple[str, str]]:
        """(worker, category) rows in the chosen order; idle rows (no stats this window) sort last."""
        rows = [(w, c) for w, known in state.known.items()
                if self.worker_filter is None or w == self.worker_filter
                for c in sorted(known, key=category_order)]
        if self.sort == "pipeline":
            return rows
        if self.sort == "name":
            return sorted(rows, key=lambda wc: (wc[1], wc[0]))
        current = state.workers

        def value(wc: tuple[str, str]) -> float:
            st = current.get(wc[0], {}).get(wc[1])
            return -1.0 if st is None else st.share if self.sort == "share" else st.p95

        return sorted(rows, key=value, reverse=True)

    def on_resize(self) -> None:
        if self._state is not None:
            self.refresh_from(self._state)  # the columns that fit depend on the width

    def refresh_from(self, state: RunState) -> None:
        self._state = state
        keys: list[str] = []
        changed = False  # the whole table is redrawn (its columns or its rows changed)
        rows_changed: list[int] = []  # else only these rows are
        current = state.workers
        worker_w = max((len(w) for w in state.known), default=0)
        device = any(st.device is not None for cats in current.values() for st in cats.values())
        cols = columns(worker_w, self.scrollable_content_region.width or 10_000, device)
        if cols != self._cols or self._header_sort != self.sort:
            self._cols, self._header_sort = cols, self.sort
            self._header = header_strip(cols, self.sort)
            self._strips.clear()
            changed = True
        previous = None
        for worker, cat in self._ordered(state):
            ring = state.category_mean.get((worker, cat))
            st = current.get(worker, {}).get(cat)
            label = worker if worker != previous or self.sort != "pipeline" else ""
            previous = worker
            if st is None:  # idle in this window: keep the row, blank the numbers
                cells: Cells = (label, cat, "0%", "", "", "", "", "", "0", "", "")
            elif st.n == 0:  # only a span still open: its time is in the share, no duration is known yet
                cells = (label, cat, fmt.percent(st.share), "open", "", "", "", "", "0", "", "")
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
                rows_changed.append(len(keys) - 1)
        if keys != self._keys:
            for gone in set(self._keys) - set(keys):
                self._rows.pop(gone, None)
                self._change.pop(gone, None)
                self._strips.pop(gone, None)
            self._keys = keys
            changed = True
        size = Size(table_width(self._cols), len(keys) + 1)
        if self.virtual_size != size:
            self.virtual_size = size
        # the box no taller than its rows (+ its border, + a sideways scrollbar where one shows): a
        # short table has no empty rows under it, the space goes to the panels below
        sideways = size.width > (self.scrollable_content_region.width or size.width)
        if self.parent is not None and self._box_height != size.height + 2 + sideways:
            self._box_height = size.height + 2 + sideways
            self.parent.styles.max_height = self._box_height
        if changed:
            self.refresh()
        elif rows_changed:
            # a table where a few numbers changed redraws those rows: the compositor redraws every
            # line marked dirty, and the whole table was most of what dflash-top's redraws cost
            top, width = self.scroll_offset.y, max(size.width, self.size.width)
            shown = [Region(0, 1 + i - top, width, 1) for i in rows_changed if 0 <= i - top < self.size.height - 1]
            if shown:  # (no region at all would mean the whole table)
                self.refresh(*shown)
        title = "per-category timings"
        if self.sort != "pipeline":
            title += f" by {self.sort} (o: sort)"
        if self.worker_filter:
            title += f" [{self.worker_filter}] (w: next worker)"
        if self.parent is not None and self.parent.border_title != title:
            self.parent.border_title = title

    def _strip(self, key: str) -> Strip:
        strip = self._strips.get(key)
        if strip is None:
            cells, cat, ring = self._rows[key]
            trend_w = next(w for k, _, w, _ in self._cols if k == "trend")
            trend = fmt.sparkline(ring.values, trend_w) if ring is not None else ""
            strip = self._strips[key] = row_strip((*cells[:5], trend, *cells[6:]), cat, self._cols)
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
            strip = (self._strip(self._keys[index]) if 0 <= index < len(self._keys)
                     else Strip.blank(table_width(self._cols), PLAIN))
        return strip.crop_extend(scroll_x, scroll_x + width, self._base)
