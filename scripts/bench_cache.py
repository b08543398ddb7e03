"""Benchmark: training steps/s from an offline hidden-states cache against running the target in-process.

The first ``--samples`` demo rows are the data of both; their cache of the tiny target's states is written
once (`dflash data cache`); then the real trainer runs the same steps, same seed, twice per round, each
in a fresh process with one intra-op thread per worker, interleaved over rounds:

* online   the target runs in the pipeline (``target_forward``)
* cache    ``--hidden-states DIR``: the first stage reads the files ahead (``cache_read``)

Throughput is drafter steps per second in steady state (the first ``--warmup`` steps dropped). On the
tiny target the forward is cheap, so the gap here is small; on a real target the cache removes the
target's forward (and its GPUs) from the run entirely. The report includes the foreign CPU load.

``--formats``: instead, the same rows cached as fp32, bf16 and FP8 (`dflash data cache --dtype`, the taps
of configs/tiny-cpu.toml): bytes per sample, and samples/s one reader thread delivers from each (read,
checked, an FP8 file dequantised to the fp32 a CPU run trains in; files in the page cache, so this is the
reader's CPU cost, not the disk's; median of ``--rounds`` interleaved passes); with ``--tau-steps N``,
the recipe trained N steps from each cache (same seed) and its real tau at the end (the run's own final
evaluation against the tiny target).

    python scripts/bench_cache.py [--json] [--quick] [--rounds 3] [--steps 16]
    python scripts/bench_cache.py --formats [--samples 2000] [--rounds 5] [--tau-steps 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _bench import ForeignLoad, bench_parser, print_report, steady_steps_per_s

DTYPES = ("fp32", "bf16", "fp8")
RECIPE = "configs/tiny-cpu.toml"
RECIPE_TAPS = "1,3,5"  # the recipe's target_layer_ids: its caches hold these


def measure(args, mode: str) -> dict:
    import torch

    from dflash.train.config.schema import make_config
    from dflash.train.trainer import Trainer

    torch.set_num_threads(1)
    overrides = dict(target="tiny", data=args.data, run_dir=args.run_dir, max_steps=args.warmup + args.steps,
                     batch_size=args.batch_size, num_anchors=args.num_anchors, max_seq_len=args.max_seq_len,
                     drafter_layers=args.drafter_layers, threads_per_worker=1, log_every=1e9, eval_prompts=0,
                     checkpoint_every=1e9, socket_dir=args.socket_dir, telemetry_interval=0.5)
    if mode == "cache":
        overrides["hidden_states"] = args.cache
    trainer = Trainer(make_config({}, overrides), log=lambda s: None)
    return {"steps_per_s": steady_steps_per_s(trainer, args.warmup)}


def read_rate(args, cache: str) -> dict:
    """Samples/s of one reader thread over every row of ``cache``: a pass after a warm-up pass (the
    files are in the page cache, so the figure is the reader's own work)."""
    import torch

    from dflash.targets.cache import load_cache_target

    torch.set_num_threads(1)
    target = load_cache_target(cache, "tiny", None, None, torch.device("cpu"), threads=1, log=lambda s: None)
    rows = list(range(len(target.layout.rows)))
    rates = []
    try:
        for _ in range(2):
            t0 = time.perf_counter()
            target.reader.schedule(rows)
            for r in rows:
                target.reader.take(r)
            rates.append(len(rows) / (time.perf_counter() - t0))
    finally:
        target.close()
    return {"samples_per_s": rates[-1]}


def _cache(args, out: str, *flags: str) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "dflash", "data", "cache", "--target", "tiny", "--data", args.data,
                    "--out", out, "--max-samples", str(args.samples), "--no-telemetry", *flags],
                   check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return time.monotonic() - t0


def _train_tau(args, cache: str, run_dir: str) -> dict:
    """The recipe trained ``--tau-steps`` from ``cache``; the tau of its final evaluation (evals.jsonl)."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "dflash", "train", "--config", RECIPE, "--hidden-states", cache,
                           "--max-steps", str(args.tau_steps), "--eval-target", "tiny", "--run-dir", run_dir,
                           "--no-telemetry"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"training from {cache} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "evals.jsonl")) as f:
        last = json.loads(f.read().strip().splitlines()[-1])
    return {"tau": last["tau"], "lossless": last.get("lossless"), "train_s": round(time.monotonic() - t0)}


def formats(args) -> dict:
    work = tempfile.mkdtemp(prefix="dflash-bench-formats-")
    args.data = os.path.join(work, "data.jsonl")
    report: dict = {"samples": args.samples}
    try:
        from dflash.data.demo import demo_path

        rows = demo_path().read_text().splitlines()[:args.samples]
        with open(args.data, "w") as f:
            f.write("\n".join(rows) + "\n")
        caches = {d: os.path.join(work, d) for d in DTYPES}
        with ForeignLoad() as load:
            for d, out in caches.items():
                s = _cache(args, out, "--dtype", d, "--target-layer-ids", RECIPE_TAPS, "--max-seq-len", "320")
                report[f"write_s_{d}"] = round(s, 1)
            for d, out in caches.items():
                files = [os.path.join(out, "hidden_states", f) for f in os.listdir(os.path.join(out, "hidden_states"))]
                report[f"bytes_per_sample_{d}"] = round(sum(os.path.getsize(f) for f in files) / len(files))
            rates: dict[str, list[float]] = {d: [] for d in DTYPES}
            for r in range(args.rounds):
                for d in DTYPES if r % 2 == 0 else DTYPES[::-1]:  # interleaved: drift hits all alike
                    rates[d].append(_child(args, "read", caches[d])["samples_per_s"])
                    if not args.json:
                        print(f"round {r + 1} {d}: {rates[d][-1]:.0f} samples/s per reader thread", file=sys.stderr)
            for d, v in rates.items():
                report[f"reader_samples_per_s_{d}"] = round(statistics.median(v), 1)
            for d in args.tau_dtypes.split(",") if args.tau_steps else ():
                res = _train_tau(args, caches[d], os.path.join(work, f"run-{d}"))
                report.update({f"{k}_{d}": v for k, v in res.items()})
                if not args.json:
                    print(f"{d}: tau {res['tau']} after {args.tau_steps} steps ({res['train_s']} s)", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["fp8_vs_fp32_bytes"] = round(report["bytes_per_sample_fp8"] / report["bytes_per_sample_fp32"], 3)
    report["tau_steps"] = args.tau_steps
    report["foreign_load_cores"] = round(load.cores, 2)
    report["busy_machine"] = load.cores > 0.3
    return report


def _child(args, mode: str, cache: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, f"--cache={cache or args.cache}", f"--data={args.data}",
           *args.passthrough]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench child {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="one round of a few steps: proves it runs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=16, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--samples", type=int, default=256, help="demo rows in the cache")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-anchors", type=int, default=24)
    p.add_argument("--max-seq-len", type=int, default=320)
    p.add_argument("--drafter-layers", type=int, default=3)
    p.add_argument("--formats", action="store_true", help="fp32 / bf16 / fp8 caches: bytes per sample, reader "
                   "samples/s per thread (and tau with --tau-steps)")
    p.add_argument("--tau-steps", type=int, default=0, help="with --formats: train the tiny recipe this many steps "
                   "from each cache of --tau-dtypes and report its real tau (0: not)")
    p.add_argument("--tau-dtypes", default="fp32,fp8", help="with --tau-steps: the caches to train from")
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.samples = 1, 4, 2, 32
    args.run_dir = f"/tmp/dflash-bench-{os.getpid()}"
    args.socket_dir = f"/tmp/dflash-bench-sock-{os.getpid()}"
    args.passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                        ("steps", "warmup", "batch_size", "num_anchors", "max_seq_len", "drafter_layers", "rounds")]
    if args.child:
        try:
            res = read_rate(args, args.cache) if args.child == "read" else measure(args, args.child)
        finally:
            shutil.rmtree(args.run_dir, ignore_errors=True)
            shutil.rmtree(args.socket_dir, ignore_errors=True)
        print(json.dumps(res))
        return
    if args.formats:
        print_report(formats(args), args.json)
        return

    work = tempfile.mkdtemp(prefix="dflash-bench-cache-")
    args.cache, args.data = os.path.join(work, "hs"), os.path.join(work, "data.jsonl")
    try:
        from dflash.data.demo import demo_path

        rows = demo_path().read_text().splitlines()[:args.samples]
        with open(args.data, "w") as f:
            f.write("\n".join(rows) + "\n")
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "dflash", "data", "cache", "--target", "tiny", "--data", args.data,
                        "--out", args.cache, "--max-samples", str(args.samples), "--max-seq-len",
                        str(args.max_seq_len), "--drafter-layers", str(args.drafter_layers), "--no-telemetry"],
                       check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        write_s = time.monotonic() - t0
        modes = ["online", "cache"]
        results: dict[str, list[float]] = {m: [] for m in modes}
        with ForeignLoad() as load:
            for r in range(args.rounds):
                for m in modes if r % 2 == 0 else modes[::-1]:  # interleaved: drift hits both alike
                    results[m].append(_child(args, m)["steps_per_s"])
                    if not args.json:
                        print(f"round {r + 1} {m:<7} {results[m][-1]:.3f} steps/s", file=sys.stderr)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(args.cache) for f in fs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rate = {m: statistics.median(v) for m, v in results.items()}
    report = {
        "steps_per_s": {m: round(v, 4) for m, v in rate.items()},
        "cache_vs_online": round(rate["cache"] / rate["online"], 3),
        "cache_write_s": round(write_s, 1),
        "cache_mb": round(size / 1e6, 1),
        "samples": args.samples,
        "rounds": args.rounds,
        "foreign_load_cores": round(load.cores, 2),
        "busy_machine": load.cores > 0.3,
    }
    print_report(report, args.json)


if __name__ == "__main__":
    main()
