"""Where frames come from: a live trainer's Unix socket, a recorded telemetry.jsonl, frames in memory, or
any Python process sampled from outside.

`base` is the interface (what a source can do, the batches it hands over), `live`, `replay`, `memory`
and `sampled` the four sources, `resolve` finds the socket or recording a user named. Every source turns
bytes into frames with the one telemetry reader (``dflash.telemetry.wire.reader``). Nothing here imports
Textual.
"""

from dflash_tui.sources.base import (
    Connection,
    FrameSource,
    LiveLink,
    Playback,
    RequestFailed,
    Sink,
    SourceUpdate,
    Watched,
    mismatch_message,
)
from dflash_tui.sources.live import REFUSED_RETRY_S, LiveSource
from dflash_tui.sources.memory import MemorySource
from dflash_tui.sources.replay import SPEEDS, ReplaySource, next_speed, recording_span
from dflash_tui.sources.resolve import AttachError, open_source, resolve, serves
from dflash_tui.sources.sampled import SampledSource

__all__ = [
    "REFUSED_RETRY_S", "SPEEDS", "AttachError", "Connection", "FrameSource", "LiveLink", "LiveSource", "MemorySource",
    "Playback", "ReplaySource", "RequestFailed", "SampledSource", "Sink", "SourceUpdate", "Watched", "mismatch_message",
    "next_speed", "open_source", "recording_span", "resolve", "serves",
]
