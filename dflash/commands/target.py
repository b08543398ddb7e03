"""`dflash target build-tiny`: (re)build the built-in tiny target from the standard library's source."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    b = sub.add_parser("build-tiny", help="train the tiny Qwen3 target on the stdlib source (fixed seed)")
    b.add_argument("--out", type=Path, default=None, help="output dir (default: the package's shipped copy)")
    b.add_argument("--max-time", type=float, default=None, help="stop training after this many seconds")
    b.add_argument("--steps", type=int, default=None, help="optimizer steps (the cosine schedule spans them)")
    b.add_argument("--from", dest="src", type=Path, default=None,
                   help="skip phase 1 (maximum likelihood): refine this already-built tiny model with phase 2")
    b.add_argument("--ul-steps", type=int, default=None, help="phase 2 (unlikelihood) updates; 0 skips it")


def run(args: argparse.Namespace) -> int:
    from dflash.commands import CliError
    from dflash.targets.tiny import TINY_DIR
    from dflash.targets.tiny_build import TinyRecipe, build_tiny, refine_tiny

    recipe = TinyRecipe()
    if args.max_time is not None:
        recipe.max_time_s = args.max_time
    if args.steps is not None:
        recipe.steps = args.steps
    if args.ul_steps is not None:
        recipe.ul_steps = args.ul_steps
    out = args.out or TINY_DIR
    log = lambda s: print(s, flush=True)  # noqa: E731
    if args.src is not None:
        if not (args.src / "config.json").is_file():
            raise CliError(f"--from {args.src}: not a model directory (no config.json)")
        info = refine_tiny(args.src, out, recipe, log=log)
    else:
        info = build_tiny(out, recipe, log=log)
    print(json.dumps(info, indent=2))
    return 0
