"""The README's proof-of-learning table, measured again: train `make train`'s recipe for a few minutes
with a checkpoint every interval, evaluate each checkpoint with real speculative decoding on held-out
prompts, and print one column per checkpoint (step, loss and simulated tau as means of the recorded
telemetry over the interval before it, real tau, per-slot acceptance, lossless).

    .venv/bin/python scripts/learning_curve.py                 # 10 minutes, a checkpoint every 2
    .venv/bin/python scripts/learning_curve.py --minutes 1 --every 0.5 --prompts 2 --tokens 16  # a smoke run

Run it alone: on 2 cores any other job slows training and moves every figure; the load average seen
before and after is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def train(run_dir: Path, minutes: float, every: float, config: Path) -> None:
    subprocess.run([str(BIN / "dflash"), "train", "--config", str(config), "--run-dir", str(run_dir),
                    "--max-time", str(minutes * 60), "--checkpoint-every", str(every * 60),
                    "--keep-checkpoints", "1000", "--eval-prompts", "0"],
                   check=True, stdout=subprocess.DEVNULL)


def checkpoints(run_dir: Path) -> list[tuple[Path, int, float]]:
    """(file, step, seconds trained) of every checkpoint, oldest first."""
    import torch

    out = []
    for path in sorted((run_dir / "checkpoints").glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1])):
        state = torch.load(path, map_location="cpu", weights_only=True)["state"]
        out.append((path, state["step"], state["train_time"]))
    return out


def evaluate(path: Path, prompts: int, tokens: int) -> dict:
    r = subprocess.run([str(BIN / "dflash"), "eval", "--drafter", str(path), "--num-prompts", str(prompts),
                        "--max-new-tokens", str(tokens), "--device", "cpu", "--json"],
                       check=True, capture_output=True, text=True)
    return json.loads(r.stdout)


def interval_means(run_dir: Path, start: float, end: float) -> dict[str, float]:
    """Means of the recorded loss gauge and simulated-tau metric over [start, end) seconds trained."""
    from dflash.telemetry.wire.reader import read_frames

    loss, sim = [], []
    for f in read_frames(run_dir / "telemetry.jsonl"):
        t = getattr(f, "gauges", {}).get("train_time_s")
        if t is None or not start <= t < end:
            continue
        if "loss" in f.gauges:
            loss.append(f.gauges["loss"])
        if isinstance(f.metrics.get("sim_tau"), float):
            sim.append(f.metrics["sim_tau"])
    return {"loss": _mean(loss), "sim_tau": _mean(sim)}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="training time (default 10)")
    p.add_argument("--every", type=float, default=2.0, help="minutes between checkpoints (default 2)")
    p.add_argument("--prompts", type=int, default=16, help="held-out prompts per evaluation (default 16)")
    p.add_argument("--tokens", type=int, default=96, help="new tokens per prompt (default 96)")
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny-cpu.toml")
    p.add_argument("--run-dir", type=Path, help="keep the run here (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print the columns as JSON instead of a table")
    args = p.parse_args()

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run_dir or Path(tmp) / "run"
        train(run_dir, args.minutes, args.every, args.config)
        columns, previous = [], 0.0
        for path, step, trained in checkpoints(run_dir):
            r = evaluate(path, args.prompts, args.tokens)
            columns.append({"minute": round(trained / 60, 1), "step": step,
                            **interval_means(run_dir, previous, trained + 1e-9), "tau": r["tau"],
                            "acceptance": r["per_position_acceptance"][:3], "lossless": r["lossless"],
                            "rounds": r["rounds"], "tokens": r["tokens_generated"],
                            "forwards_saved": r["forwards_saved"]})
            previous = trained
    load = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
    if args.json:
        print(json.dumps({"columns": columns, "load_average": load}, indent=2))
        return 0
    rows = [("minute", lambda c: f"{c['minute']:g}"), ("step", lambda c: f"{c['step']:,}"),
            ("loss (interval mean of the recorded gauge)", lambda c: f"{c['loss']:.2f}"),
            ("simulated tau (interval mean, training batches)", lambda c: f"{c['sim_tau']:.2f}"),
            ("**real tau** (held-out prompts)", lambda c: f"**{c['tau']:.2f}**"),
            ("acceptance of draft slots 1 / 2 / 3",
             lambda c: "/".join(f"{a:.2f}".lstrip("0") for a in c["acceptance"])),
            ("lossless (output == the target's own greedy decode)", lambda c: "yes" if c["lossless"] else "NO")]
    for name, cell in rows:
        print(f"| {name} | " + " | ".join(cell(c) for c in columns) + " |")
        if name == "minute":
            print("|---|" + "---|" * len(columns))
    last = columns[-1] if columns else None
    if last:
        print(f"\nlast checkpoint: {last['rounds']} rounds decoded {last['tokens']} tokens, "
              f"{last['forwards_saved']} target forwards saved")
    print(f"load average (1 min) before {load['before']}, after {load['after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
