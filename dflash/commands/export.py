"""`dflash export CKPT --out DIR`: a training checkpoint -> the reference (z-lab) drafter format; a DSpark
drafter in DeepSpec's (the default; with the target's embedding and LM head: --target), speculators' or
SpecForge's format (--format)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash.commands import CliError

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "keep": None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint file, run directory with *.pt checkpoints, or an export dir")
    p.add_argument("--out", required=True, help="directory to write config.json + model.safetensors into")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                   help="weight dtype (bf16 as the reference's released drafters; keep = as trained)")
    p.add_argument("--force", action="store_true", help="replace what --out already holds")
    p.add_argument("--format", choices=["deepspec", "speculators", "specforge"], default=None,
                   help="a DSpark drafter's format: deepspec (default; what vLLM and SGLang both load, carrying "
                   "the target's embedding and LM head: needs --target), speculators, or specforge")
    p.add_argument("--target", default=None, metavar="MODEL_DIR",
                   help="the target, whose embedding and LM head --format deepspec carries")


def run(args: argparse.Namespace) -> int:
    import torch

    from dflash.model.export import DrafterLoadError, export_drafter
    from dflash.model.loading import load_drafter
    from dflash.model.speculators_format import speculators_dir

    _check_out(Path(args.out).expanduser(), args.force)
    if speculators_dir(args.checkpoint) is not None:
        raise CliError(f"{args.checkpoint} is a speculators checkpoint, which names its verifier but not the "
                       "verifier's layer count (the reference format states it): start a run from it with "
                       "`dflash train --init-from` and export that run")
    try:
        drafter = load_drafter(args.checkpoint)
    except DrafterLoadError as e:
        raise CliError(str(e)) from e
    name = _DTYPES[args.dtype]
    try:
        out = export_drafter(drafter, args.out, getattr(torch, name) if name else None, args.format,
                             _target_tensors(args.target, drafter) if args.target else None)
    except OSError as e:
        raise CliError(f"cannot write {args.out}: {e.strerror or e}") from e
    except ValueError as e:
        raise CliError(str(e)) from None
    c = drafter.config
    print(f"exported {drafter.num_parameters() / 1e6:.2f}M-parameter drafter ({c.describe_layers()}, block "
          f"{c.block_size}, taps {c.target_layer_ids}, mask id {c.mask_token_id}) from {drafter.loaded_from} to {out}")
    return 0


def _check_out(out: Path, force: bool) -> None:
    """An export never lands silently on top of something: a drafter served from `out`, or files the
    user keeps there, are replaced only with --force."""
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} is a file; give a directory to write config.json + model.safetensors into")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not force:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise CliError(f"--out {out} already holds {shown}; give --force to replace the export there, "
                       "or another --out")


def _target_tensors(target: str, drafter) -> dict:
    """The target's embedding and LM head weights (what a DeepSpec file carries), checked against the
    drafter's shape."""
    from dflash.eval.speculative import check_compatible
    from dflash.targets import TargetError, load_target

    try:
        t = load_target(target, layer_ids=list(drafter.config.target_layer_ids))
        check_compatible(drafter, t)
    except (TargetError, ValueError) as e:
        raise CliError(f"--target {target}: {e}") from None
    return {"embed_tokens.weight": t.embed_tokens.weight.detach(), "lm_head.weight": t.lm_head.weight.detach()}
