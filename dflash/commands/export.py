"""`dflash export CKPT --out DIR`: a training checkpoint -> the reference (z-lab) drafter format (a DSpark
drafter: DeepSpec's, the default, carrying the target's embedding and LM head, or speculators' or
SpecForge's: --format), checked against what vLLM and SGLang make of it; `dflash export --check
vllm|sglang|all DIR` checks an export."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash.commands import CliError

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "keep": None}
_CHECKS = ("vllm", "sglang", "all")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="checkpoint file, run directory with *.pt checkpoints, or an export dir "
                   "(with --check: the export directory to check)")
    p.add_argument("--out", help="directory to write config.json + model.safetensors into")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                   help="weight dtype (bf16 as the reference's released drafters; keep = as trained)")
    p.add_argument("--force", action="store_true", help="replace what --out already holds")
    p.add_argument("--check", choices=_CHECKS, default=None,
                   help="check an existing export against this engine's loader instead of exporting")
    p.add_argument("--trained", default=None, help="with --check: the checkpoint or run the export was made "
                   "from, the truth it is held against (default: the export's config.json as dflash reads it)")
    p.add_argument("--format", choices=["deepspec", "speculators", "specforge"], default=None,
                   help="a DSpark drafter's format: deepspec (default; what vLLM and SGLang both load, carrying "
                   "the target's embedding and LM head: needs --target), speculators, or specforge")
    p.add_argument("--target", default=None, metavar="MODEL_DIR",
                   help="the target: whose embedding and LM head --format deepspec carries, and the model the "
                   "printed serve commands name (default there: the one the drafter's run trained against)")


def run(args: argparse.Namespace) -> int:
    if args.check is not None:
        return _check_only(args)
    if args.out is None:
        raise CliError("give --out DIR to export into, or --check vllm|sglang|all to check an existing export")
    if args.trained is not None:
        raise CliError("--trained goes with --check (an export is checked against its own checkpoint)")
    import torch

    from dflash.model.export import DrafterLoadError, read_config_json
    from dflash.model.loading import load_drafter
    from dflash.model.speculators_format import speculators_dir
    from dflash.model.write_export import export_drafter

    _check_out(Path(args.out).expanduser(), args.force)
    if speculators_dir(args.checkpoint) is not None:
        raise CliError(f"{args.checkpoint} is a speculators checkpoint, which names its verifier but not the "
                       "verifier's layer count (the reference format states it): start a run from it with "
                       "`dflash train --init-from` and export that run")
    try:
        drafter = load_drafter(args.checkpoint)
    except DrafterLoadError as e:
        raise CliError(str(e)) from e
    from dflash.model import dspark_formats
    from dflash.model.dspark import DSparkConfig

    name = _DTYPES[args.dtype]
    dspark = isinstance(drafter.config, DSparkConfig)
    # only a DeepSpec file carries the target's tensors: elsewhere --target just names the served model
    carries = dspark and (args.format or dspark_formats.DEFAULT_FORMAT) == dspark_formats.DEEPSPEC
    try:
        out = export_drafter(drafter, args.out, getattr(torch, name) if name else None, args.format,
                             _target_tensors(args.target, drafter) if args.target and carries else None)
    except OSError as e:
        raise CliError(f"cannot write {args.out}: {e.strerror or e}") from e
    except ValueError as e:
        raise CliError(str(e)) from None
    c = drafter.config
    print(f"exported {drafter.num_parameters() / 1e6:.2f}M-parameter drafter ({c.describe_layers()}, block "
          f"{c.block_size}, taps {c.target_layer_ids}, mask id {c.mask_token_id}) from {drafter.loaded_from} to {out}")
    if dspark:
        fmt = args.format or dspark_formats.DEFAULT_FORMAT
        # each format is checked against the engines that load it; the other is said in a line, not failed
        engines, note = {dspark_formats.SPECULATORS: (("vllm",), "SGLang refuses the speculators convention "
                                                      "(slot j predicts anchor + j): --format deepspec for it"),
                         dspark_formats.SPECFORGE: (("sglang",), "vLLM reads DSpark's settings from the top level, "
                                                    "not dflash_config: --format deepspec for it")}.get(
            fmt, (("vllm", "sglang"), None))
        if note:
            print(f"engine check: {note}")
        return _report_dspark(read_config_json(out), c, engines)
    return _report(read_config_json(out), c, ("vllm", "sglang"), out, _target_of(args))


def _check_only(args: argparse.Namespace) -> int:
    """--check: resolve an existing export as the engine(s) would, against --trained or dflash's own
    reading of it."""
    from dflash.model.export import CONFIG_NAME, DrafterLoadError, config_from_hf, read_config_json
    from dflash.model.loading import load_drafter

    if args.out is not None:
        raise CliError("--check reads an existing export and writes nothing: drop --out")
    where = Path(args.checkpoint).expanduser()
    if not (where / CONFIG_NAME).is_file():
        raise CliError(f"{where} holds no {CONFIG_NAME}: give the export directory to check")
    try:
        d = read_config_json(where)
        if args.trained:
            trained = load_drafter(args.trained).config
        else:
            from dflash.model import dspark_formats

            trained = dspark_formats.read_config(d) if dspark_formats.is_dspark_config(d) else config_from_hf(d)
    except (DrafterLoadError, KeyError, ValueError, TypeError) as e:
        raise CliError(f"{args.trained or where}: {e}") from None
    engines = ("vllm", "sglang") if args.check == "all" else (args.check,)
    source = args.trained or f"{where} as dflash reads it"
    print(f"checking {where} against {source}")
    from dflash.model.dspark import DSparkConfig

    if isinstance(trained, DSparkConfig):
        return _report_dspark(d, trained, engines)
    return _report(d, trained, engines, where, _target_of(args))


def _report(d: dict, trained, engines: tuple[str, ...], out: Path, target: str) -> int:
    """One line per disagreement (stderr), then the commands that serve the export; 1 where any
    engine would read it otherwise than it trained."""
    from dflash.eval.engine_contracts import check_config, launch_needs, serve_commands

    problems = check_config(d, trained, engines)
    for p in problems:
        print(f"dflash export: MISMATCH {p}", file=sys.stderr)
    if not problems:
        print(f"engine check: {' and '.join(engines)} read it as trained (tap layers, block, layer attention, "
              "mask token" + (", DFlash2 settings" if "dflash_config" in d and "selector_rank" in d["dflash_config"]
                              else "") + ")")
    commands = serve_commands(out, trained, target, d)
    for e in engines:
        for need in launch_needs(d, e):
            print(f"{e} needs {need}")
        print(f"serve with {e}: {commands[e]}")
    return 1 if problems else 0


def _report_dspark(d: dict, trained, engines: tuple[str, ...]) -> int:
    """A DSpark export: one line per key an engine reads otherwise than the drafter trained, heads and
    backbone (stderr); 1 where any does."""
    from dflash.eval.engine_contracts import check_dspark

    problems = check_dspark(d, trained, engines)
    for p in problems:
        print(f"dflash export: MISMATCH {p}", file=sys.stderr)
    for e in engines:
        if not any(p.engine == e for p in problems):
            print(f"engine check: {e} reads the DSpark drafter as trained (markov_rank, draft vocabulary, confidence "
                  "head and its Markov input, no Markov top-k; tap layers, " + ("" if e == "vllm" else "block, ")
                  + "layer attention, mask token)")
    return 1 if problems else 0


def _target_of(args: argparse.Namespace) -> str:
    """--target, else the target of the drafter's run where there is one, else a placeholder."""
    if args.target:
        return args.target
    from dflash.train.config import ConfigError
    from dflash.train.config.schema import config_beside

    try:
        cfg = config_beside(args.trained or args.checkpoint)
    except ConfigError:
        cfg = None
    return cfg.run.target if cfg is not None else "TARGET_MODEL"


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
