"""`dflash train`: flags override the TOML config, which overrides the built-in recipe defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash.commands import CliError


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--config", type=Path, help="TOML file with training settings: keys as in config.json of a "
                                       "run, at the top level or in section tables ([optim] lr = 3e-3)")
    a("--resume", action="store_true", help="continue from the newest checkpoint in the run dir")
    a("--nproc", type=int, help="train with N ranks on this machine (runs torchrun; each rank one pipeline "
                                 "replica, drafters in DDP)")
    from dflash.train.config.schema import add_flags

    add_flags(p)  # every setting's flag, derived from the section classes (dflash/train/config/__init__.py)


def run(args: argparse.Namespace) -> int:
    from dflash.train.config import ConfigError
    from dflash.train.config.recipes import fresh_run_dir, hardware_recipe
    from dflash.train.config.schema import config_beside, flag_values, load_toml, make_config, resumed
    from dflash.train.trainer import train

    if args.resume and args.run_dir is None:
        raise CliError("--resume needs --run-dir: the run directory to continue")
    if args.nproc is not None:
        # every rank must write to one directory: name the fresh one here, once, for all of them
        extra = [] if args.run_dir is not None or _run_dir_in(args.config) else ["--run-dir", fresh_run_dir()]
        return launch(args.nproc, args.argv + extra)
    overrides = flag_values(args)
    try:
        file_values = load_toml(args.config) if args.config else {}
        saved = config_beside(args.run_dir) if args.resume else None
    except ConfigError as e:
        raise CliError(str(e)) from None
    recipe = None
    if args.config is None:  # no recipe given: the one this machine can run
        recipe, line = hardware_recipe(args.target)
        if args.hidden_states is not None:
            recipe.pop("target_layer_ids", None)  # a cache's taps are what it holds (its sidecar says)
        if saved is None:  # a resumed run takes only its placement from the recipe
            print(f"dflash train: {line}", flush=True)
    try:
        cfg = make_config(file_values, overrides, recipe, file=str(args.config or 'config file'))
        if saved is not None:
            where = str(Path(args.run_dir) / "config.json")
            given = set(file_values) | {name for name, value in overrides.items() if value is not None}
            cfg, changes = resumed(saved, cfg, given, where)
            print(f"dflash train: --resume: the settings of {where}"
                  + (f"; changed: {', '.join(changes)}" if changes else ""), flush=True)
    except ConfigError as e:
        raise CliError(str(e)) from None
    return train(cfg, resume=args.resume)


def _run_dir_in(config) -> bool:
    from dflash.train.config import ConfigError
    from dflash.train.config.schema import load_toml

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
