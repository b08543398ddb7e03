"""The dashboard's boxed panels, declared once: where each sits, its title, the widget that draws it,
whether a number key zooms it (and by which name) and whether it redraws at the slow pace. The app
derives its layout, its zoom keys, the hint line's names and its refresh pacing from this table, so a
new panel is one entry here (and its widget).
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.widget import Widget

from dflash_tui.widgets.bottleneck import BottleneckPanel
from dflash_tui.widgets.categories import CategoryTable
from dflash_tui.widgets.cluster import ClusterPanel
from dflash_tui.widgets.curves import CurvesPanel
from dflash_tui.widgets.events import EventsLog
from dflash_tui.widgets.gpus import GpuPanel
from dflash_tui.widgets.threads import ThreadsPanel
from dflash_tui.widgets.timebars import TimeBars


@dataclass(frozen=True)
class PanelSpec:
    #: the widget's id; its box is `p-<id>` (the stylesheet's handle)
    id: str
    title: str
    widget: type[Widget]
    #: "top" (above the two columns, full width), "left" or "right"
    column: str
    #: the name its number key goes by in the footer's tooltip, the help and the hint line; None: no key
    zoom: str | None = None
    #: dense panels, read row by row (like top and nvidia-smi), redraw at most once a second while the
    #: headline ones follow every snapshot: redrawing is nearly all of dflash-top's CPU time
    slow: bool = False

    @property
    def box(self) -> str:
        return f"p-{self.id}"


DASHBOARD: tuple[PanelSpec, ...] = (
    PanelSpec("cluster", "cluster", ClusterPanel, "top"),
    PanelSpec("bottleneck", "bottleneck", BottleneckPanel, "left"),
    PanelSpec("bars", "where time goes (share of wall time per worker)", TimeBars, "left", zoom="bars"),
    PanelSpec("table", "per-category timings", CategoryTable, "left", zoom="table", slow=True),
    PanelSpec("gpus", "GPUs", GpuPanel, "right", zoom="GPUs", slow=True),
    PanelSpec("threads", "threads (top -H)", ThreadsPanel, "right", zoom="threads", slow=True),
    PanelSpec("curves", "training curves", CurvesPanel, "right", zoom="curves", slow=True),
    PanelSpec("events", "events", EventsLog, "right", zoom="events"),
)
#: the panels the number keys 1, 2, ... zoom, in that order
ZOOMABLE: tuple[PanelSpec, ...] = tuple(p for p in DASHBOARD if p.zoom is not None)
#: the widget ids of the panels that redraw at the slow pace
SLOW: frozenset[str] = frozenset(p.id for p in DASHBOARD if p.slow)
#: the widget ids of the boxed panels: a zoomed one hides the others (the header, the alerts and the
#: status line stay)
BOXED: frozenset[str] = frozenset(p.id for p in DASHBOARD)
#: the widget ids of the panels in the two columns, which scroll when the terminal is too short for them
SCROLLED: frozenset[str] = frozenset(p.id for p in DASHBOARD if p.column != "top")


def in_column(column: str) -> tuple[PanelSpec, ...]:
    return tuple(p for p in DASHBOARD if p.column == column)
