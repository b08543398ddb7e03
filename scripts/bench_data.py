"""Benchmark: a rank's start on a large data set, tokenizing JSONL at every start against a token store.

A synthetic corpus of ``--rows`` two-turn ``messages`` rows (skewed lengths: most answers short, a long
tail, as real chat data has) is written under a temp directory and read with the tiny target's tokenizer
(dflash/targets/tiny/). For each size:

* jsonl    what a rank did before the store: load_samples tokenizes every row into Python lists
* store    the store prepared once, then memory-mapped (`dflash train --data STORE_DIR`)

each in a fresh process, one intra-op thread, up to the first batch a rank trains on (BatchSource, as the
trainer builds it): the wall time to it and the process's peak RSS. Then ``dflash data prepare``'s rate in
rows/s with 1 and 2 worker processes. Last, what less padding buys: scripts/bench_bucketing.py's
padding share and real tokens/s with length buckets off and on (A B A B, its own length-skewed corpus),
run from here so one report holds the data path's figures (``--buckets_rounds 0`` leaves it out). The
report includes the foreign CPU load (another job on a 2-core machine halves every rate here).

    python scripts/bench_data.py [--json] [--quick] [--rows 10000,100000] [--max_seq_len 3072] [--buckets_rounds 2]
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import ForeignLoad, bench_args, print_report

ROOT = Path(__file__).resolve().parents[1]

#: the child: samples read one way, then the first batch; prints its figures as one JSON line
CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
from pathlib import Path
from transformers import AutoTokenizer
from dflash.targets.tiny import TINY_DIR
from dflash.train.run.stages import BatchSource
mode, data, limit = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(str(TINY_DIR))
if mode == "jsonl":
    from dflash.data import load_samples
    samples = load_samples(data, tok, max_len=limit, min_loss_tokens=16)
else:
    from dflash.data.store import TokenStore
    samples = TokenStore(data, max_len=limit, min_loss_tokens=16)
batch = BatchSource(samples, 8, 0, tok.pad_token_id or 0, block_size=16, num_anchors=24)(0)
print(json.dumps({"seconds": time.perf_counter() - t0, "samples": len(samples),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

WORDS = ("the of and to in is for that with as on by this be are from or it an at which can not have these "
         "model token layer block draft target verify accept reject hidden state attention mask anchor batch "
         "gradient loss step rank shard store memory cache kernel stream queue thread process").split()


def write_corpus(path: Path, rows: int, seed: int = 0) -> None:
    """Two-turn conversations: a question of 5-60 words, an answer of Pareto-distributed length (median ~90
    words, a tail past a thousand), so a few rows reach the length limit as real ones do."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            q = " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))
            a = " ".join(rng.choices(WORDS, k=min(4000, int(60 * rng.paretovariate(1.6)))))
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")


def child(mode: str, data: Path, limit: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(data), str(limit)], capture_output=True, text=True,
                       env=env, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{mode} child failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def prepare_rate(data: Path, out: Path, workers: int, limit: int, rows: int) -> float:
    """Rows per second of `dflash data prepare` with `workers` processes (shards small enough for all)."""
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "dflash", "data", "prepare", "--data", str(data), "--out", str(out),
                    "--workers", str(workers), "--max-seq-len", str(limit),
                    "--shard-rows", str(max(100, rows // 16))], check=True, capture_output=True, env=env, cwd=ROOT)
    return rows / (time.perf_counter() - t0)


def length_buckets(rounds: int, quick: bool) -> dict:
    """bench_bucketing.py's figures (padding share and real tokens/s, buckets off and on), run as its own
    process: the ratio side by side with this benchmark's, in one report."""
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_bucketing.py"), "--json", "--rounds", str(rounds),
           *(["--quick"] if quick else [])]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"bench_bucketing.py failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout)
    keep = ("padding_share_off", "padding_share_on", "real_tokens_per_s_off", "real_tokens_per_s_on",
            "tokens_per_s_on_vs_off", "rows", "batch_size", "rounds")
    return {k: out[k] for k in keep}


def main() -> None:
    args = bench_args(__doc__, {"rows": ("10000,100000", "corpus sizes, comma-separated"),
                                "max_seq_len": (3072, "the length limit (the GPU recipe's)"),
                                "buckets_rounds": (2, "rounds of the length-bucket comparison (0: skip it)")},
                      ("a 2,000-row corpus, to prove the script works", {"rows": "2000", "buckets_rounds": 1}))
    sizes = [int(x) for x in args.rows.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-data-"))
    report: dict = {"max_seq_len": args.max_seq_len, "cpus": os.cpu_count()}
    try:
        with ForeignLoad() as load:
            for n in sizes:
                data = work / f"rows-{n}.jsonl"
                write_corpus(data, n)
                one = prepare_rate(data, work / "p1", 1, args.max_seq_len, n)
                two = prepare_rate(data, work / "p2", 2, args.max_seq_len, n)
                jsonl, store = child("jsonl", data, args.max_seq_len), child("store", work / "p2", args.max_seq_len)
                assert jsonl["samples"] == store["samples"], (jsonl, store)
                report[f"{n}"] = {
                    "file_mb": round(data.stat().st_size / 1e6, 1), "samples": store["samples"],
                    "jsonl_first_batch_s": round(jsonl["seconds"], 2),
                    "store_first_batch_s": round(store["seconds"], 2),
                    "jsonl_peak_rss_mb": round(jsonl["peak_rss_mb"]), "store_peak_rss_mb": round(store["peak_rss_mb"]),
                    "prepare_rows_per_s_1_worker": round(one), "prepare_rows_per_s_2_workers": round(two)}
            if args.buckets_rounds > 0:
                report["length_buckets"] = length_buckets(args.buckets_rounds, args.quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["foreign_load_cores"] = round(load.cores, 2)
    report["loadavg_1m"] = round(os.getloadavg()[0], 2)
    report["busy_machine"] = load.cores > 0.5
    print_report(report, args.json)


if __name__ == "__main__":
    main()
