"""telemetry.jsonl: the same frames the socket carries, one per line, so replay and live share a reader.

The writer lives in the publisher thread and must never take the trainer down: a failing disk
disables recording (with one log line) and the socket keeps serving.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from dflash.telemetry.protocol import MAX_FRAME_BYTES, Frame, ProtocolError, SegmentGate, decode

log = logging.getLogger("dflash.telemetry")


class Recorder:
    """Appends encoded frames to a file; buffered, flushed when the publisher says so (each interval)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")  # noqa: SIM115 - kept open for the run's lifetime
        self.failed: str | None = None
        # A run that crashed mid-write left a line without its newline; start on a fresh line so the
        # fragment stays one bad line instead of corrupting our first frame.
        try:
            if self._f.tell() > 0:
                with open(self.path, "rb") as r:
                    r.seek(-1, os.SEEK_END)
                    if r.read(1) != b"\n":
                        self._f.write(b"\n")
        except OSError:
            pass

    def write(self, data: bytes) -> None:
        """Append one encoded frame (with its newline)."""
        if self._f is None:
            return
        try:
            self._f.write(data)
        except (OSError, ValueError) as e:
            self._fail(e)

    def flush(self) -> None:
        if self._f is None:
            return
        try:
            self._f.flush()
        except (OSError, ValueError) as e:
            self._fail(e)

    def _fail(self, e: Exception) -> None:
        self.failed = f"{self.path}: {e}"
        log.error("telemetry recording stopped: %s", self.failed)
        f, self._f = self._f, None
        try:
            f.close()  # type: ignore[union-attr]
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self._f is not None:
            self.flush()
            if self._f is not None:
                try:
                    self._f.close()
                except OSError:
                    pass
                self._f = None


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
    gate = SegmentGate()
    with open(path, "rb") as f:
        lineno = 0
        while True:
            line = f.readline(MAX_FRAME_BYTES + 2)
            if not line:
                break
            lineno += 1
            # Only the file's last line can lack its newline (readline stops at EOF), except a line
            # longer than the limit, which is handled first.
            complete = line.endswith(b"\n")
            if not complete and len(line) > MAX_FRAME_BYTES:
                # an oversized line: skip the rest of it
                while line and not line.endswith(b"\n"):
                    line = f.readline(1 << 20)
                _bad(lineno, f"line exceeds {MAX_FRAME_BYTES} bytes", strict=strict, on_error=on_error)
                continue
            if not line.strip():
                continue
            frame, error = None, ""
            try:
                frame = decode(line)
            except ProtocolError as e:
                error = str(e)
            use, note = gate.admit(line, frame)
            if note is not None:
                _bad(lineno, note, strict=strict, on_error=on_error)
            elif frame is None and gate.foreign is None and complete:
                _bad(lineno, error, strict=strict, on_error=on_error)
            if use:
                yield frame  # type: ignore[misc]


def _bad(lineno: int, message: str, *, strict: bool, on_error: Callable[[int, str], None] | None) -> None:
    if strict:
        raise ProtocolError(f"line {lineno}: {message}")
    if on_error is not None:
        on_error(lineno, message)
