"""How a run speaks: log lines, events and the experiment trackers.

Rank 0 speaks for the job (`log`); what belongs to one rank (its socket, its port) is said by every
rank, marked with its rank (`say`). An event is a log line and a frame on the telemetry stream, so
dflash-top and telemetry.jsonl hold what the log says. Problems go to stderr (`problem`).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dflash.train.distributed import Dist

if TYPE_CHECKING:
    from dflash.telemetry import TelemetryServer
    from dflash.train.reporting.trackers import Trackers


#: events kept for the telemetry stream until its publisher starts (the workers start first)
EARLY_EVENTS = 256
#: a phase line the process that launched this run asks it to announce first (`dflash tune` names each
#: trial so that dflash-top, following the tune's run name from trial to trial, shows which one it sees)
PHASE_ENV = "DFLASH_PHASE"
#: the longest such line announced: it comes from the environment, not from this run
MAX_PHASE_CHARS = 500


def announced_phase() -> str | None:
    """The phase line of PHASE_ENV, cut to MAX_PHASE_CHARS and one line; None when it is not set."""
    line = " ".join(os.environ.get(PHASE_ENV, "").split())
    return line[:MAX_PHASE_CHARS] or None


class Reporter:
    def __init__(self, out: Callable[[str], None] | None = None):
        self._out = out or (lambda s: print(s, flush=True))
        self.dist = Dist()  # replaced once the ranks have joined
        self._server: TelemetryServer | None = None
        self._early: list[tuple[str, str, dict[str, Any]]] = []
        self._lock = threading.Lock()  # events come from the workers' threads too
        self.trackers: Trackers | None = None  # the experiment trackers (rank 0, --report-to)

    @property
    def server(self) -> TelemetryServer | None:
        """The telemetry publisher, once started: events go on its stream too, those told before it
        started (a bad sample in the first batches) as soon as it does."""
        return self._server

    @server.setter
    def server(self, server: TelemetryServer | None) -> None:
        with self._lock:
            self._server, early, self._early = server, self._early, []
        if server is not None:
            for kind, message, data in early:
                server.publish_event(kind, message, **data)

    def log(self, line: str) -> None:
        """Rank 0 only: the other ranks would repeat it (their telemetry is their own)."""
        if self.dist.is_main:
            self._out(line)

    def say(self, line: str) -> None:
        """Every rank, marked with its rank in multi-rank runs."""
        self._out(f"[rank {self.dist.rank}] {line}" if self.dist.enabled else line)

    def event(self, kind: str, message: str, **data: Any) -> None:
        self.log(f"[{kind}] {message}")
        with self._lock:
            server = self._server
            if server is None and len(self._early) < EARLY_EVENTS:
                self._early.append((kind, message, data))
        if server is not None:
            server.publish_event(kind, message, **data)

    @staticmethod
    def problem(line: str) -> None:
        print(f"dflash train: {line}", file=sys.stderr, flush=True)
