"""Frames already in memory: fixed data for screenshots and tests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash.telemetry.wire.protocol import Frame, Reply
from dflash_tui.sources.base import Connection, RequestFailed, SourceUpdate

if TYPE_CHECKING:  # the interface's types, named in annotations only
    from dflash_tui.sources.base import LiveLink, Playback, Sink, Watched


class MemorySource:
    """Frames already in memory, delivered in one batch: fixed data for screenshots and tests. There is
    nothing to pace or ask."""

    playback: Playback | None = None
    live: LiveLink | None = None
    watched: Watched | None = None

    def __init__(self, frames: list[Frame], path: Path | str = "memory", state: Connection = Connection.ENDED,
                 detail: str = "fixed frames") -> None:
        self.frames = list(frames)
        self.path = Path(path)
        self.state = state
        self.detail = detail

    def start(self, sink: Sink) -> None:
        sink(SourceUpdate(frames=self.frames, state=self.state, detail=self.detail))

    def stop(self) -> None:
        pass

    def request(self, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Reply:
        raise RequestFailed("fixed frames: there is no trainer to ask")
