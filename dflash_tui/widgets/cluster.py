"""The cluster panel of a multi-rank run: a row per rank as rank 0 last heard of it, and the
"worker/category" shares that differ most across ranks.

Rank 0 builds the view and names the straggler; the panel lays the numbers out and marks the
straggler in both tables, with the trainer's reason next to it, so the claim can be checked against
the all-reduce waits and the ranks with the highest shares. Wide terminals put the two tables side by side (a
cluster panel that pushed the rest of the dashboard off a 40-row screen would cost more than it
shows); narrow ones stack them. The text builders take a plain `Cluster` so that `--once` prints the
same tables.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from rich.text import Text

from dflash.telemetry.wire.protocol import Cluster, ClusterCategory, ClusterRank
from dflash_tui import fmt
from dflash_tui.state import RunState
from dflash_tui.widgets.base import TextPanel, cropped

STRAGGLER = "bold black on yellow"
STALE = "bold white on red"
HEADER = "bold dim"
STATE_STYLE = {"training": "", "finished": "cyan", "failed": "bold red", "silent": "dim"}

Col = tuple[str, int, bool]  # label, width, right-aligned
#: the marker column says which rank is selected (▶) and which one the panels show (•), when they differ
RANK_COLS: list[Col] = [("", 1, False), ("rank", 4, False), ("host", 9, False), ("state", 8, False),
                        ("step", 6, True), ("tok/s", 6, True), ("loss", 6, True), ("ar-wait", 7, True),
                        ("age", 5, True)]
#: "highest" rather than "slowest": in a waiting category the highest share is the rank that waits most
CAT_COLS: list[Col] = [("worker/category", 26, False), ("min", 5, True), ("mean", 5, True), ("max", 5, True),
                       ("highest", 7, False)]
COLUMN_GAP = 3


def _width(cols: list[Col]) -> int:
    return sum(w for _, w, _ in cols) + len(cols) - 1


RANK_W, CAT_W = _width(RANK_COLS), _width(CAT_COLS)
Cell = tuple[str, str]  # text, style


def table_line(cols: list[Col], cells: Sequence[Cell]) -> Text:
    """Cells cropped (…) and padded to their columns; only the text takes the style, so a highlight
    is as wide as what it marks."""
    t = Text(no_wrap=True)
    for i, ((_, width, right), (text, style)) in enumerate(zip(cols, cells, strict=True)):
        if i:
            t.append(" ")
        if len(text) > width:
            text = text[: width - 1] + "…"
        pad = " " * (width - len(text))
        if right:
            t.append(pad)
        t.append(text, style=style)
        if not right:
            t.append(pad)
    return t


def header_line(cols: list[Col]) -> Text:
    return table_line(cols, [(label, HEADER) for label, _, _ in cols])


def pick_ranks(cluster: Cluster, limit: int, keep: Iterable[int | None] = ()) -> tuple[list[ClusterRank], int]:
    """The rank rows to show when not all fit, in rank order, and how many were left out: the
    straggler, stale ranks and `keep` (selected, shown) first, then the ranks that wait least in the
    all-reduce (those the others wait for), so the interesting rows are never the hidden ones."""
    ranks = sorted(cluster.ranks, key=lambda r: r.rank)
    if len(ranks) <= limit:
        return ranks, 0
    first = {cluster.straggler, *cluster.stale, *keep}
    chosen = [r for r in ranks if r.rank in first or r.stale][:limit]
    taken = {r.rank for r in chosen}
    rest = sorted((r for r in ranks if r.rank not in taken), key=lambda r: (r.allreduce_share, r.rank))
    chosen += rest[: limit - len(chosen)]
    return sorted(chosen, key=lambda r: r.rank), len(ranks) - len(chosen)


def rank_cells(r: ClusterRank, straggler: int | None, selected: int | None, shown: int | None) -> list[Cell]:
    mark = "▶" if r.rank == selected else "•" if r.rank == shown else " "
    state, state_style = (("STALE", STALE) if r.stale else ("STALLED", STALE) if r.stalled
                          else (r.state, STATE_STYLE.get(r.state, "")))
    return [(mark, "bold"), (f"r{r.rank}", STRAGGLER if r.rank == straggler else "bold"), (r.host or fmt.NA, ""),
            (state, state_style), (str(r.step), ""), (fmt.count(r.tokens_per_s), ""), (fmt.number(r.loss), ""),
            (fmt.percent(r.allreduce_share), ""), (fmt.age(r.age_s), "bold red" if r.stale else "dim")]


def category_cells(c: ClusterCategory, straggler: int | None) -> list[Cell]:
    return [(c.key, ""), (fmt.percent(c.min), "dim"), (fmt.percent(c.mean), ""), (fmt.percent(c.max), "bold"),
            (f"r{c.max_rank}", STRAGGLER if c.max_rank == straggler else "")]


def cluster_summary(cluster: Cluster) -> str:
    """`3 ranks · 41.2K tok/s total · 1 stale`: the panel's title and the --once heading."""
    live = [r for r in cluster.ranks if not r.stale]
    out = f"{cluster.world_size} ranks · {fmt.count(sum(r.tokens_per_s for r in live))} tok/s total"
    stale = sorted(set(cluster.stale) | {r.rank for r in cluster.ranks if r.stale})
    if stale:
        out += f" · {len(stale)} stale"
    if cluster.stalled:
        out += f" · {len(cluster.stalled)} stalled"
    return out


def cluster_text(cluster: Cluster, width: int, *, selected: int | None = None, shown: int | None = None,
                 max_ranks: int = 8, max_categories: int | None = None) -> Text:
    """Both tables, side by side when `width` allows, then the straggler and the stale ranks. Without
    `max_categories`, side by side the categories fill the height the ranks take anyway; stacked, where
    every row pushes the dashboard down, only the two widest spreads."""
    lines: list[Text] = []
    if cluster.error:
        lines.append(Text(f"⚠ cross-rank exchange: {cluster.error}", style="bold red"))
    straggler = cluster.straggler
    ranks, hidden = pick_ranks(cluster, max_ranks, (selected, shown))
    left = [header_line(RANK_COLS)] + [table_line(RANK_COLS, rank_cells(r, straggler, selected, shown))
                                       for r in ranks]
    if not ranks:
        left.append(Text("no rank has reported yet", style="dim"))
    if hidden:
        left.append(Text(f"  … {hidden} more ranks", style="dim"))
    side = width >= RANK_W + COLUMN_GAP + CAT_W
    if max_categories is None:
        max_categories = max(3, len(left) - 1) if side else 2
    cats = cluster.categories[:max_categories]
    right = [header_line(CAT_COLS)] + [table_line(CAT_COLS, category_cells(c, straggler)) for c in cats]
    if not cats:
        right.append(Text("no per-category shares yet", style="dim"))
    if side:
        for i in range(max(len(left), len(right))):
            line = left[i].copy() if i < len(left) else Text()
            line.truncate(RANK_W, pad=True)
            line.append(" " * COLUMN_GAP)
            if i < len(right):
                line.append_text(right[i])
            lines.append(line)
    else:
        lines += left + right
    if straggler is not None:
        line = cropped()
        line.append(f" straggler r{straggler} ", style=STRAGGLER)
        line.append(" " + (cluster.straggler_reason or "the other ranks wait for it in the all-reduce"))
        lines.append(line)
    stale = sorted(set(cluster.stale) | {r.rank for r in cluster.ranks if r.stale})
    if stale:
        line = cropped()
        line.append(f" stale {', '.join(f'r{r}' for r in stale)} ", style=STALE)
        line.append(" stopped reporting to rank 0")
        lines.append(line)
    for r in cluster.ranks:
        if r.stalled and not r.stale:
            line = cropped()
            line.append(f" stalled r{r.rank} ", style=STALE)
            line.append(" " + "; ".join(r.stalled))
            lines.append(line)
    out = Text("\n").join(lines)
    out.no_wrap, out.overflow = True, "crop"
    return out


def cluster_title(state: RunState) -> str:
    """Where the view comes from: this connection (rank 0's own) or a second one to rank 0, and how
    old it is when that one is down."""
    if state.cluster is None:
        return "cluster"
    title = f"cluster (rank 0's view): {cluster_summary(state.cluster)}"
    feed = state.cluster_connection
    if feed is not None and feed != "live":
        when = time.strftime("%H:%M:%S", time.localtime(state.cluster_t)) if state.cluster_t else "?"
        title += f" · rank 0 {feed}, view from {when}"
    return title


class ClusterPanel(TextPanel):
    """Hidden (by the app) until a snapshot carries a cluster view."""

    #: rank rows at most (the straggler, stale and selected ranks always among them); the rank
    #: picker (g) lists every rank
    MAX_RANKS = 8

    def refresh_from(self, state: RunState) -> None:
        title = cluster_title(state)
        if self.parent is not None and self.parent.border_title != title:
            self.parent.border_title = title
        super().refresh_from(state)

    def build(self, state: RunState, width: int) -> Text:
        if state.cluster is None:
            return Text("")
        shown = state.shown_rank
        selected = state.selected_rank if state.selected_rank is not None else shown
        return cluster_text(state.cluster, width, selected=selected, shown=shown, max_ranks=self.MAX_RANKS)
