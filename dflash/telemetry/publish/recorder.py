"""telemetry.jsonl: the same frames the socket carries, one per line, so replay and live share a reader
(``reader.py``).

The writer lives in the publisher thread and must never take the trainer down: a failing disk
disables recording (with one log line) and the socket keeps serving.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

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

