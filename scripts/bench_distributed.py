"""Benchmark: what the per-step control exchange of a multi-rank run costs a training step.

Two real ranks (torchrun, gloo, this machine) run steps of simulated compute (a sleep, so the two
ranks do not fight over the CPUs) and after each one the control all-reduce the trainer does
(`dflash.train.distributed.Agreement`): either waited for at once, or read one step later as the
trainer does, so that it overlaps the next step. Reported: the extra time per step of each over the
same steps without any exchange, their ratio, and the foreign CPU load seen during the run (other
processes' use of the cores).

    python scripts/bench_distributed.py [--json] [--steps 400] [--work-ms 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _bench import ForeignLoad, bench_parser, print_report


def _worker(args) -> None:
    from dflash.train import distributed

    d = distributed.from_env()
    distributed.init(d, "cpu", timeout_s=60)
    ag = distributed.Agreement(d)
    work = args.work_ms / 1000

    def step_time(mode: str) -> float:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            time.sleep(work)  # the step's compute
            if mode != "none":
                ag.exchange([False, False, False], 1.0)
            if mode == "waited":
                ag.finish()
        ag.finish()
        return (time.perf_counter() - t0) / args.steps

    modes = ["none", "waited", "overlapped"]
    step_time("waited")  # warm-up: connections, first-call costs
    results: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):  # interleaved, so drift hits all alike
            results[mode].append(step_time(mode))
    if d.rank == 0:
        base = statistics.median(results["none"])  # the sleep's own overshoot is not the exchange's
        print(json.dumps({m: statistics.median(results[m]) - base for m in ("waited", "overlapped")}))
    distributed.shutdown(d)


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--work-ms", type=float, default=5.0, help="simulated compute per step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--worker", "--steps", str(args.steps), "--work-ms", str(args.work_ms), "--rounds", str(args.rounds)]
    with ForeignLoad() as load:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench ranks failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    report = {
        "overhead_us_per_step": {m: round(v * 1e6) for m, v in res.items()},
        "waited_vs_overlapped": round(res["waited"] / max(res["overlapped"], 1e-6), 1),
        "step_compute_ms": args.work_ms,
        "steps": args.steps,
        "rounds": args.rounds,
        "foreign_load_cores": round(load.cores, 2),
        "busy_machine": load.cores > 0.2,
        "cpu_count": os.cpu_count(),
    }
    print_report(report, args.json)


if __name__ == "__main__":
    main()
