"""Textual messages that carry work done on other threads back to the UI thread.

Sources and the py-spy runner know nothing about Textual; the app wraps their results in these
messages so that everything that touches widgets happens on the UI thread.
"""

from __future__ import annotations

from typing import Any

from textual.message import Message

from dflash.telemetry.wire.sockets import SocketInfo
from dflash_tui.sampling.processes import TorchProcess
from dflash_tui.sources import SourceUpdate


class SourceUpdated(Message):
    """Posted (thread-safely) by the source's sink; the app applies it inside batch_update().

    `source` says which source sent it: after a switch to another rank, updates the old source had
    already posted must not land in the new rank's state, and the second connection (to rank 0, for
    the cluster view) feeds only that view.
    """

    def __init__(self, update: SourceUpdate, source: object = None) -> None:
        super().__init__()
        self.update = update
        self.source = source


class ProfileDone(Message):
    """A py-spy dump/record or a trainer `stacks` request finished on a background thread."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self.result = result


class TrainersFound(Message):
    """A discovery pass (waiting screen) finished; `sockets` are the live ones, and where there are none,
    `processes` the Python processes using torch that could be sampled instead (`--pid`)."""

    def __init__(self, sockets: list[SocketInfo], processes: list[TorchProcess] | None = None) -> None:
        super().__init__()
        self.sockets = sockets
        self.processes = processes or []
