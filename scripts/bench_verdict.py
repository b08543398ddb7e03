"""Verdict stability on a real training run: how often the published verdict changes, and whether it
ever contradicts its own evidence.

    python scripts/bench_verdict.py [--json] [--quick] [--seconds 120]

Runs `dflash train` on configs/tiny-cpu.toml (the `make train` recipe, telemetry every second, no
evaluation) as a subprocess with OMP_NUM_THREADS=1, then reads its recording. Over the steady part (the
first 10 s of windows left out) it counts changes of the published verdict per 100 windows, the changes
a one-window judgement would have made (analyze() on each window alone) for comparison, and the
published verdicts whose evidence says otherwise (analysis.agrees_with_evidence). The goal: <= 2
changes per 100 windows, none contradicting its evidence, on a quiet machine. `--quick`: a 6 s run
with a window every 0.25 s and 1.5 s of warm-up, that proves the script works (its figures mean little).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _bench import ForeignLoad, bench_parser, print_report

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

#: windows left out at the start: the span fills and the pipeline warms up
WARMUP_S = 10.0


def changes(verdicts: list[str]) -> int:
    return sum(a != b for a, b in zip(verdicts, verdicts[1:], strict=False))


def train(run_dir: Path, seconds: float, interval_s: float = 1.0) -> Path:
    """A real training run of `seconds`, a telemetry window every `interval_s`; its recording."""
    cmd = [sys.executable, "-m", "dflash", "train", "--config", str(REPO / "configs" / "tiny-cpu.toml"),
           "--run-dir", str(run_dir), "--max-time", str(seconds), "--eval-prompts", "0",
           "--telemetry-interval", str(interval_s), "--socket-dir", str(run_dir.parent / "sockets")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode != 0:
        raise SystemExit(f"bench_verdict: the training run failed:\n{r.stderr[-2000:]}")
    return run_dir / "telemetry.jsonl"


def measure(recording: Path, warmup_s: float = WARMUP_S) -> dict:
    from dflash.telemetry.verdict.evidence import agrees_with_evidence, analyze
    from dflash.telemetry.wire.protocol import Snapshot
    from dflash.telemetry.wire.reader import read_frames

    snaps = [f for f in read_frames(recording) if isinstance(f, Snapshot) and f.bottleneck is not None]
    if len(snaps) < 3:
        raise SystemExit(f"bench_verdict: only {len(snaps)} snapshots in {recording}")
    last = snaps[-1]  # the whole run's verdict, judged at the end
    start = snaps[0].t + warmup_s
    steady = [s for s in snaps[:-1] if s.t >= start]
    published = [s.bottleneck.verdict for s in steady]
    one_window = [analyze(s.workers, s.roles).verdict for s in steady]
    wrong = [s.bottleneck for s in steady if not agrees_with_evidence(s.bottleneck)]
    per100 = 100.0 / len(steady) if steady else 0.0
    return {
        "windows": len(steady),
        "verdict_changes_per_100_windows": round(changes(published) * per100, 2),
        "one_window_changes_per_100_windows": round(changes(one_window) * per100, 2),
        "contradicting_evidence": len(wrong),
        "verdicts": {v: published.count(v) for v in dict.fromkeys(published)},
        "scope_of_last_window": steady[-1].bottleneck.scope if steady else "",
        "whole_run_verdict": f"{last.bottleneck.verdict} ({last.bottleneck.scope})",
        "goal_met": bool(steady) and changes(published) * per100 <= 2.0 and not wrong,
    }


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a 6 s run: proves the script works")
    p.add_argument("--seconds", type=float, default=120.0, help="length of the training run")
    args = p.parse_args()
    seconds, interval_s, warmup_s = (6.0, 0.25, 1.5) if args.quick else (args.seconds, 1.0, WARMUP_S)
    with tempfile.TemporaryDirectory() as d, ForeignLoad() as load:
        report = {"train_seconds": seconds,
                  **measure(train(Path(d) / "run", seconds, interval_s), warmup_s)}
    report["foreign_load_cores"] = round(load.cores, 2)
    report["busy_machine"] = load.cores > 0.5
    print_report(report, args.json)


if __name__ == "__main__":
    main()
