#!/usr/bin/env python
"""How much does always-on telemetry cost? Everything measured side by side in one run.

    python scripts/bench_telemetry.py [--json] [--quick]

* add_vs_floor: `t0 = perf_counter(); t1 = perf_counter(); w.add(cat, t1 - t0)` against the floor
  `t0 = perf_counter_ns(); t1 = perf_counter_ns(); lst.append(t1 - t0)` (target <= 2), with drains
  between chunks as the publisher does; add_nodrain_ns is the worst case where nobody drains and
  the worker folds its own buffer every FOLD_AT samples
* span_ns: median cost of `with w.span(cat): pass` (target <= 1000)
* record_function_vs_span: `torch.profiler.record_function` (profiler off) over `span` (target >= 10)
* snapshot_ms: drain + analyse + build + encode one snapshot of 8 workers x 12 categories, 20 samples
  each, after 200 warm-up windows (target <= 2)
* throughput_on_vs_off: a workload loop with telemetry on and 4 clients attached (3 reading from
  other processes, 1 never reading) over the same loop with telemetry off (target >= 0.99)
* cpu_per_step_on_vs_off: the trainer process's CPU seconds per step (publisher thread included),
  on over off: the overhead without the wall-clock noise of a shared machine
* foreign_load_cores: CPU load of *other* processes during the run (a busy box skews everything)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _bench import ForeignLoad, bench_parser  # noqa: E402

from dflash.telemetry import ProfileStats, TelemetryServer  # noqa: E402
from dflash.telemetry.summary import to_snapshot  # noqa: E402
from dflash.telemetry.verdict.anomalies import AnomalyDetector  # noqa: E402
from dflash.telemetry.verdict.evidence import analyze  # noqa: E402
from dflash.telemetry.verdict.gil import GilProbe  # noqa: E402
from dflash.telemetry.verdict.watchdog import Watchdog  # noqa: E402
from dflash.telemetry.wire.protocol import encode  # noqa: E402

CATS = [
    "batch_queue_wait", "target_forward", "pack_hidden", "hs_queue_put", "hs_queue_wait", "h2d",
    "drafter_forward", "drafter_backward", "optimizer_step", "checkpoint", "eval", "other",
]


def micro(fns: dict[str, tuple], repeats: int) -> dict[str, float]:
    """ns per op for each `name: (fn, n)`, where fn(n) runs n ops and returns elapsed ns.

    Runs are interleaved so that drifting load from other processes hits every candidate alike,
    and the minimum over repeats is kept: on a shared box, slower runs measure preemption, not us
    (the reasoning of timeit's docs)."""
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, (fn, n) in fns.items():
            best[name] = min(best[name], fn(n) / n)
    return best


CHUNK = 10_000  # adds between drains: well under FOLD_AT, as with a publisher draining each second


def bench_floor(n: int) -> int:
    pc = time.perf_counter_ns
    elapsed = 0
    for _ in range(0, n, CHUNK):
        lst: list[int] = []
        app = lst.append
        t_start = pc()
        for _ in range(CHUNK):
            t0 = pc()
            t1 = pc()
            app(t1 - t0)
        elapsed += pc() - t_start
    return elapsed


def bench_add(stats: ProfileStats, drain: bool = True):
    """`drain=False` is the worst case: nobody drains, so the worker folds its own buffer."""
    w = stats.worker("bench-add")

    def run(n: int) -> int:
        pc = time.perf_counter
        add = w.add
        elapsed = 0
        for _ in range(0, n, CHUNK):
            t_start = time.perf_counter_ns()
            for _ in range(CHUNK):
                t0 = pc()
                t1 = pc()
                add("target_forward", t1 - t0)
            elapsed += time.perf_counter_ns() - t_start
            if drain:
                stats.drain()  # the publisher's job, on its own thread, outside the timed loop
        stats.drain()
        return elapsed

    return run


def bench_span(stats: ProfileStats):
    w = stats.worker("bench-span")

    def run(n: int) -> int:
        span = w.span
        elapsed = 0
        for _ in range(0, n, CHUNK):
            t_start = time.perf_counter_ns()
            for _ in range(CHUNK):
                with span("target_forward"):
                    pass
            elapsed += time.perf_counter_ns() - t_start
            stats.drain()
        return elapsed

    return run


def bench_record_function():
    import torch  # only the bench pays for torch

    rf = torch.profiler.record_function

    def run(n: int) -> int:
        t_start = time.perf_counter_ns()
        for _ in range(n):
            with rf("target_forward"):
                pass
        return time.perf_counter_ns() - t_start

    return run


def bench_snapshot(samples_per_cat: int, warmup: int, repeats: int) -> tuple[float, float, int]:
    """Median ms to drain, analyse, build and encode one 8 x 12 snapshot, after `warmup` windows
    so that the cumulative reservoirs are in their steady state (full, taking replacements)."""
    stats = ProfileStats()
    workers = [stats.worker(f"{'target' if i < 4 else 'drafter'}-{i % 4}") for i in range(8)]
    stats.drain()
    times, size = [], 0
    for seq in range(warmup + repeats):
        for w in workers:
            for c in CATS:
                for k in range(samples_per_cat):
                    w.add(c, 0.001 * (k + 1))
        stats.count("tokens", 1000)
        stats.gauge("loss", 2.0)
        stats.metric("per_position_acc", [0.9 - 0.05 * i for i in range(15)])
        t0 = time.perf_counter()
        summ = stats.drain()
        data = encode(to_snapshot(summ, seq, 1.0, None, analyze(summ.workers)))
        if seq >= warmup:
            times.append(time.perf_counter() - t0)
        size = len(data)
    return statistics.median(times) * 1000, min(times) * 1000, size


_READER = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
    "while s.recv(1 << 16): pass\n"
)


STEP_WORK = 40_000  # sum(range(STEP_WORK)) is ~0.5-1 ms of pure Python; real trainer steps are longer


def workload(stats: ProfileStats, seconds: float) -> tuple[float, float]:
    """(steps per wall second, process CPU seconds per step) of a loop shaped like a worker step:
    Python work holding the GIL (so the publisher thread competes for it), 3 spans and 2 adds.
    Process CPU includes the publisher thread, so the second number is the whole in-process cost."""
    w = stats.worker("target-0")
    pc = time.perf_counter
    n = 0
    cpu0 = time.process_time()
    end = pc() + seconds
    while pc() < end:
        for _ in range(2):
            with w.span("batch_queue_wait"):
                pass
            with w.span("target_forward"):
                sum(range(STEP_WORK))
            with w.span("pack_hidden"):
                pass
            w.add("hs_queue_put", 1e-6)
            w.add("h2d", 1e-6)
            n += 1
    return n / seconds, (time.process_time() - cpu0) / n


def bench_throughput(seconds: float, pairs: int) -> tuple[float, float, float]:
    """Median over off/on pairs of on/off steps per second. Pairs run back to back in ABBA order so
    that drifting load from other processes hits both sides alike. The server publishes every
    0.25 s (4x the default) so its cost is not hidden by a long interval."""
    sock_dir = Path(tempfile.mkdtemp(prefix="dfb-")) / "s"

    def off() -> tuple[float, float]:
        return workload(ProfileStats(enabled=False), seconds)

    def on() -> tuple[float, float]:
        stats = ProfileStats()
        # every probe on, as `dflash train` runs them: stall watchdog, anomaly detector, GIL probe
        monitors = [Watchdog(native=False), AnomalyDetector(), GilProbe()]
        srv = TelemetryServer("bench", stats, interval_s=0.25, socket_dir=sock_dir, monitors=monitors).start()
        readers = [subprocess.Popen([sys.executable, "-c", _READER, str(srv.path)]) for _ in range(3)]
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(str(srv.path))  # never reads
        deadline = time.monotonic() + 5
        while srv.clients < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            return workload(stats, seconds)
        finally:
            srv.close()
            silent.close()
            for r in readers:
                r.wait(5)

    ratios, cpu_ratios, offs = [], [], []
    try:
        for i in range(pairs):
            if i % 2 == 0:
                a = off()
                b = on()
            else:
                b = on()
                a = off()
            offs.append(a[0])
            ratios.append(b[0] / a[0])
            cpu_ratios.append(b[1] / a[1])
    finally:
        shutil.rmtree(sock_dir.parent, ignore_errors=True)
    return statistics.median(ratios), statistics.median(cpu_ratios), 1e6 / statistics.median(offs)


def main() -> int:
    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny iteration counts (a smoke run, numbers are noisy)")
    args = ap.parse_args()
    n, repeats = (20_000, 3) if args.quick else (100_000, 9)
    with ForeignLoad() as load:
        stats = ProfileStats()
        ns = micro(
            {
                "floor": (bench_floor, n),
                "add": (bench_add(stats), n),
                "add_nodrain": (bench_add(ProfileStats(), drain=False), n),
                "span": (bench_span(stats), n),
                "record_function": (bench_record_function(), n // 4),
            },
            repeats,
        )
        floor, add, add_fold, span, rf = (
            ns[k] for k in ("floor", "add", "add_nodrain", "span", "record_function")
        )
        snap_samples = 20  # per worker and category per window: 8 workers x 20 steps/s, 12 categories
        snap_ms, snap_min_ms, snap_bytes = bench_snapshot(snap_samples, 10 if args.quick else 200,
                                                          5 if args.quick else 30)
        pairs = 1 if args.quick else 8
        ratio, cpu_ratio, step_us = bench_throughput(0.3 if args.quick else 1.5, pairs)
    result = {
        "floor_ns": round(floor, 1),
        "add_ns": round(add, 1),
        "add_vs_floor": round(add / floor, 3),
        "add_nodrain_ns": round(add_fold, 1),
        "span_ns": round(span, 1),
        "record_function_ns": round(rf, 1),
        "record_function_vs_span": round(rf / span, 2),
        "snapshot_ms": round(snap_ms, 3),
        "snapshot_ms_min": round(snap_min_ms, 3),
        "snapshot_bytes": snap_bytes,
        "snapshot_samples_per_category": snap_samples,
        "throughput_on_vs_off": round(ratio, 4),
        "cpu_per_step_on_vs_off": round(cpu_ratio, 4),
        "workload_step_us": round(step_us, 1),
        "foreign_load_cores": round(load.cores, 2),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "quick": args.quick,
        "method": f"micro: min of {repeats} interleaved runs; throughput: median of {pairs} ABBA off/on pair ratios",
    }
    if args.json:
        print(json.dumps(result))
    else:
        targets = {
            "add_vs_floor": "<= 2",
            "span_ns": "<= 1000",
            "record_function_vs_span": ">= 10",
            "snapshot_ms": "<= 2",
            "throughput_on_vs_off": ">= 0.99",
        }
        for k, v in result.items():
            print(f"{k:26} {v!s:>14}  {targets.get(k, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
