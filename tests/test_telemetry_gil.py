"""The GIL contention gauge on real threads: high behind busy Python threads, low behind threads that
release the GIL, for both probes; and the GIL-bound verdict."""

from __future__ import annotations

import threading
import time

import pytest

from dflash.telemetry.summary import Summary
from dflash.telemetry.verdict.evidence import gil_bound
from dflash.telemetry.verdict.gil import GilProbe
from dflash.telemetry.wire.protocol import Bottleneck

# gilknocker is compared in scripts/bench_gil.py, in child processes: it can abort the interpreter
# that loaded it at exit (see dflash/telemetry/verdict/gil.py), which must not be pytest's
BACKENDS = ["sleep"]


def _measure(backend: str, target, seconds: float = 1.0) -> float:
    stop = threading.Event()
    threads = [threading.Thread(target=target, args=(stop,), daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    probe = GilProbe(backend=backend).start()
    try:
        time.sleep(0.2)
        probe.read()
        time.sleep(seconds)
        share, _, n = probe.read()
        assert n > 0
        return share
    finally:
        stop.set()
        for t in threads:
            t.join()
        probe.close()


def _python(stop: threading.Event) -> None:
    n = 0
    while not stop.is_set():
        for _ in range(1000):  # bytecode, not one long C call: the GIL changes hands every 5 ms
            n += 1


def _releasing(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.001)  # holds the GIL only for a moment between waits, like a thread in big C calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_busy_python_threads_read_high_and_releasing_threads_low(backend: str) -> None:
    high = _measure(backend, _python)
    low = _measure(backend, _releasing)
    assert high > 0.3, high
    assert low < high / 2, (low, high)


def test_the_probe_is_a_monitor_that_fills_gauges() -> None:
    probe = GilProbe(backend="sleep")
    s = Summary(t=0.0, window_s=1.0)
    probe.check(s)  # starts it
    time.sleep(0.05)
    probe.check(s)
    probe.close()
    assert 0.0 <= s.gauges["gil_contention"] <= 1.0 and s.gauges["gil_wait_ms"] >= 0.0


def test_gil_bound_verdict() -> None:
    b = Bottleneck(verdict="target-bound", reason="drafters wait", evidence={"x": 1.0})
    assert gil_bound(b, None) is b and gil_bound(b, 0.2) is b
    g = gil_bound(b, 0.8)
    assert g.verdict == "GIL-bound" and "80%" in g.reason and "target stage" in g.reason
    assert g.evidence["gil_contention"] == 0.8 and g.evidence["x"] == 1.0
    assert gil_bound(Bottleneck(verdict="unknown"), 0.9).verdict == "unknown"
    # threads that run in parallel are not limited by the GIL, whatever a probe says
    assert gil_bound(b, 0.8, cpu_percent=190.0) is b
    assert gil_bound(b, 0.8, cpu_percent=98.0).evidence["process_cpu_percent"] == 98.0
    with pytest.raises(ValueError):
        GilProbe(backend="nope")
