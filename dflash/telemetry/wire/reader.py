"""The one frame reader: bytes in, frames out, whether they come from a recording or a socket.

A recording and a live socket carry the same newline-delimited frames, so both go through the same
steps here: split the bytes into lines (an over-long line is dropped without being buffered whole),
bound and decode each line (``protocol.decode``), and let a ``SegmentGate`` skip the segments written
in another protocol version. The sources around it only fetch bytes: ``read_frames`` from a file (for
``dflash stats``), dflash-top's replay from a file it paces and seeks, its live view from a socket.
Torch-free and Textual-free: dflash-top imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from dflash.telemetry.wire.protocol import MAX_FRAME_BYTES, Frame, ProtocolError, SegmentGate, decode

#: bytes read from a file at a time
CHUNK = 1 << 16


class LineSplitter:
    """Splits a byte stream into lines, holding at most ``limit`` bytes of an unfinished one.

    A line longer than the limit is reported once, as None, however the bytes were cut: when it grows
    past the limit before its newline, its remaining bytes are dropped as they arrive, so a peer
    cannot make the reader buffer without end.
    """

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._skipping = False

    def feed(self, data: bytes) -> list[bytes | None]:
        """The lines completed by ``data`` (without their newlines); None for each over-long line."""
        out: list[bytes | None] = []
        self._buf += data
        start = 0
        while True:
            end = self._buf.find(b"\n", start)
            if end < 0:
                break
            if self._skipping:  # the tail of an over-long line, already reported
                self._skipping = False
            else:
                out.append(bytes(self._buf[start:end]) if end - start <= self.limit else None)
            start = end + 1
        del self._buf[:start]
        if len(self._buf) > self.limit:
            self._buf.clear()
            if not self._skipping:
                self._skipping = True
                out.append(None)
        return out

    def rest(self) -> bytes:
        """The bytes after the last newline (an unfinished last line), and forget them."""
        rest = b"" if self._skipping else bytes(self._buf)
        self._buf.clear()
        self._skipping = False
        return rest


@dataclass(slots=True)
class Read:
    """What one line of the stream came to."""

    lineno: int
    #: the frame to use; None when the line is skipped
    frame: Frame | None = None
    #: why the line is skipped: not a frame, too long, or a truncated last line
    error: str | None = None
    #: a segment of another protocol version starts at this line (its frames are skipped)
    note: str | None = None
    #: the error is a stream's unfinished last line (a trainer killed mid-write)
    truncated: bool = False


class FrameReader:
    """Turns bytes into ``Read`` results: one line splitter, the bounded decoder and the segment gate.

    Feed it whatever arrives (``feed``), then ``finish`` at the end of a file for a last line without
    its newline. ``reset`` starts over (a replay seeking back to the file's start).
    """

    def __init__(self, limit: int = MAX_FRAME_BYTES) -> None:
        self.limit = limit
        self.reset()

    def reset(self) -> None:
        self.lines = LineSplitter(self.limit)
        self.gate = SegmentGate()
        self.lineno = 0

    @property
    def foreign(self) -> object:
        """The protocol version of the segment being skipped, or None."""
        return self.gate.foreign

    def feed(self, data: bytes) -> list[Read]:
        out: list[Read] = []
        for line in self.lines.feed(data):
            self.lineno += 1
            if line is None:
                out.append(Read(self.lineno, error=f"line exceeds the {self.limit}-byte limit"))
            elif line.strip():
                out.append(self._read(line))
        return out

    def finish(self) -> list[Read]:
        """The stream ended: its last line, if it lacked a newline (a frame, or reported as truncated)."""
        rest = self.lines.rest()
        if not rest.strip():
            return []
        self.lineno += 1
        read = self._read(rest)
        if read.error is not None:
            read.error, read.truncated = "truncated last line ignored", True
        return [read]

    def _read(self, line: bytes) -> Read:
        frame, error = None, None
        try:
            frame = decode(line, self.limit)
        except ProtocolError as e:
            error = str(e)
        use, note = self.gate.admit(line, frame)
        if note is not None or self.gate.foreign is not None:
            error = None  # inside a foreign segment nothing is an error: it is skipped as a whole
        return Read(self.lineno, frame if use else None, error, note)


def read_file(f: BinaryIO, reader: FrameReader | None = None) -> Iterator[Read]:
    """Every line of an open recording, from where it stands to its end, through ``reader``."""
    reader = reader or FrameReader()
    while chunk := f.read(CHUNK):
        yield from reader.feed(chunk)
    yield from reader.finish()


def read_frames(
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    on_error: Callable[[int, str], None] | None = None,
) -> Iterator[Frame]:
    """Yield the frames of a recording in order.

    A truncated last line (the trainer was killed mid-write) is skipped silently. Other malformed
    lines raise ProtocolError naming the line when `strict`; otherwise they are skipped and reported
    to `on_error(line_number, message)` if given (a crash-and-resume leaves one such line). A segment
    written in another protocol version (a hello with another `proto`) is skipped up to the next
    hello in ours, reported once at its hello.
    """
    with open(path, "rb") as f:
        for read in read_file(f):
            if read.frame is not None:
                yield read.frame
                continue
            message = read.note or (None if read.truncated else read.error)
            if message is None:
                continue
            if strict:
                raise ProtocolError(f"line {read.lineno}: {message}")
            if on_error is not None:
                on_error(read.lineno, message)
