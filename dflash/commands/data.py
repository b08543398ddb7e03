"""`dflash data prepare|regenerate|demo|cache`: the token store, target-written training data, and the offline
hidden-states cache."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash.commands import CliError

#: `dflash data cache --dtype` -> the torch dtype's name (torch is imported only when a command runs)
CACHE_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp8": "float8_e4m3fn"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    pr = sub.add_parser("prepare", help="tokenize a JSONL data set once into a token store that `dflash train "
                                        "--data DIR` memory-maps (a rerun resumes a stopped one)")
    pr.add_argument("--target", default="tiny", help="HF model directory or 'tiny': whose tokenizer and chat "
                    "template (only the tokenizer is loaded)")
    pr.add_argument("--data", required=True, help="input JSONL or 'demo'")
    pr.add_argument("--out", type=Path, default=None, help="store directory (default: beside the data, "
                    "<data>.dflash-store/<stamp>/, where `dflash train --data <data>` looks for it)")
    pr.add_argument("--max-seq-len", type=int, default=None, help="rows are kept up to this many tokens (default: "
                    "what `dflash train` uses on this machine); a run may cut shorter, never longer")
    pr.add_argument("--thinking", choices=["on", "off", "auto"], default="auto",
                    help="how 'messages' rows render reasoning (default auto: as each row has it)")
    pr.add_argument("--workers", type=int, default=None, help="processes encoding shards, each with one thread "
                    "(default: min(cores, 8); 0: this process)")
    pr.add_argument("--shard-rows", type=int, default=None, help="source lines per shard, the unit of resuming "
                    "(default 10000)")
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
    c = sub.add_parser("cache", help="write the target's hidden states in the vLLM/speculators offline layout "
                                     "(train from it with `dflash train --hidden-states DIR`)")
    c.add_argument("--target", required=True, help="HF model directory or 'tiny'")
    c.add_argument("--data", required=True, help="input JSONL or 'demo'")
    c.add_argument("--out", required=True, type=Path, help="cache directory (a rerun skips the files written)")
    c.add_argument("--max-samples", type=int, default=None, help="only the first N rows")
    c.add_argument("--max-seq-len", type=int, default=None, help="longest sample in tokens (default: what "
                   "`dflash train --target T` uses on this machine)")
    c.add_argument("--thinking", choices=["on", "off", "auto"], default="auto",
                   help="how 'messages' rows render reasoning, as `dflash train --thinking`")
    c.add_argument("--target-layer-ids", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   metavar="IDS", help="taps, the reference's ids (default: those a bare `dflash train "
                   "--target T` on this machine uses)")
    c.add_argument("--drafter-layers", type=int, default=None, help="one tap per drafter layer, spread evenly")
    c.add_argument("--batch-size", type=int, default=8)
    c.add_argument("--dtype", choices=sorted(CACHE_DTYPES), default=None,
                   help="what the files hold (default: the target's dtype); fp8: float8_e4m3fn with one float32 "
                   "scale per token, the layout of speculators' FP8 backend, a quarter of fp32's bytes")
    c.add_argument("--fp8-scales", choices=("token", "tap"), default="token",
                   help="with --dtype fp8: one scale per token over all layers (default: the shared layout "
                   "speculators writes), or per token and layer (dflash's own; speculators' reader reads it "
                   "too): early layers keep their precision beside the last ones' outliers (docs/cache.md)")
    c.add_argument("--device", default="cpu", help="cpu, cuda (under torchrun: each rank's own GPU), cuda:N")
    c.add_argument("--socket-dir", type=Path, default=None, help="where the telemetry socket goes (as `dflash train`)")
    c.add_argument("--no-telemetry", action="store_true", help="no telemetry socket for dflash-top and no "
                   "DIR/telemetry.jsonl")


def run(args: argparse.Namespace) -> int:
    from dflash.data import DataError, resolve_data
    from dflash.data.cache_format import CacheError
    from dflash.targets import TargetError, load_target
    from dflash.targets.hf import slow_kernel_note

    try:
        if args.action == "regenerate":
            data = resolve_data(args.data)
            target = load_target(args.target, device=args.device)
            if target.tokenizer is None:
                raise CliError(f"{args.target}: the target has no tokenizer; regeneration needs one")
            if note := slow_kernel_note(target.config):
                print(f"target {args.target}: {note}", file=sys.stderr)
            from dflash.data.regenerate import regenerate_file

            n = regenerate_file(target, data, args.out, args.max_new_tokens, args.batch_size, args.limit)
            print(f"wrote {n} rows to {args.out}")
        elif args.action == "cache":
            return _cache(args)
        elif args.action == "prepare":
            return _prepare(args)
        else:
            from dflash.data.demo import DEMO_PATH, build_demo

            n = build_demo(load_target("tiny"), args.out or DEMO_PATH, n=args.rows)
            print(f"wrote {n} demo rows to {args.out or DEMO_PATH}")
    except (DataError, TargetError, CacheError) as e:
        raise CliError(str(e)) from None
    return 0


def recipe_max_seq_len(target: str) -> int:
    """The length `dflash train --target T` runs at on this machine when nothing says otherwise."""
    from dflash.train.config import DataSettings
    from dflash.train.config.recipes import hardware_recipe

    recipe, _ = hardware_recipe(target)
    return recipe.get("max_seq_len", DataSettings().max_seq_len)


def _prepare(args: argparse.Namespace) -> int:
    """Tokenize --data into a store, in worker processes, resumably."""
    from dflash.data import resolve_data
    from dflash.data.prepare import DEFAULT_SHARD_ROWS, prepare, store_dir
    from dflash.data.store import Stamp

    for flag, value, least in (("--max-seq-len", args.max_seq_len, 1), ("--workers", args.workers, 0),
                               ("--shard-rows", args.shard_rows, 1)):
        if value is not None and value < least:
            raise CliError(f"{flag} must be at least {least}, got {value}")
    source = resolve_data(args.data)
    tokenizer = _tokenizer(args.target)
    limit = args.max_seq_len or recipe_max_seq_len(args.target)
    out = args.out or store_dir(source, Stamp.of(tokenizer, args.thinking, limit, source), None)
    prepare(source, tokenizer, out, max_seq_len=limit, thinking=args.thinking, workers=args.workers,
            shard_rows=args.shard_rows or DEFAULT_SHARD_ROWS, log=lambda line: print(line, flush=True))
    print(f"store: {out}; train with: dflash train --target {args.target} --data {out}")
    return 0


def _tokenizer(target: str):
    """The target's tokenizer alone (prepare needs no weights)."""
    if target == "tiny":
        from dflash.targets.tiny import TINY_DIR as where
    else:
        where = Path(target)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(where))
    except (OSError, ValueError) as e:
        raise CliError(f"{target}: no tokenizer loads from it ({str(e).splitlines()[0][:200]})") from None


def _cache(args: argparse.Namespace) -> int:
    """Rank 0 writes the token rows and the sidecar, every rank (RANK/WORLD_SIZE, as torchrun sets them)
    its share of the sample files; a telemetry socket lets dflash-top watch the forward and the writes."""
    import os

    import torch

    from dflash.data import Sample, resolve_data
    from dflash.data.cache_format import rows_ready, write_rows
    from dflash.data.cache_writer import meta_for, rank_share, write_cache
    from dflash.data.prepare import open_store
    from dflash.data.store import is_store
    from dflash.telemetry import ProfileStats
    from dflash.train.device.binding import bind_thread, resolve, thread_device
    from dflash.train.distributed import DistError, from_env, place_devices

    # intra-op threads as OMP_NUM_THREADS says (torch's default otherwise), set once, before any work
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    try:  # under torchrun: this rank's share of the rows, and a bare `cuda` is its own GPU
        dist = from_env()
        (device,), _ = place_devices([args.device], "cpu", dist, torch.cuda.device_count())
    except DistError as e:
        raise CliError(str(e)) from None
    rank, world = dist.rank, dist.world_size
    if args.max_samples is not None and args.max_samples < 1:
        raise CliError(f"--max-samples must be at least 1, got {args.max_samples}")
    if args.fp8_scales != "token" and args.dtype != "fp8":
        raise CliError("--fp8-scales is for FP8 files: give --dtype fp8 too")
    if not is_store(Path(args.data)):  # a typo in --data should not wait for the target to load
        resolve_data(args.data)
    bind_thread(thread_device(resolve(device)))  # never a context on GPU 0 for a rank on another GPU
    target = _cache_target(args, device)
    store = open_store(args.data, target.tokenizer, max_seq_len=args.max_seq_len or recipe_max_seq_len(args.target),
                       min_loss_tokens=1, thinking=args.thinking, run_dir=args.out)
    print(store.truncation.line(), flush=True)
    # the cache writer compares and saves the rows as lists: as many as it caches, copied out of the store
    samples = [Sample(s.input_ids.tolist(), s.loss_mask.tolist()) for s in
               (store[i] for i in range(min(len(store), args.max_samples or len(store))))]
    dtype = getattr(torch, CACHE_DTYPES[args.dtype]) if args.dtype else None
    meta = meta_for(target, args.target, len(samples), dtype)
    out: Path = args.out
    _check_out(out, meta, samples)
    if rank == 0:
        if not rows_ready(out):
            write_rows(out, samples)
        meta.write(out)
    share = rank_share(len(samples), None, world, rank)
    print(f"cache: {target.describe() if hasattr(target, 'describe') else args.target}; rows {share.start}.."
          f"{share.stop - 1} of {len(samples)} on rank {rank}/{world}; taps {target.layer_ids} "
          f"(engine ids {meta.aux_hidden_state_layer_ids} + final {target.num_layers}); {meta.dtype}", flush=True)
    stats = ProfileStats()
    server = None
    if not args.no_telemetry:
        from dflash.telemetry import TelemetryServer

        # recorded beside the cache (telemetry.jsonl, as a run directory has it): `dflash stats` reads it
        server = TelemetryServer(run=f"cache-{out.name}", stats=stats, run_dir=out, rank=rank, world_size=world,
                                 socket_dir=args.socket_dir, interval_s=0.5)
        server.start()
        print(f"telemetry: {server.path}", flush=True)
    try:
        report = write_cache(target, samples, out, share, stats, batch_size=args.batch_size,
                             log=lambda line: print(line, flush=True), dtype=dtype,
                             per_tap_scales=args.fp8_scales == "tap")
    finally:
        if server is not None:
            server.close()
    print(f"cache: wrote {report.written} files ({report.bytes / 1e9:.2f} GB) in {report.seconds:.1f}s, "
          f"skipped {report.skipped}; train with: dflash train --target {args.target} --hidden-states {out}")
    return 0


def _cache_target(args: argparse.Namespace, device: str):
    """The target whose states the cache holds, tapped where a bare `dflash train --target T` would tap
    it unless --target-layer-ids / --drafter-layers say otherwise."""
    from dflash.targets import load_target

    layer_ids, n_taps = args.target_layer_ids, args.drafter_layers
    if layer_ids is None and n_taps is None:
        from dflash.train.config.recipes import hardware_recipe

        recipe, _ = hardware_recipe(args.target)
        layer_ids, n_taps = recipe.get("target_layer_ids"), recipe.get("drafter_layers")
    target = load_target(args.target, device=device, layer_ids=layer_ids, num_draft_layers=n_taps or 5)
    if target.tokenizer is None:
        raise CliError(f"{args.target}: the target has no tokenizer; the cache needs one to read the data")
    return target


def _check_out(out: Path, meta, samples: list) -> None:
    """Refuse, in one line, an --out that holds the cache of another target, data or rows (a rerun of the
    same cache resumes it)."""
    from dflash.data.cache_format import CacheMeta, read_rows, rows_ready

    old = CacheMeta.read(out)
    if old is not None and old != meta:
        diff = [k for k, v in vars(meta).items() if getattr(old, k) != v and k != "dflash_version"]
        if diff:
            raise CliError(f"--out {out} holds a cache of another target or data ({', '.join(diff)} differ); "
                           "choose another --out or delete it")
    if rows_ready(out) and read_rows(out) != samples:
        raise CliError(f"--out {out} holds a cache of other data rows; choose another --out or delete it")
