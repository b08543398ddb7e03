#!/usr/bin/env python
"""What does watching a trainer from outside (`dflash-top --pid`) cost it, and how close are the sampled
shares to the ones it measures itself? One `dflash train` run, phases side by side.

    python scripts/bench_sampling.py [--json] [--quick] [--phase-s 30] [--rounds 2] [--native 1]

The trainer (configs/tiny-cpu.toml, checkpoints and evaluation off, its own telemetry on: that is where
its steps and its measured shares come from) runs through rounds of an unwatched phase and a watched one
(the sampled source of dflash-top, in this process, exactly as `--pid` runs it; with --native 1 a third
phase sampled with native frames, which stops the process at each sample). Reported:

* steps_per_s_unwatched / steps_per_s_watched (/ _native): the trainer's steady rate in each kind of
  phase (means over the rounds), and their ratio (target >= 0.97 for --nonblocking)
* sampler_cpu_percent (_native): py-spy's own CPU over the watched phases, percent of one core
* agreement_worst_gap: the largest gap between a sampled share and the share the trainer's spans measured
  over the same seconds, every worker and category (docs/sampling.md states it), and its worst rows
* foreign_load_cores: CPU other processes used meanwhile (a busy machine skews everything)
"""

from __future__ import annotations

import os
import queue
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil  # noqa: E402
from _bench import ForeignLoad, bench_args, print_report  # noqa: E402
from record_stacks import snapshots as frames_of  # noqa: E402
from record_stacks import stop  # noqa: E402

from dflash.telemetry.wire.protocol import Snapshot  # noqa: E402
from dflash_tui.sampling.agreement import compare, measured_shares, worst_gap  # noqa: E402
from dflash_tui.sources import Connection, SampledSource, SourceUpdate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OPTIONS = {"phase-s": (30.0, "seconds of each phase"), "rounds": (2, "rounds of unwatched + watched phases"),
           "rate": (100, "samples per second"), "native": (0, "1: also a phase sampled with --native")}


def snapshots(path: Path) -> list[Snapshot]:
    return [f for f in frames_of(path) if isinstance(f, Snapshot)]


def steps_per_s(snaps: list[Snapshot], t0: float, t1: float) -> float | None:
    inside = [s for s in snaps if t0 <= s.t <= t1 and "steps" in s.counters]
    if len(inside) < 2 or inside[-1].t <= inside[0].t:
        return None
    return (inside[-1].counters["steps"] - inside[0].counters["steps"]) / (inside[-1].t - inside[0].t)


def children_cpu() -> float:
    """CPU seconds of this process's children that have been waited for: the py-spy records (the trainer,
    still running, is not among them)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def watch(pid: int, seconds: float, rate: int, native: bool) -> Snapshot | None:
    """The sampled source over `seconds`; its closing snapshot (judged whole)."""
    q: queue.Queue[SourceUpdate] = queue.Queue()
    src = SampledSource(pid, duration=seconds, rate_hz=rate, native=native, window_s=min(2.0, seconds))
    src.start(q.put)
    last = None
    deadline = time.monotonic() + seconds + 120
    try:
        while time.monotonic() < deadline:
            try:
                u = q.get(timeout=1.0)
            except queue.Empty:
                continue
            last = next((f for f in reversed(u.frames) if isinstance(f, Snapshot)), last)
            if u.state == Connection.ENDED:
                break
    finally:
        src.stop()
    return last


def main() -> None:
    args = bench_args(__doc__, OPTIONS, ("a smoke run: 5 s phases, one round", {"phase_s": 5.0, "rounds": 1}))
    run = Path(tempfile.mkdtemp(prefix="bench-sampling-"))
    telemetry = run / "run" / "telemetry.jsonl"
    total = args.rounds * args.phase_s * (3 if args.native else 2) + 600
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the recipe's one thread per worker, as `make train`
    cmd = [sys.executable, "-m", "dflash", "train", "--config", str(REPO / "configs" / "tiny-cpu.toml"), "--run-dir",
           str(run / "run"), "--max-time", str(int(total)), "--checkpoint-every", "1000000", "--eval-prompts", "0",
           "--socket-dir", str(run / "s")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    phases: dict[str, list[tuple[float, float]]] = {"unwatched": [], "watched": [], "native": []}
    sampled: list[Snapshot] = []
    try:
        deadline = time.monotonic() + 600
        while not any(s.counters.get("steps", 0) >= 10 for s in snapshots(telemetry)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the trainer did not reach 10 steps")
            time.sleep(0.5)
        spy: dict[str, list[float]] = {"watched": [0.0, 0.0], "native": [0.0, 0.0]}  # CPU s, wall s
        with ForeignLoad(psutil.Process(proc.pid)) as load:
            for _ in range(args.rounds):
                t0 = time.time()
                time.sleep(args.phase_s)
                phases["unwatched"].append((t0, time.time()))
                for kind in ("watched", "native") if args.native else ("watched",):
                    t0, used = time.time(), children_cpu()
                    snap = watch(proc.pid, args.phase_s, args.rate, native=kind == "native")
                    phases[kind].append((t0, time.time()))
                    spy[kind][0] += children_cpu() - used
                    spy[kind][1] += time.time() - t0
                    if snap is not None and kind == "watched":
                        sampled.append(snap)
            end = time.time()
            while not any(s.t > end + 1 for s in snapshots(telemetry)) and proc.poll() is None:
                time.sleep(0.5)
    finally:
        stop(proc)
    snaps = snapshots(telemetry)
    def rate(kind: str) -> float | None:
        rates = [r for a, b in phases[kind] if (r := steps_per_s(snaps, a, b)) is not None]
        return round(sum(rates) / len(rates), 3) if rates else None

    report: dict = {"phase_s": args.phase_s, "rounds": args.rounds, "rate_hz": args.rate,
                    "steps_per_s_unwatched": rate("unwatched"), "steps_per_s_watched": rate("watched")}
    if report["steps_per_s_unwatched"] and report["steps_per_s_watched"]:
        report["watched_vs_unwatched"] = round(report["steps_per_s_watched"] / report["steps_per_s_unwatched"], 3)
    if args.native:
        report["steps_per_s_native"] = rate("native")
        if report["steps_per_s_unwatched"] and report["steps_per_s_native"]:
            report["native_vs_unwatched"] = round(report["steps_per_s_native"] / report["steps_per_s_unwatched"], 3)
    for kind, key in (("watched", "sampler_cpu_percent"), ("native", "sampler_cpu_percent_native")):
        if spy[kind][1]:
            report[key] = round(spy[kind][0] / spy[kind][1] * 100, 1)
    gaps = []
    for snap, (a, b) in zip(sampled, phases["watched"], strict=False):
        rows = compare({w: {c: st.share for c, st in cats.items()} for w, cats in snap.cumulative.items()},
                       measured_shares(snaps, a, b))
        gaps.append((worst_gap(rows), rows))
    if gaps:
        worst, rows = max(gaps, key=lambda g: g[0])
        report["agreement_worst_gap"] = round(worst, 4)
        report["agreement_rows"] = [f"{r.worker}/{r.category} sampled {r.sampled:.3f} measured {r.measured:.3f}"
                                    for r in rows[:4]]
        report["samples_per_thread"] = sampled[-1].sampling.total_samples if sampled[-1].sampling else None
    report["foreign_load_cores"] = round(load.cores, 2)
    report["busy_machine"] = load.cores > 0.25
    shutil.rmtree(run, ignore_errors=True)
    print_report(report, args.json)


if __name__ == "__main__":
    main()
