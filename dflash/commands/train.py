"""`dflash train`: flags override the TOML config, which overrides the built-in recipe defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash.cli import CliError


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--config", type=Path, help="TOML file with training settings (keys as in config.json of a run)")
    a("--target", help="HF model directory or 'tiny' (the built-in target)")
    a("--data", help="JSONL dataset or 'demo'")
    a("--run-dir", help="where checkpoints, config.json and telemetry.jsonl go (default: a fresh "
                        "runs/train-<date>-<time>)")
    a("--max-steps", type=int)
    a("--max-time", type=float, help="stop after this many seconds of training")
    a("--epochs", type=float, help="passes over the data (default 1 when no step or time limit is given)")
    a("--resume", action="store_true", help="continue from the newest checkpoint in the run dir")
    a("--no-telemetry", dest="telemetry", action="store_false", default=None, help="turn telemetry off entirely")
    a("--telemetry-interval", type=float, help="seconds between telemetry snapshots (default 1)")
    a("--log-every", type=float, help="seconds between log lines (default 10)")
    a("--target-devices", help="comma-separated, one target worker each: cpu, cuda:0,cuda:1, ...")
    a("--drafter-device", help="cpu or cuda:N")
    a("--pipeline", choices=["on", "off"], help="off: target forward then drafter step in one loop")
    a("--batch-size", type=int)
    a("--lr", type=float)
    a("--drafter-layers", type=int)
    a("--init-from-target", action="store_true", default=None,
      help="start the drafter's layers as copies of the target's top layers")
    a("--block-size", type=int)
    a("--num-anchors", type=int)
    a("--max-seq-len", type=int)
    a("--threads-per-worker", type=int, help="torch intra-op threads per worker thread")
    a("--checkpoint-every", type=float, help="seconds between checkpoints")
    a("--keep-checkpoints", type=int, help="newest checkpoints kept (default 3; older ones go first when disk is short)")
    a("--eval-every", type=float, help="seconds between in-training evaluations (0: only at the end)")
    a("--eval-prompts", type=int, help="prompts in each evaluation (0: none)")
    a("--socket-dir", help="directory for the telemetry socket")
    a("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: any free port)")
    a("--metrics-addr", help="address for --metrics-port (default 127.0.0.1; 0.0.0.0 for remote Prometheus)")
    a("--metrics-linger", type=float, help="with --metrics-port: seconds to keep serving after the run, until "
                                          "Prometheus has scraped its last numbers (default 30; 0: exit at once)")
    a("--report-to", metavar="TRACKERS", help="experiment trackers, comma-separated: tensorboard, wandb, mlflow "
                                               "(default none; each an optional extra)")
    a("--seed", type=int)
    a("--nproc", type=int, help="train with N ranks on this machine (runs torchrun; each rank one pipeline "
                                 "replica, drafters in DDP)")
    a("--collective-timeout", type=float, help="multi-rank: seconds a collective may wait for a rank (default 300)")
    a("--stall-timeout", type=float, help="seconds without a completed span before a worker counts as stalled "
                                          "(default: from its own history, at least 30; 0: no watchdog)")
    a("--on-stall", choices=["warn", "exit"], help="exit: checkpoint the last completed step and exit 3 so a "
                                                   "scheduler can restart the job (default warn)")
    a("--no-gil-probe", dest="gil_probe", action="store_false", default=None,
      help="turn off the GIL contention gauge (its probe thread takes the GIL 200 times a second)")
    a("--nonfinite-limit", type=int, help="non-finite steps in a row (each skipped) that stop the run (default 3)")


def run(args: argparse.Namespace) -> int:
    from dflash.train.config import ConfigError, fresh_run_dir, hardware_recipe, load_toml, make_config
    from dflash.train.trainer import train

    if args.resume and args.run_dir is None:
        raise CliError("--resume needs --run-dir: the run directory to continue")
    if args.nproc is not None:
        # every rank must write to one directory: name the fresh one here, once, for all of them
        extra = [] if args.run_dir is not None or _run_dir_in(args.config) else ["--run-dir", fresh_run_dir()]
        return launch(args.nproc, args.argv + extra)
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config", "resume", "nproc", "argv")}
    if args.pipeline is not None:
        overrides["pipeline"] = args.pipeline == "on"
    recipe = None
    if args.config is None:  # no recipe given: the one this machine can run
        recipe, line = hardware_recipe(args.target)
        print(f"dflash train: {line}", flush=True)
    try:
        cfg = make_config(load_toml(args.config) if args.config else {}, overrides, recipe)
    except ConfigError as e:
        raise CliError(str(e)) from None
    return train(cfg, resume=args.resume)


def _run_dir_in(config) -> bool:
    from dflash.train.config import ConfigError, load_toml

    try:
        return config is not None and "run_dir" in load_toml(config)
    except ConfigError:
        return False  # the ranks will report the bad file themselves


def launch(nproc: int, argv: list[str]) -> int:
    """`--nproc N`: hand this same command line, minus --nproc, to torchrun on this machine. exec, not
    a child, so Ctrl-C and SIGTERM reach torchrun, which forwards them to every rank."""
    import os
    import sys

    if nproc < 1:
        raise CliError(f"--nproc must be at least 1, got {nproc}")
    if "LOCAL_RANK" in os.environ:
        raise CliError("--nproc inside a torchrun worker: launch either with torchrun or with --nproc, not both")
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dflash", *rest]
    print("dflash train: " + " ".join(cmd[1:]), flush=True)
    os.execv(sys.executable, cmd)
    return 0  # not reached
