"""Record the stacks of a real trainer for the stage rules' tests (tests/fixtures/stacks/<name>/).

    python scripts/record_stacks.py dflash [--seconds 20] [--rate 100]
    python scripts/record_stacks.py speculators --speculators-python /tmp/spec/bin/python

`dflash`: `dflash train` on configs/tiny-cpu.toml (no checkpoints or evaluation in the window), sampled
from outside exactly as `dflash-top --pid` samples (py-spy records of every thread and of the GIL
holder) once its steps are steady; beside the stacks, the run's own telemetry over the same seconds
(the measured shares the sampled ones are checked against). `speculators`: speculators' DFlash trainer
on the CPU (scripts/speculators_cpu.py) training from a hidden-states cache `dflash data cache` wrote,
its Python being that of an environment where `pip install speculators` installed.

Writes threads.speedscope.json.gz, gil.speedscope.json.gz, meta.json (and telemetry.jsonl.gz for dflash).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash.telemetry.wire.protocol import Hello, Snapshot, decode, encode
from dflash_tui.pyspy import find_pyspy, record_args, start_pyspy, wait_pyspy

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "stacks"


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise SystemExit(f"the trainer exited (code {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


def record(pid: int, seconds: int, rate: int, out: Path) -> tuple[float, float]:
    """Both records of `pid` side by side, as the sampled source takes them; (start, end) unix times."""
    exe = find_pyspy()
    if exe is None:
        raise SystemExit("py-spy is not installed")
    t0 = time.time()
    procs = [start_pyspy(exe, record_args(pid, seconds, out / "threads.speedscope.json", rate=rate, idle=True)),
             start_pyspy(exe, record_args(pid, seconds, out / "gil.speedscope.json", rate=rate, gil=True))]
    for p in procs:
        rc, _, err = wait_pyspy(p, seconds + 60)
        if rc != 0:
            raise SystemExit(f"py-spy record failed: {err.strip()[-500:]}")
    t1 = time.time()
    for name in ("threads", "gil"):
        raw = (out / f"{name}.speedscope.json").read_bytes()
        (out / f"{name}.speedscope.json.gz").write_bytes(gzip.compress(raw, mtime=0))
        (out / f"{name}.speedscope.json").unlink()
    return t0, t1


def stop(proc: subprocess.Popen) -> None:
    """A trainer asked to stop as a user would (SIGTERM: it checkpoints and exits), killed if it will not."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def snapshots(path: Path) -> list:
    """The frames of a recording still being written (a line cut short is skipped)."""
    frames = []
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                frames.append(decode(line))
            except ValueError:
                continue  # a line being written
    return frames


def record_dflash(out: Path, seconds: int, rate: int) -> dict:
    run = Path(tempfile.mkdtemp(prefix="record-stacks-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the recipe's one thread per worker, as `make train`
    cmd = [sys.executable, "-m", "dflash", "train", "--config", str(REPO / "configs" / "tiny-cpu.toml"),
           "--run-dir", str(run / "run"), "--max-time", str(seconds + 240), "--checkpoint-every", "100000",
           "--eval-prompts", "0", "--socket-dir", str(run / "s")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    telemetry = run / "run" / "telemetry.jsonl"
    try:
        # steady: a few steps in, past the first windows' start-up
        wait_for(lambda: any(isinstance(f, Snapshot) and f.counters.get("steps", 0) >= 10
                             for f in snapshots(telemetry)), 600, "10 training steps", proc)
        t0, t1 = record(proc.pid, seconds, rate, out)
        wait_for(lambda: any(isinstance(f, Snapshot) and f.t > t1 + 1 for f in snapshots(telemetry)), 60,
                 "the telemetry past the recording", proc)
    finally:
        stop(proc)
    kept = [f for f in snapshots(telemetry)
            if isinstance(f, Hello) or (isinstance(f, Snapshot) and t0 - 2 <= f.t <= t1 + 2)]
    (out / "telemetry.jsonl.gz").write_bytes(gzip.compress(b"".join(encode(f) for f in kept), mtime=0))
    shutil.rmtree(run, ignore_errors=True)
    return {"trainer": "dflash train --config configs/tiny-cpu.toml (checkpoints and evaluation off)", "t0": t0,
            "t1": t1}


def record_speculators(out: Path, seconds: int, rate: int, python: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix="record-stacks-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "dflash", "data", "cache", "--target", "tiny", "--data", "demo", "--out",
                    str(work / "cache"), "--max-samples", "64", "--target-layer-ids", "1,3,5", "--no-telemetry"],
                   cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    # speculators reads the rows as tensors: its prepare_data saves them with set_format("torch")
    subprocess.run([python, "-c", "import sys; from datasets import load_from_disk; d = load_from_disk(sys.argv[1]); "
                    "d.set_format(type='torch'); d.save_to_disk(sys.argv[2])", str(work / "cache"),
                    str(work / "rows")], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tiny = REPO / "dflash" / "targets" / "tiny"
    log = work / "train.log"
    cmd = [python, str(REPO / "scripts" / "speculators_cpu.py"), "--speculator-type", "dflash",
           "--verifier-name-or-path", str(tiny), "--data-path", str(work / "rows"), "--hidden-states-path",
           str(work / "cache" / "hidden_states"), "--num-layers", "1", "--target-layer-ids", "2", "4", "6",
           "--draft-attn-impl", "sdpa", "--epochs", "1", "--max-steps", "1000", "--save-path", str(work / "out"),
           "--log-freq", "5", "--total-seq-len", "512", "--block-size", "8", "--max-anchors", "16",
           "--num-workers", "1", "--hidden-states-dtype", "float32", "--loss-implementation", "eager"]
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: b"train/loss" in log.read_bytes(), 900, "speculators' first logged step", proc)
        t0, t1 = record(proc.pid, seconds, rate, out)
    finally:
        stop(proc)
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('speculators'))"],
                             capture_output=True, text=True).stdout.strip()
    shutil.rmtree(work, ignore_errors=True)
    return {"trainer": f"speculators {version} train --speculator-type dflash on the CPU (scripts/speculators_cpu.py)",
            "t0": t0, "t1": t1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trainer", choices=("dflash", "speculators"))
    p.add_argument("--seconds", type=int, default=20)
    p.add_argument("--rate", type=int, default=100)
    p.add_argument("--speculators-python", default=None, help="the Python of an environment with speculators")
    p.add_argument("--out", type=Path, default=None, help="default tests/fixtures/stacks/<trainer>")
    args = p.parse_args()
    out = args.out or FIXTURES / {"dflash": "dflash-train", "speculators": "speculators-dflash"}[args.trainer]
    out.mkdir(parents=True, exist_ok=True)
    if args.trainer == "dflash":
        meta = record_dflash(out, args.seconds, args.rate)
    else:
        if not args.speculators_python:
            raise SystemExit("speculators: pass --speculators-python (pip install speculators in a throwaway venv)")
        meta = record_speculators(out, args.seconds, args.rate, args.speculators_python)
    meta.update({"rate_hz": args.rate, "seconds": args.seconds, "recorded": time.strftime("%Y-%m-%d"),
                 "load1": round(os.getloadavg()[0], 2), "cores": os.cpu_count()})
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {out}: " + ", ".join(f"{f.name} {f.stat().st_size // 1024} KB" for f in sorted(out.iterdir())))


if __name__ == "__main__":
    main()
