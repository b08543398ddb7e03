"""GIL contention, live: how long a Python thread that wants to run has to wait for the interpreter lock.

The probe: a thread sleeps 5 ms and measures how late it wakes. `time.sleep` releases the GIL and
returns only once the thread holds it again, so the lateness is the wait for the GIL: up to
`sys.getswitchinterval()` (5 ms) per wake-up behind one running Python thread, longer behind several,
next to nothing behind threads in C code that releases the GIL (large torch ops, I/O). The gauge
`gil_contention` (0..1) is the share of the probe's time spent waiting; `gil_wait_ms` the mean wait
per wake-up. Its blind spot: on a machine with more runnable threads than cores the lateness also
holds the wait for a core, which a Python thread cannot tell apart (floor ~1% on a quiet machine,
more under load); the GIL-bound verdict therefore also asks that the process run on about one core
(analysis.gil_bound).

`gilknocker` (a Rust extension whose native thread wakes first and then times acquiring the GIL) was
measured side by side (scripts/bench_gil.py, docs/telemetry.md): it reads right under CPU
oversubscription where the sleep probe does not, but with it the trainer aborted at interpreter exit
in 3 of 8 short runs ("FATAL: exception not rethrown": its thread is unwound while in Rust code), so
it is not used by default; `backend="gilknocker"` remains for comparisons.

Cost: 200 wake-ups a second, each a few microseconds of Python and one hand-off of the GIL.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dflash.telemetry.summary import Summary
from dflash.telemetry.wire.vocab import GIL_PROBE_THREAD, Gauge

#: seconds the probe sleeps between wake-ups
INTERVAL_S = 0.005


def _knocker(interval_s: float):  # noqa: ANN202 - gilknocker.KnockKnock, when it imports
    try:
        from gilknocker import KnockKnock
    except ImportError:
        return None
    return KnockKnock(polling_interval_micros=max(100, int(interval_s * 1e6)))


class GilProbe:
    """Measures GIL wait continuously in its own thread; `read()` (or `check()`, as a telemetry server
    monitor) returns the contention since the previous read. `backend`: "sleep" (the default),
    "gilknocker" (for comparison only, see the module docstring) or "auto" (gilknocker if it imports)."""

    def __init__(self, interval_s: float = INTERVAL_S, backend: str = "sleep") -> None:
        if backend not in ("auto", "gilknocker", "sleep"):
            raise ValueError(f"backend must be auto, gilknocker or sleep, not {backend!r}")
        self.interval_s = interval_s
        self._knock = _knocker(interval_s) if backend != "sleep" else None
        if backend == "gilknocker" and self._knock is None:
            raise RuntimeError("gilknocker is not installed (pip install gilknocker)")
        self.backend = "gilknocker" if self._knock is not None else "sleep"
        # (seconds late, seconds elapsed, wake-ups), replaced as one tuple so a reader never sees half
        # an update; the reader only subtracts the previous tuple
        self._acc: tuple[float, float, int] = (0.0, 0.0, 0)
        self._last: tuple[float, float, int] = (0.0, 0.0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.emit: Callable[..., None] | None = None  # a monitor that never reports events

    def start(self) -> GilProbe:
        if self._knock is not None:
            if not self._knock.is_running:
                self._knock.start()
            return self
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=GIL_PROBE_THREAD, daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        if self._knock is not None and self._knock.is_running:
            self._knock.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        perf, sleep, iv, stop = time.perf_counter, time.sleep, self.interval_s, self._stop
        late = wall = 0.0
        n = 0
        while not stop.is_set():
            t0 = perf()
            sleep(iv)
            dt = perf() - t0
            late += dt - iv if dt > iv else 0.0
            wall += dt
            n += 1
            self._acc = (late, wall, n)

    def read(self) -> tuple[float, float, int]:
        """(contention share, mean wait per wake-up in seconds, wake-ups) since the previous read;
        gilknocker reports no per-wake-up figures (0.0 and 1 in their place)."""
        if self._knock is not None:
            share = self._knock.contention_metric
            self._knock.reset_contention_metric()
            return share, 0.0, 1
        acc, last = self._acc, self._last
        self._last = acc
        late, wall, n = acc[0] - last[0], acc[1] - last[1], acc[2] - last[2]
        if n <= 0 or wall <= 0:
            return 0.0, 0.0, 0
        return late / wall, late / n, n

    def check(self, summary: Summary, live: set[str] | None = None) -> None:
        """Telemetry-server monitor hook: put this window's figures among the snapshot's gauges."""
        self.start()
        share, wait, n = self.read()
        if n:
            summary.gauges[Gauge.GIL_CONTENTION] = round(share, 4)
            if self._knock is None:
                summary.gauges[Gauge.GIL_WAIT_MS] = round(wait * 1e3, 3)
