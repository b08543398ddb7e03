"""SIGINT/SIGTERM during a run: the first asks for "finish this step, checkpoint, exit 0"; a second
exits at once without a checkpoint (code 130), for a run whose step is stuck."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def stop_on_signals(stop: threading.Event, log: Callable[[str], None]) -> Iterator[None]:
    """Set `stop` on the first signal while inside; the previous handlers come back on the way out.
    Handlers can only be installed from the main thread: elsewhere (a test driving a run from a
    thread) signals keep their old meaning."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = 0

    def handler(signum: int, frame: object) -> None:
        nonlocal received
        received += 1
        if received > 1:
            print("dflash train: second signal, exiting without a checkpoint", file=sys.stderr, flush=True)
            os._exit(130)
        log(f"received {signal.Signals(signum).name}: finishing the current step, then checkpointing "
            "(send again to exit at once)")
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
