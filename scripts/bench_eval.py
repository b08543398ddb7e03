"""Benchmark: how long `make train`'s final evaluation takes, and what torch's thread count does to it.

The evaluation decodes one sequence at a time: a chain of small matmuls, where intra-op threads beyond
what the workers use only contend (on 2 shared cores a loaded machine made torch's default 15x slower
than one thread). The trainer's evaluations and `dflash eval` of a run therefore use the workers'
`threads_per_worker`; this measures that choice against torch's default, alternating the two.

The drafter is `make train`'s: trained here with configs/tiny-cpu.toml, its step budget or
`--train-steps` (or an existing run given with `--drafter RUN_DIR`), then evaluated as the final
evaluation is: 8 prompts x 96 new tokens of the demo data with the lossless check (`dflash eval`'s
work, in this process), which also gives the wall-time speedup over plain greedy decoding.

    python scripts/bench_eval.py [--json] [--quick] [--rounds 3] [--train-steps N] [--drafter RUN_DIR]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from _bench import ForeignLoad, bench_parser, print_report

REPO = Path(__file__).resolve().parents[1]


def train_drafter(run_dir: Path, steps: int | None) -> None:
    """`make train`'s run (its step budget, or `steps`), without its own evaluation or telemetry."""
    from dflash.train.config.schema import load_toml, make_config
    from dflash.train.trainer import Trainer

    limits = {} if steps is None else {"max_steps": steps}
    cfg = make_config(load_toml(REPO / "configs" / "tiny-cpu.toml"),
                      {"run_dir": str(run_dir), "telemetry": False, "eval_prompts": 0, **limits})
    if Trainer(cfg, log=lambda s: None).run() != 0:
        raise SystemExit("bench_eval: training the drafter failed")


def measure(run_dir: Path, prompts_n: int, new_tokens: int, rounds: int) -> dict:
    """Median evaluation seconds with the workers' threads and with torch's default, interleaved."""
    import torch

    from dflash.data import load_prompts
    from dflash.eval.speculative import evaluate
    from dflash.model.loading import load_drafter
    from dflash.targets import load_target
    from dflash.train.config.schema import config_beside
    from dflash.train.reporting.evaluation import torch_threads

    cfg = config_beside(run_dir)
    workers = cfg.pipeline.threads_per_worker or 1
    default = torch.get_num_threads()  # torch's own choice in this process (OMP_NUM_THREADS, else the cores)
    drafter = load_drafter(run_dir)
    target = load_target(cfg.run.target, device="cpu", layer_ids=drafter.config.target_layer_ids)
    drafter = drafter.to(device=target.device, dtype=target.dtype)
    prompts = load_prompts(cfg.run.data, target.tokenizer, prompts_n)
    times: dict[int, list[float]] = {workers: [], default: []}
    result = None
    for _ in range(rounds):
        for n in times:
            with torch_threads(n):
                t0 = time.perf_counter()
                result = evaluate(drafter, target, prompts, max_new_tokens=new_tokens)
                times[n].append(time.perf_counter() - t0)
    ours, theirs = statistics.median(times[workers]), statistics.median(times[default])
    return {
        "prompts": len(prompts), "new_tokens": new_tokens, "tau": round(result.tau, 3),
        "lossless": result.lossless, "workers_threads": workers, "default_threads": default,
        "eval_s_workers_threads": round(ours, 2), "eval_s_default_threads": round(theirs, 2),
        "default_over_workers": round(theirs / ours, 2),
        "speedup_over_greedy": round(result.speedup, 3) if result.speedup is not None else None,
        "round_cost_steps": round(result.round_cost, 2) if result.round_cost is not None else None,
    }


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a 2-step drafter, 1 prompt x 8 tokens, one round "
                   "(a smoke run: the figures mean nothing)")
    p.add_argument("--rounds", type=int, default=3, help="evaluations per thread setting (median)")
    p.add_argument("--train-steps", type=int, default=None, help="training steps of the drafter (default: make "
                   "train's budget, configs/tiny-cpu.toml)")
    p.add_argument("--drafter", type=Path, default=None, help="evaluate this run's drafter instead of training one")
    args = p.parse_args()
    rounds, prompts_n, new_tokens = (1, 1, 8) if args.quick else (args.rounds, 8, 96)
    with tempfile.TemporaryDirectory(prefix="bench-eval-") as tmp, ForeignLoad() as load:
        run_dir = args.drafter
        if run_dir is None:
            run_dir = Path(tmp) / "run"
            train_drafter(run_dir, 2 if args.quick else args.train_steps)
        report = measure(run_dir, prompts_n, new_tokens, rounds)
    report.update({"cpus": os.cpu_count(), "foreign_load_cores": round(load.cores, 2),
                   "busy_machine": load.cores > 0.2})
    print_report(report, args.json)


if __name__ == "__main__":
    main()
