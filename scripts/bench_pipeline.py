"""Benchmark: does the pipeline overlap the target and drafter stages as well as the machine allows?

Two devices are modelled as two CPU cores: every stage gets one intra-op thread (set inside each
worker thread: OpenMP/MKL thread counts are per thread). Measured side by side, interleaved over
several rounds, each configuration in a fresh process:

* sync        target forward then drafter step in one loop (``--pipeline off``), as public trainers do
* pipelined   the real trainer (``--pipeline on``), telemetry on
* pipe-notel  the same with ``--no-telemetry``
* target      the target stage alone;  drafter: the drafter stage alone (on a fixed hidden batch)
* ceiling     target and drafter stages at once as two unconnected processes: what these cores allow
              when nothing couples the stages. The pipeline's goal is >= 0.9x this.

Throughput is drafter steps per second in steady state (the first steps, which include warm-up, are
dropped). The report includes the foreign CPU load seen during the run (other processes' use of the
cores), and flags a busy machine, since on 2 cores any other job halves these figures.

    python scripts/bench_pipeline.py [--json] [--rounds 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _bench import ForeignLoad, bench_parser, print_report, rate_after, steady_steps_per_s

# --- measurement processes ---------------------------------------------------------------------------


def _setup(args, pipeline: bool, telemetry: bool):
    import torch

    from dflash.train.config.schema import make_config
    from dflash.train.trainer import Trainer

    torch.set_num_threads(1)
    cfg = make_config({}, dict(
        target=args.target, data=args.data, run_dir=args.run_dir, pipeline=pipeline, telemetry=telemetry,
        max_steps=args.warmup + args.steps, batch_size=args.batch_size, num_anchors=args.num_anchors,
        max_seq_len=args.max_seq_len, drafter_layers=args.drafter_layers, threads_per_worker=1,
        log_every=1e9, eval_prompts=0, checkpoint_every=1e9, socket_dir=args.socket_dir,
        telemetry_interval=0.5,
    ))
    return Trainer(cfg, log=lambda s: None)


def measure_trainer(args, pipeline: bool, telemetry: bool) -> dict:
    trainer = _setup(args, pipeline, telemetry)
    out = {"steps_per_s": steady_steps_per_s(trainer, args.warmup)}
    if telemetry and trainer.server is not None and trainer.server.latest() is not None:
        cum = trainer.server.latest().cumulative
        out["shares"] = {w: {c: round(s.share, 3) for c, s in sorted(cats.items(), key=lambda x: -x[1].share)[:5]}
                         for w, cats in cum.items()}
    return out


def measure_stage(args, which: str) -> dict:
    """One stage alone in a tight loop, on real batches (the drafter on one precomputed hidden batch)."""
    import torch

    trainer = _setup(args, pipeline=True, telemetry=False)
    trainer.setup()
    torch.set_num_threads(1)
    stage, drafter, source = trainer.targets[0], trainer.drafter, trainer.source
    hb = stage(source(0))
    stamps = []
    for i in range(args.warmup + args.steps):
        if which == "target":
            stage(source(i))
        else:
            drafter.step(hb, 0.5)
        stamps.append(time.perf_counter())
    return {"steps_per_s": rate_after(stamps, args.warmup)}


def _child(args, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, *args.passthrough]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench child {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ceiling(args) -> dict:
    """Both stages at once as two unconnected processes: the rate the slower one sustains."""
    procs = [subprocess.Popen([sys.executable, __file__, "--child", m, *args.passthrough], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for m in ("target", "drafter")]
    rates = {}
    for m, p in zip(("target", "drafter"), procs, strict=True):
        out, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"bench ceiling {m} failed:\n{err[-3000:]}")
        rates[m] = json.loads(out.strip().splitlines()[-1])["steps_per_s"]
    return {"steps_per_s": min(rates.values()), "target": rates["target"], "drafter": rates["drafter"]}


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=16, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--target", default="tiny")
    p.add_argument("--data", default="demo")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-anchors", type=int, default=24)
    p.add_argument("--max-seq-len", type=int, default=320)
    p.add_argument("--drafter-layers", type=int, default=1)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.run_dir = f"/tmp/dflash-bench-{os.getpid()}"
    args.socket_dir = f"/tmp/dflash-bench-sock-{os.getpid()}"
    args.passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                        ("steps", "warmup", "target", "data", "batch_size", "num_anchors", "max_seq_len",
                         "drafter_layers")]

    if args.child:
        import shutil

        try:
            if args.child in ("target", "drafter"):
                res = measure_stage(args, args.child)
            else:
                res = measure_trainer(args, pipeline=args.child != "sync", telemetry=args.child != "pipe-notel")
        finally:
            shutil.rmtree(args.run_dir, ignore_errors=True)
            shutil.rmtree(args.socket_dir, ignore_errors=True)
        print(json.dumps(res))
        return

    modes = ["sync", "pipelined", "pipe-notel", "target", "drafter", "ceiling"]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with ForeignLoad() as load:
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else modes[::-1]  # interleave so drift hits every mode alike
            for m in order:
                results[m].append(_ceiling(args) if m == "ceiling" else _child(args, m))
                if not args.json:
                    print(f"round {r + 1} {m:<10} {results[m][-1]['steps_per_s']:.3f} steps/s", file=sys.stderr)

    rate = {m: statistics.median(x["steps_per_s"] for x in results[m]) for m in modes}
    report = {
        "steps_per_s": {m: round(v, 4) for m, v in rate.items()},
        "pipelined_vs_sync": round(rate["pipelined"] / rate["sync"], 3),
        "pipelined_vs_ceiling": round(rate["pipelined"] / rate["ceiling"], 3),
        "pipelined_vs_slowest_stage": round(rate["pipelined"] / min(rate["target"], rate["drafter"]), 3),
        "telemetry_on_vs_off": round(rate["pipelined"] / rate["pipe-notel"], 3),
        "ceiling_vs_sync": round(rate["ceiling"] / rate["sync"], 3),
        "foreign_load_cores": round(load.cores, 2),
        "busy_machine": load.cores > 0.2,
        "where_time_goes": {m: results[m][-1].get("shares") for m in ("sync", "pipelined")},
        "rounds": args.rounds,
        "steps_per_config": args.steps,
        "cpu_count": os.cpu_count(),
    }
    print_report(report, args.json)


if __name__ == "__main__":
    main()
