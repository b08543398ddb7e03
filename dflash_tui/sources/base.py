"""The interface every frame source offers the app, and the batch it hands over.

A source fetches bytes on its own thread and hands `SourceUpdate` batches to a `Sink` (the app turns
each into a message), so the UI thread never waits on a socket or a disk. Beyond start/stop/request
it says what else it can do: `playback` for a recording, `live` for a trainer's socket, `watched` for a
process sampled from outside; the app, the headless `--once` mode and the tests ask those instead of
checking a source's type.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dflash.telemetry.wire.protocol import PROTO, Frame, Reply
from dflash.telemetry.wire.sockets import SocketInfo


class Connection(enum.StrEnum):
    """Where a source stands; the header and the status line show it."""

    CONNECTING = "connecting"
    LIVE = "live"
    DISCONNECTED = "disconnected"
    #: the trainer speaks another protocol version
    INCOMPATIBLE = "incompatible"
    #: the socket's server runs as another user (not us, not root): nothing it says is shown
    UNTRUSTED = "untrusted"
    #: a process sampled from outside (`dflash-top --pid`): no socket, its stacks read with py-spy
    SAMPLING = "sampling"
    REPLAY = "replay"
    PAUSED = "paused"
    ENDED = "ended"

    @property
    def away(self) -> bool:
        """No trainer is being heard from here: the panels dim and keep the last data."""
        return self in (Connection.DISCONNECTED, Connection.INCOMPATIBLE, Connection.UNTRUSTED)


@dataclass
class SourceUpdate:
    """A batch from a source: frames in arrival order, decoding errors, and maybe a new state."""

    frames: list[Frame] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    state: Connection | None = None
    detail: str = ""
    #: the frames that follow start the stream over (a replay seeking backwards): forget the old ones
    reset: bool = False


Sink = Callable[[SourceUpdate], None]


class RequestFailed(RuntimeError):
    """A request could not be answered (not connected, timed out, or the trainer said no)."""


class Playback(Protocol):
    """What a recording's source can do: pace, pause, single-step and move in the stream."""

    speed: float
    paused: bool
    #: the recording's first and last snapshot times (None until known)
    start_t: float | None
    end_t: float | None

    def toggle_pause(self) -> None: ...

    def step(self) -> None: ...

    def set_speed(self, speed: float) -> None: ...

    def seek(self, delta: float | None = None, to: float | None = None) -> None: ...

    def where(self) -> str: ...


class LiveLink(Protocol):
    """What a live trainer's source can do: answer requests, and name its socket (run and rank) so that
    the other ranks of its job can be found next to it."""

    path: Path
    info: SocketInfo
    connected: bool

    def request(self, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Reply: ...


class Watched(Protocol):
    """What a sampled process's source can do: name the process on this machine that py-spy (the `s` and
    `r` keys) may be pointed at. There is no trainer to ask: no requests, no trainer's own stacks."""

    pid: int
    connected: bool


class FrameSource(Protocol):
    """What the app needs from any source; `playback`, `live` and `watched` are None where it cannot."""

    path: Path
    playback: Playback | None
    live: LiveLink | None
    watched: Watched | None

    def start(self, sink: Sink) -> None: ...

    def stop(self) -> None: ...

    def request(self, op: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Reply: ...


def mismatch_message(proto: Any) -> str:
    return (f"the trainer speaks telemetry protocol v{proto}, this dflash-top speaks v{PROTO}: "
            "run the dflash-top installed with that trainer (same dflash-trainer version)")
