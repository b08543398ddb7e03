"""`dflash data regenerate|demo`: target-written training data."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash.cli import CliError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    r = sub.add_parser("regenerate", help="rewrite the responses of a dataset with the target (greedy, batched)")
    r.add_argument("--target", required=True, help="HF model directory or 'tiny'")
    r.add_argument("--data", required=True, help="input JSONL (messages or prompt/response rows)")
    r.add_argument("--out", required=True, type=Path, help="output JSONL")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--limit", type=int, default=None, help="only the first N rows")
    r.add_argument("--device", default="cpu")
    d = sub.add_parser("demo", help="rebuild the shipped demo set (stdlib prompts answered by the tiny target)")
    d.add_argument("--out", type=Path, default=None)
    d.add_argument("--rows", type=int, default=2000)


def run(args: argparse.Namespace) -> int:
    from dflash.data import DataError, resolve_data
    from dflash.model.target import TargetError, load_target

    try:
        if args.action == "regenerate":
            data = resolve_data(args.data)
            target = load_target(args.target, device=args.device)
            if target.tokenizer is None:
                raise CliError(f"{args.target}: the target has no tokenizer; regeneration needs one")
            from dflash.data.regenerate import regenerate_file

            n = regenerate_file(target, data, args.out, args.max_new_tokens, args.batch_size, args.limit)
            print(f"wrote {n} rows to {args.out}")
        else:
            from dflash.data.demo import DEMO_PATH, build_demo

            n = build_demo(load_target("tiny"), args.out or DEMO_PATH, n=args.rows)
            print(f"wrote {n} demo rows to {args.out or DEMO_PATH}")
    except (DataError, TargetError) as e:
        raise CliError(str(e)) from None
    return 0
