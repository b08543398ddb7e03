"""Benchmark: batches bucketed by length against a plain shuffle, on a length-skewed corpus.

A batch pads to its longest row and the target's forward pays for every padded slot. On a corpus of
lognormal lengths (most rows short, a few long: real chat data's shape), a plain shuffle puts a long row
in most batches; length buckets (`--length-buckets on`, dflash/train/run/stages.py) give a step rows of
similar length. Measured: the padding share (padded slots / all slots of the batches built) and the
real tokens trained per second (padding not counted) of the in-process trainer with the built-in tiny
target, buckets off and on, interleaved (A B A B), each run in a fresh process with one torch thread per
worker. The report gives the foreign load (other processes' CPU while it ran, and the 1-minute load
average), since on a shared machine any other job moves these figures.

    python scripts/bench_bucketing.py [--json] [--quick] [--rounds 2] [--steps 16] [--rows 1500]
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import ForeignLoad, bench_args, print_report

OPTIONS = {
    "rounds": (2, "A B rounds (each mode once per round, the order alternating)"),
    "steps": (16, "measured steps per run"),
    "warmup": (3, "steps left out of the rate (warm-up)"),
    "rows": (1500, "rows of the synthetic corpus"),
    "batch_size": (8, "rows per step"),
    "num_anchors": (8, "anchors per row (the drafter's work; the target's grows with the padded width)"),
    "max_seq_len": (512, "longest row in tokens"),
    "sigma": (0.9, "the lognormal's sigma: how skewed the lengths are"),
    "median_words": (60, "the lognormal's median, in words per response"),
    "seed": (0, "the corpus's and the run's seed"),
}
QUICK = ("a smoke run (its figures mean little)", {"rounds": 1, "steps": 4, "warmup": 1, "rows": 200})
#: words the tiny target's tokenizer knows (it was trained on the Python standard library's source)
WORDS = "def return import class self if else for in while print None True False lambda yield with as".split()


def write_corpus(path: Path, rows: int, median: float, sigma: float, seed: int) -> None:
    """Prompt/response rows whose response lengths are lognormal (a short prompt each)."""
    import math

    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            n = max(8, int(rng.lognormvariate(math.log(median), sigma)))
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
            f.write(json.dumps({"prompt": prompt, "response": " ".join(rng.choice(WORDS) for _ in range(n))}) + "\n")


def measure(args, bucket: bool) -> dict:
    """One run of the real trainer (pipelined, no telemetry, no evaluation); its steady rates."""
    import torch

    from dflash.train.config.schema import make_config
    from dflash.train.trainer import Trainer

    torch.set_num_threads(1)
    run_dir = tempfile.mkdtemp(prefix="dflash-bench-bucketing-")
    try:
        cfg = make_config({}, dict(
            target="tiny", data=args.data, run_dir=run_dir, length_buckets=bucket, telemetry=False,
            max_steps=args.warmup + args.steps, batch_size=args.batch_size, num_anchors=args.num_anchors,
            max_seq_len=args.max_seq_len, drafter_layers=1, threads_per_worker=1, log_every=1e9, eval_prompts=0,
            checkpoint_every=1e9, seed=args.seed))
        trainer = Trainer(cfg, log=lambda s: None)
        stamps: list[tuple[float, int]] = []
        inner = trainer.on_step

        def on_step(r):
            stamps.append((time.perf_counter(), r.tokens))
            return inner(r)

        trainer.on_step = on_step
        assert trainer.run() == 0
        steady = stamps[args.warmup - 1:]
        seconds = steady[-1][0] - steady[0][0]
        source = trainer.source
        return {"tokens_per_s": sum(n for _, n in steady[1:]) / seconds, "steps_per_s": (len(steady) - 1) / seconds,
                "padding_share": source.padding_share}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def child(args, mode: str) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--data", args.data,
           *(f"--{k}={getattr(args, k)}" for k in OPTIONS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench child {mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if "--child" in sys.argv:  # one measurement, in its own process
        i = sys.argv.index("--child")
        mode = sys.argv[i + 1]
        j = sys.argv.index("--data")
        data = sys.argv[j + 1]
        sys.argv = [sys.argv[0], *(a for k, a in enumerate(sys.argv[1:], 1) if k not in (i, i + 1, j, j + 1))]
        args = bench_args(__doc__, OPTIONS, QUICK)
        args.data = data
        print(json.dumps(measure(args, bucket=mode == "on")))
        return
    args = bench_args(__doc__, OPTIONS, QUICK)
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-bucketing-data-"))
    try:
        args.data = str(work / "skewed.jsonl")
        write_corpus(Path(args.data), args.rows, args.median_words, args.sigma, args.seed)
        results: dict[str, list[dict]] = {"off": [], "on": []}
        load_before = os.getloadavg()[0]
        with ForeignLoad() as load:
            for r in range(args.rounds):
                for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):  # A B, then B A: drift hits both
                    results[mode].append(child(args, mode))
                    if not args.json:
                        x = results[mode][-1]
                        print(f"round {r + 1} buckets {mode:<3} {x['tokens_per_s']:,.0f} real tokens/s, padding "
                              f"{x['padding_share']:.1%}", file=sys.stderr)
        med = {m: {k: statistics.median(x[k] for x in results[m]) for k in results[m][0]} for m in results}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "padding_share_off": round(med["off"]["padding_share"], 3),
        "padding_share_on": round(med["on"]["padding_share"], 3),
        "real_tokens_per_s_off": round(med["off"]["tokens_per_s"], 1),
        "real_tokens_per_s_on": round(med["on"]["tokens_per_s"], 1),
        "tokens_per_s_on_vs_off": round(med["on"]["tokens_per_s"] / med["off"]["tokens_per_s"], 3),
        "steps_per_s_on_vs_off": round(med["on"]["steps_per_s"] / med["off"]["steps_per_s"], 3),
        "per_round": {m: [{k: round(v, 3) for k, v in x.items()} for x in results[m]] for m in results},
        "foreign_load_cores": round(load.cores, 2),
        "loadavg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "busy_machine": load.cores > 0.2,
        "rows": args.rows, "lognormal_median_words": args.median_words, "sigma": args.sigma,
        "batch_size": args.batch_size, "steps_per_run": args.steps, "rounds": args.rounds,
        "cpu_count": os.cpu_count(),
    }
    print_report(report, args.json)


if __name__ == "__main__":
    main()
