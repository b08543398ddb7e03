"""Benchmark: which recipe accepts most: the tiny recipe trained for the same wall time under each
drafter, objective and optimizer.

Each recipe is configs/tiny-cpu.toml (`make train`) with one combination of `--loss` (ce, kl),
`--position-weight` (exp, dpace; D-PACE needs ce) and `--optimizer` (adamw, muon), named
`loss-weight-optimizer`, for a DFlash drafter; a name prefixed `dspark:` or `dflash2:` is the same for
that `--drafter-type`, with its own recipe where it has one (DSpark: block 7, decay 4, its CE + total
variation + confidence objective; DFlash2: its selector term), everything else as `make train`. Each is
trained by a real
`dflash train` process for `--train-seconds` of training time (evaluations excluded), then evaluated
by a real `dflash eval` (held-out demo prompts, greedy, with the lossless check): tau and the
acceptance of each draft slot. Recipes are interleaved within each seed (seed 0: every recipe, then
seed 1: every recipe, ...), so a slow spell of the machine hits all of them alike, and the load other
processes put on the machine is reported beside the table.

    python scripts/bench_recipes.py [--json] [--quick] [--train-seconds 300] [--seeds 2] [--prompts 16]
        [--tokens 96] [--recipes ce-exp-adamw,kl-exp-muon,dspark:ce-exp-muon]

`--quick` is a smoke run (two steps per recipe, one prompt of 8 tokens): its figures mean nothing.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _bench import ForeignLoad, bench_parser, print_report

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONFIG = REPO / "configs" / "tiny-cpu.toml"
#: every combination that makes sense: D-PACE weighs by the drafter's probability of the label, which
#: only the cross-entropy computes (dflash refuses kl with dpace)
_DFLASH = ["ce-exp-adamw", "ce-dpace-adamw", "kl-exp-adamw", "ce-exp-muon", "ce-dpace-muon", "kl-exp-muon"]
#: the other drafter types beside DFlash's rows: DSpark's objective is written for ce (kl is refused)
_OTHERS = {"dspark": ["ce-exp-adamw", "ce-dpace-adamw", "ce-exp-muon", "ce-dpace-muon"],
           "dflash2": ["ce-exp-adamw", "ce-dpace-adamw", "ce-exp-muon", "ce-dpace-muon"]}
RECIPES = _DFLASH + [f"{drafter}:{r}" for drafter, rows in _OTHERS.items() for r in rows]


def parse_recipe(recipe: str) -> tuple[str, str, str, str]:
    """(drafter type, loss, position weight, optimizer) of a recipe name, `[drafter:]loss-weight-optimizer`."""
    drafter, _, rest = recipe.rpartition(":")
    loss, weight, optimizer = rest.split("-")
    return drafter or "dflash", loss, weight, optimizer


def train(run_dir: Path, recipe: str, seed: int, seconds: float | None, steps: int | None) -> None:
    """`make train`'s recipe under `recipe` ([drafter:]loss-weight-optimizer) for `seconds` of training
    (or `steps`), without its own evaluation or telemetry."""
    drafter, loss, weight, optimizer = parse_recipe(recipe)
    limit = ["--max-time", str(seconds)] if steps is None else ["--max-steps", str(steps)]
    cmd = [str(BIN / "dflash"), "train", "--config", str(CONFIG), "--run-dir", str(run_dir), "--seed", str(seed),
           "--drafter-type", drafter, "--loss", loss, "--position-weight", weight, "--optimizer", optimizer,
           "--eval-prompts", "0", "--no-telemetry", "--checkpoint-every", "1e9", *limit]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_recipes: training {recipe} (seed {seed}) failed:\n{r.stderr[-2000:]}")


def trained(run_dir: Path) -> dict:
    """Steps, tokens and training seconds of the run's last checkpoint."""
    import torch

    from dflash.checkpoint_files import list_checkpoints

    state = torch.load(list_checkpoints(run_dir)[-1], map_location="cpu", weights_only=True)["state"]
    return {"steps": state["step"], "tokens": state["tokens"], "train_s": state["train_time"]}


def evaluate(run_dir: Path, prompts: int, tokens: int) -> dict:
    r = subprocess.run([str(BIN / "dflash"), "eval", "--drafter", str(run_dir), "--num-prompts", str(prompts),
                        "--max-new-tokens", str(tokens), "--device", "cpu", "--json"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench_recipes: dflash eval {run_dir} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict:
    """One recipe over its seeds: mean tau (and each seed's), acceptance of slots 1-3, tokens/s."""
    taus = [r["tau"] for r in runs]
    acc = [statistics.mean(r["acceptance"][k] for r in runs) for k in range(min(3, len(runs[0]["acceptance"])))]
    return {"tau": round(statistics.mean(taus), 3), "tau_per_seed": [round(t, 3) for t in taus],
            "acceptance_1_2_3": [round(a, 3) for a in acc],
            "tokens_per_s": round(statistics.mean(r["tokens"] / r["train_s"] for r in runs), 1),
            "steps": round(statistics.mean(r["steps"] for r in runs)), "lossless": all(r["lossless"] for r in runs)}


def table(results: dict[str, dict]) -> str:
    """The results as the README's markdown table, best tau first."""
    lines = ["| recipe ([drafter:]loss-weight-optimizer) | tau (mean) | tau per seed | acceptance slot 1/2/3 "
             "| tokens/s | steps |",
             "|---|---|---|---|---|---|"]
    for name, s in sorted(results.items(), key=lambda kv: -kv[1]["tau"]):
        lines.append(f"| {name} | **{s['tau']:.2f}** | {' '.join(f'{t:.2f}' for t in s['tau_per_seed'])} | "
                     f"{'/'.join(f'{a:.2f}' for a in s['acceptance_1_2_3'])} | {s['tokens_per_s']:,.0f} | "
                     f"{s['steps']:,} |")
    return "\n".join(lines)


def main() -> int:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a smoke run: two steps per recipe, one short prompt")
    p.add_argument("--train-seconds", type=float, default=300.0, help="training time per run (default 300)")
    p.add_argument("--seeds", type=int, default=2, help="seeds per recipe (default 2)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts per evaluation (default 16)")
    p.add_argument("--tokens", type=int, default=96, help="new tokens per prompt (default 96)")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help="comma-separated [drafter:]loss-weight-optimizer recipes (default: all)")
    args = p.parse_args()
    steps = 2 if args.quick else None
    if args.quick:
        args.seeds, args.prompts, args.tokens = 1, 1, 8
    recipes = args.recipes.split(",")
    bad = [r for r in recipes if r not in RECIPES]
    if bad:
        raise SystemExit(f"bench_recipes: unknown recipe {bad[0]!r}; choose from {', '.join(RECIPES)}")
    runs: dict[str, list[dict]] = {r: [] for r in recipes}
    with tempfile.TemporaryDirectory() as tmp, ForeignLoad() as load:
        for seed in range(args.seeds):
            for recipe in recipes:  # interleaved: every recipe once per seed
                run_dir = Path(tmp) / f"{recipe.replace(':', '-')}-{seed}"
                train(run_dir, recipe, seed, args.train_seconds, steps)
                e = evaluate(run_dir, args.prompts, args.tokens)
                runs[recipe].append({**trained(run_dir), "tau": e["tau"], "acceptance": e["per_position_acceptance"],
                                     "lossless": e["lossless"]})
    results = {r: summarise(v) for r, v in runs.items()}
    report = {"train_seconds": None if args.quick else args.train_seconds, "steps_per_run": steps,
              "seeds": args.seeds, "prompts": args.prompts, "new_tokens": args.tokens, "recipes": results,
              "foreign_load_cores": round(load.cores, 2), "busy_machine": load.cores > 0.2}
    if args.json:
        print_report(report, True)
        return 0
    print(table(results))
    print_report({k: v for k, v in report.items() if k != "recipes"}, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
