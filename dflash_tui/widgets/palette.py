"""Stable colours for categories and connection states, shared by every panel.

A category keeps its colour across workers, panels and restarts, so `target_forward` is the same
blue in the bars, the table and the legend; unknown categories get a colour from their name's hash.
"""

from __future__ import annotations

import zlib

from dflash.telemetry.wire.vocab import CATEGORIES, SAMPLED_CATEGORIES
from dflash_tui.sources import Connection

#: the trainer's own categories first, in pipeline order (also the display order), then a sampled view's
KNOWN = list(CATEGORIES) + list(SAMPLED_CATEGORIES)
_COLORS = ["#e5c07b", "#61afef", "#c678dd", "#98c379", "#56b6c2", "#d19a66", "#e06c75", "#be5046",
           "#abb2bf", "#7f848e", "#4db5bd", "#ff79c6", "#8be9fd", "#50fa7b", "#ffb86c", "#bd93f9"]
UNTRACKED = "#3e4451"

STATE_STYLE = {
    Connection.LIVE: "bold green",
    Connection.SAMPLING: "bold magenta",
    Connection.CONNECTING: "yellow",
    Connection.DISCONNECTED: "bold red",
    Connection.INCOMPATIBLE: "bold white on red",
    Connection.UNTRUSTED: "bold white on red",
    Connection.REPLAY: "bold cyan",
    Connection.PAUSED: "bold yellow",
    Connection.ENDED: "cyan",
}


def category_color(name: str) -> str:
    if name in KNOWN:  # distinct while the palette has a colour for each; a later one shares, never fails
        return _COLORS[KNOWN.index(name) % len(_COLORS)]
    return _COLORS[zlib.crc32(name.encode()) % len(_COLORS)]


def category_order(name: str) -> tuple[int, str]:
    return (KNOWN.index(name) if name in KNOWN else len(KNOWN), name)
