"""`dflash data prepare|regenerate|demo|cache`: the token store, target-written training data, and the offline
hidden-states cache."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from dflash.commands import CliError

#: `dflash data regenerate --reasoning` (dflash/data/regenerate.py has the meanings)
REASONING_MODES = ("keep", "drop", "off")
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
    r = sub.add_parser("regenerate", help="rewrite a data set's responses with the target: through OpenAI-compatible "
                       "servers (--endpoint: vLLM, SGLang, transformers serve) or in this process; resumable")
    r.add_argument("--target", required=True, help="HF model directory or 'tiny': its tokenizer and chat template "
                   "(checked against the servers'), and its generation_config.json (the default sampling)")
    r.add_argument("--data", required=True, help="input JSONL (messages or prompt/response rows) or 'demo'")
    r.add_argument("--out", required=True, type=Path, help="output JSONL, appended row by row (errors beside it "
                   "in OUT.errors.jsonl)")
    r.add_argument("--endpoint", default=None, metavar="URL[,URL...]", help="OpenAI-compatible servers "
                   "(http://host:8000 or .../v1); without: the target runs in this process")
    r.add_argument("--model", default=None, help="the served model's name (default: the servers' only model)")
    r.add_argument("--api-key-env", default="OPENAI_API_KEY", metavar="VAR",
                   help="environment variable holding the servers' API key, if they want one")
    r.add_argument("--concurrency", type=int, default=64, help="requests in flight over all endpoints (default 64)")
    r.add_argument("--sampling", default=None, metavar="JSON", help='request fields, e.g. \'{"temperature": 0.6, '
                   '"top_p": 0.95}\' (default: the target\'s generation_config.json; greedy where it does not sample)')
    r.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=2048,
                   help="longest answer per turn (default 2048); rows it cut are marked and counted")
    r.add_argument("--reasoning", choices=REASONING_MODES, default="keep", help="keep the target's reasoning in "
                   "the response (default), drop it, or ask for none (off: enable_thinking=False)")
    r.add_argument("--resume", action="store_true", help="finish a job: rows in --out are done, failed ones retried")
    r.add_argument("--shard", default=None, metavar="K/N", help="only the K-th (from 0) of N contiguous parts of "
                   "the data (one job per node; `dflash data merge` joins them)")
    r.add_argument("--limit", type=int, default=None, help="only the first N lines")
    r.add_argument("--retries", type=int, default=5, help="tries after the first for a request that failed in a "
                   "way worth retrying (408/409/425/429/5xx, lost connections); default 5")
    r.add_argument("--backoff", type=float, default=1.0, metavar="S", help="first retry's wait, doubled each time")
    r.add_argument("--timeout", type=float, default=600.0, metavar="S", help="longest a request may take")
    r.add_argument("--wait-for-server", type=float, default=600.0, metavar="S", help="how long to wait for a server "
                   "that is still starting (not listening yet, or answering 503) before giving up; default 600, "
                   "as vLLM loads a large model for minutes; 0: not at all")
    r.add_argument("--batch-size", type=int, default=32, help="in this process: prompts generated together")
    r.add_argument("--device", default=None, help="in this process: cpu, cuda, cuda:N (default: cuda when there "
                   "is one)")
    r.add_argument("--log-every", type=float, default=10.0, metavar="S", help="seconds between progress lines")
    r.add_argument("--socket-dir", type=Path, default=None, help="where the telemetry socket goes (as `dflash train`)")
    r.add_argument("--no-telemetry", action="store_true", help="no telemetry socket for dflash-top")
    m = sub.add_parser("merge", help="join the outputs of `dflash data regenerate --shard K/N` jobs")
    m.add_argument("parts", nargs="+", type=Path, help="the parts' output files")
    m.add_argument("--out", required=True, type=Path)
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
    from dflash.data import DataError
    from dflash.data.cache_format import CacheError
    from dflash.targets import TargetError, load_target

    try:
        if args.action == "regenerate":
            return _regenerate(args)
        if args.action == "merge":
            from dflash.data.regen_output import merge

            n = merge(args.parts, args.out)
            print(f"merged {n} rows from {len(args.parts)} parts into {args.out}")
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


def _regenerate(args: argparse.Namespace) -> int:
    """Check what can be checked before anything is written (the data, the shard, the servers), then answer
    the rows not yet done, appending each as it completes."""
    import json
    import os

    from dflash.data import resolve_data
    from dflash.data.regen_output import RegenOutput
    from dflash.data.regenerate import parse_shard, prepare_thinking, sampling_defaults, settings_of, shard_lines

    for flag, value, least in (("--concurrency", args.concurrency, 1), ("--max-tokens", args.max_tokens, 1),
                               ("--retries", args.retries, 0), ("--batch-size", args.batch_size, 1),
                               ("--limit", args.limit, 1), ("--wait-for-server", args.wait_for_server, 0)):
        if value is not None and value < least:
            raise CliError(f"{flag} must be at least {least}, got {value}")
    data = resolve_data(args.data)
    lines = shard_lines(data, parse_shard(args.shard), args.limit)
    sampling = None
    if args.sampling is not None:
        try:
            sampling = json.loads(args.sampling)
        except json.JSONDecodeError as e:
            raise CliError(f"--sampling: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(sampling, dict):
            raise CliError("--sampling: expected a JSON object of request fields")
    tokenizer = _tokenizer(args.target)
    target_dir = _target_dir(args.target)
    log = lambda line: print(line, flush=True)  # noqa: E731
    if args.endpoint:
        import asyncio

        from dflash.data.regen_server import ServerJob

        urls = [u for u in args.endpoint.split(",") if u.strip()]
        job = ServerJob(urls, tokenizer, args.target, args.model, args.reasoning, args.concurrency, args.max_tokens,
                        retries=args.retries, backoff_s=args.backoff, api_key=os.environ.get(args.api_key_env),
                        timeout_s=args.timeout, log=log, log_every_s=args.log_every,
                        wait_for_server_s=args.wait_for_server)
        asyncio.run(job.connect())
        if sampling is None:
            sampling, left = sampling_defaults(target_dir, extras=job.token_ids)
            if left:
                log(f"sampling: {', '.join(left)} from generation_config.json left out (the server takes only "
                    "OpenAI's fields; give them in --sampling where it takes them)")
        job.sampling = sampling
        log(f"regenerate: {len(urls)} endpoint(s), model {job.model}, {args.concurrency} in flight, sampling "
            f"{json.dumps(sampling)}, token ids {'kept' if job.token_ids else 'not returned by the server'}")
        output = RegenOutput(args.out, settings_of(args, job.model, sampling), args.resume)
        with _regen_telemetry(args, job.stats, "regen-client"):
            asyncio.run(job.run(data, lines, output))
    else:
        output = _regenerate_here(args, data, lines, sampling or sampling_defaults(target_dir, True)[0], log)
    output.finish()
    if output.failed:
        print(f"regenerate: {output.failed} rows failed ({output.errors}); --resume tries them again", flush=True)
    print(f"wrote {len(output.done)} rows to {args.out}; next: dflash data prepare --target {args.target} --data "
          f"{args.out} --thinking {prepare_thinking(args.reasoning)}", flush=True)
    return 0


def _regenerate_here(args: argparse.Namespace, data: Path, lines: range, sampling: dict, log):
    """The target in this process, on the GPU when there is one."""
    import torch

    from dflash.data.regen_output import RegenOutput
    from dflash.data.regenerate import IN_PROCESS_WORKER, regenerate_in_process, settings_of
    from dflash.targets import load_target
    from dflash.targets.hf import slow_kernel_note

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, device=device)
    if target.tokenizer is None:
        raise CliError(f"{args.target}: the target has no tokenizer; regeneration needs one")
    if note := slow_kernel_note(target.config):
        print(f"target {args.target}: {note}", file=sys.stderr)
    output = RegenOutput(args.out, settings_of(args, f"{args.target} in process", sampling), args.resume)
    from dflash.telemetry import ProfileStats

    stats = ProfileStats(enabled=not args.no_telemetry)
    with _regen_telemetry(args, stats, IN_PROCESS_WORKER):
        regenerate_in_process(target, data, output, lines, args.max_tokens, args.batch_size, args.reasoning,
                              sampling, log=log, stats=stats)
    return output


@contextlib.contextmanager
def _regen_telemetry(args: argparse.Namespace, stats, worker: str) -> Iterator[None]:
    """The socket dflash-top attaches to (none with --no-telemetry), both ways of regenerating: open while
    the rows are done, with this thread named for the job's `worker` (its CPU is read by that name)."""
    if args.no_telemetry:
        yield
        return
    import threading

    from dflash.telemetry import TelemetryServer

    server = TelemetryServer(run=f"regenerate-{args.out.stem}", stats=stats, socket_dir=args.socket_dir,
                             interval_s=0.5)
    server.start()
    print(f"telemetry: {server.path}", flush=True)
    me, name = threading.current_thread(), threading.current_thread().name
    me.name = worker
    try:
        yield
    finally:
        me.name = name
        server.close()


def _target_dir(target: str) -> Path:
    if target == "tiny":
        from dflash.targets.tiny import TINY_DIR

        return Path(TINY_DIR)
    return Path(target)


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
