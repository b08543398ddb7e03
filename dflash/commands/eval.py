"""`dflash eval`: real speculative decoding with a drafter (DFlash or DFlash2) against its target: tau,
acceptance, and a token-for-token check that the output equals the target's own greedy decode; or, with
--temperature, sampled decoding verified by rejection sampling."""

from __future__ import annotations

import argparse
import json
import sys

from dflash.commands import CliError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", default=None, help="checkpoint file, run directory, export directory, or a "
                   "speculators DFlash or DFlash2 checkpoint (or `speculators train` save path); required unless "
                   "--endpoint or --compare")
    p.add_argument("--target", default=None, help="local Hugging Face model directory, or 'tiny' (default: the "
                   "target the drafter's run trained against, from its config.json, or the verifier a speculators "
                   "checkpoint names; else 'tiny')")
    p.add_argument("--data", default="demo", help="prompts: a JSONL file, or 'demo' (default)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--block-size", type=int, default=None, help="verify blocks of this size (<= the drafter's)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--no-lossless-check", action="store_true", help="skip the plain greedy decode comparison")
    p.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature, verified by "
                   "rejection sampling (default 0: greedy, checked token for token)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus cut (default 1: none)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: keep the k likeliest tokens (default "
                   "0: all)")
    p.add_argument("--seed", type=int, default=0, help="with --temperature: seed of the draws (default 0)")
    p.add_argument("--confidence-threshold", type=float, default=None, metavar="P",
                   help="DSpark: verify each round's drafts only while the confidence head's running product of "
                   "survival stays at or above P (default: every draft)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--bench", default=None, help="benchmarks instead of --data: comma-separated of gsm8k, math500, "
                   "aime24, aime25, humaneval, mbpp, livecodebench, swe-bench-lite, mt-bench, alpaca, or all "
                   "(--num-prompts rows of each)")
    p.add_argument("--bench-dir", default=None, help="with --bench: a directory of <benchmark>.jsonl files in each "
                   "data set's own schema (default: the hub, through the datasets package)")
    p.add_argument("--thinking", choices=["auto", "on", "off"], default="auto", help="the chat template's thinking "
                   "mode, as the target is served (default: the template's own)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None, help="print two saved `--bench ... "
                   "--json` results side by side (loads no model)")
    p.add_argument("--endpoint", default=None, metavar="URL", help="with --bench: a running vLLM or SGLang server "
                   "(e.g. http://localhost:8000): send it the benchmarks' prompts and report the tau it serves, "
                   "beside dflash's own on the same prompts when --drafter is given")
    p.add_argument("--served-model", default=None, help="with --endpoint: the model name to request (default: the "
                   "one the server lists)")
    p.add_argument("--concurrency", type=int, default=8, help="with --endpoint: rows in flight at once (default 8)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: the threads per "
                   "worker of the drafter's run, from its config.json; else torch's default)")


def run(args: argparse.Namespace) -> int:
    from dflash.eval.benchmarks import BenchError, bench_rows, parse_bench
    from dflash.eval.speculative import evaluate
    from dflash.train.reporting.evaluation import threads_text, torch_threads

    if args.compare:
        return _compare(args.compare)
    if args.drafter is None and args.endpoint is None:
        raise CliError("--drafter is required (or --endpoint URL --bench ... to read a server's served tau, or "
                       "--compare A B)")
    if args.endpoint is not None and args.bench is None:
        raise CliError("--endpoint needs --bench: served tau is measured on the benchmarks' prompts")
    sampling = _sampling(args)
    benches = {}
    if args.bench is not None:  # read (and refused) before any model loads
        try:
            benches = {name: bench_rows(name, args.bench_dir, args.num_prompts) for name in parse_bench(args.bench)}
        except BenchError as e:
            raise CliError(str(e)) from None
    served = _measure_served(args, benches, sampling) if args.endpoint is not None else None
    if args.drafter is None:
        return _report_served(args, served, None, None, None)
    drafter, target, prompts, run_cfg = _load(args, need_prompts=not benches)
    if not sampling.greedy:
        import torch

        sampling.generator = torch.Generator(target.device).manual_seed(args.seed)
    threads, source = args.threads, "--threads"
    if threads is None and run_cfg is not None and run_cfg.pipeline.threads_per_worker:
        threads, source = run_cfg.pipeline.threads_per_worker, "as each worker of its run; --threads to change"
    try:
        with torch_threads(threads) as n:
            print(f"dflash eval: {threads_text(n, source if threads else None)}", file=sys.stderr)
            if benches:
                results = _run_benches(args, drafter, target, benches, sampling, quiet=served is not None)
                if served is not None:
                    return max(_report_served(args, served, results, drafter, target), _lossless_status(results))
                return _lossless_status(results)
            result = evaluate(drafter, target, prompts, args.max_new_tokens, check_lossless=not args.no_lossless_check,
                              block_size=args.block_size, sampling=sampling,
                              confidence_threshold=args.confidence_threshold)
    except ValueError as e:
        raise CliError(str(e)) from e
    print(json.dumps(result.to_dict()) if args.json else format_result(result))
    for d in result.divergences:
        kind = "near-tie (rounding, not a loss)" if d["near_tie"] else "DIVERGED"
        gap = "" if d["logit_gap"] is None else f", logit gap {d['logit_gap']:.3g} (tolerance {d['tolerance']:.3g})"
        print(f"dflash eval: prompt {d['prompt']} {kind} at token {d['position']}: speculative "
              f"{d['speculative_token']} vs greedy {d['greedy_token']}{gap}", file=sys.stderr)
    if result.lossless is False:
        print(f"dflash eval: NOT LOSSLESS on prompts {result.mismatched_prompts}", file=sys.stderr)
        return 1
    return 0


def _run_benches(args: argparse.Namespace, drafter, target, benches: dict, sampling, quiet: bool = False) -> dict:
    """Every benchmark asked for, then the table (or one JSON object, left to the served report when
    ``quiet``); their EvalResults' dicts by name."""
    from dflash.eval.benchmarks import format_table, paper_figures, run_benchmark

    results = {}
    for name, rows in benches.items():
        print(f"dflash eval: {name}: {len(rows)} prompts", file=sys.stderr)
        results[name] = run_benchmark(drafter, target, rows, args.max_new_tokens, sampling,
                                      check_lossless=not args.no_lossless_check, thinking=args.thinking,
                                      block_size=args.block_size).to_dict()
    paper = paper_figures(args.target, sampling.temperature)
    if quiet:
        return results
    if args.json:
        print(json.dumps({"target": args.target, "drafter": args.drafter, "thinking": args.thinking,
                          "temperature": sampling.temperature, "benchmarks": results,
                          "paper": {k: {"speedup": v[0], "tau": v[1]} for k, v in paper.items() if k in results}}))
    else:
        print(format_table(results, paper))
    return results


def _lossless_status(results: dict) -> int:
    """1 where any benchmark diverged for real from the target's greedy output (said on stderr)."""
    bad = [n for n, r in results.items() if r["lossless"] is False]
    if bad:
        print(f"dflash eval: NOT LOSSLESS on {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


def _measure_served(args: argparse.Namespace, benches: dict, sampling) -> tuple:
    """The server's own acceptance on the benchmarks (before any model loads here), refused in one line."""
    from dflash.eval.served import measure_served
    from dflash.server_api import ServerError

    if args.concurrency < 1:
        raise CliError("--concurrency must be at least 1")
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be at least 1")
    try:
        return measure_served(args.endpoint, benches, args.max_new_tokens, temperature=sampling.temperature,
                              top_p=sampling.top_p, top_k=sampling.top_k, thinking=args.thinking,
                              model=args.served_model, concurrency=args.concurrency)
    except ServerError as e:  # ServedError too
        raise CliError(str(e)) from None


def _report_served(args: argparse.Namespace, measured: tuple, own: dict | None, drafter, target) -> int:
    """Served tau beside dflash's own per benchmark, a gap beyond noise said with its likely causes;
    1 where there is such a gap."""
    from dflash.eval.served import explain, format_served

    server, served = measured
    contract = _contract_lines(drafter, server.engine) if drafter is not None else []
    verdicts = {}
    for name, s in served.items():
        prompt_tokens = _first_turn_tokens(args, target, name) if target is not None else None
        verdicts[name] = explain(s, (own or {}).get(name), drafter.config.block_size if drafter is not None else None,
                                 prompt_tokens, contract)
    if args.json:
        print(json.dumps({"endpoint": server.url, "engine": server.engine, "model": server.model,
                          "drafter": args.drafter, "target": args.target, "thinking": args.thinking,
                          "served": {n: {**s.to_dict(), **verdicts[n]} for n, s in served.items()},
                          "benchmarks": own or {}}))
    else:
        if own:
            from dflash.eval.benchmarks import format_table

            print(format_table(own, {}))
        print(format_served(server, served, verdicts))
    gaps = [n for n, v in verdicts.items() if v["beyond_noise"]]
    if gaps:
        print(f"dflash eval: served tau differs beyond noise on {', '.join(gaps)}", file=sys.stderr)
    return 1 if gaps else 0


def _contract_lines(drafter, engine: str) -> list[str]:
    """How ``engine`` reads the export the drafter was loaded from, where it was one (engine_contracts)."""
    from pathlib import Path

    from dflash.eval.engine_contracts import check_config
    from dflash.model.export import CONFIG_NAME, read_config_json

    where = Path(str(getattr(drafter, "loaded_from", "") or ""))
    if not (where / CONFIG_NAME).is_file():
        return []
    try:
        return [str(x) for x in check_config(read_config_json(where), drafter.config, (engine,))]
    except (KeyError, ValueError, TypeError) as e:
        return [f"{where / CONFIG_NAME} does not resolve ({e})"]


def _first_turn_tokens(args: argparse.Namespace, target, name: str) -> list[int] | None:
    """Each row's first turn as dflash renders it (chat template, thinking mode): its length in tokens."""
    from dflash.data.formats import chat_prompt
    from dflash.eval.benchmarks import bench_rows

    rows = bench_rows(name, args.bench_dir, args.num_prompts)
    return [len(chat_prompt([{"role": "user", "content": r[0]}], target.tokenizer, f"{name} row {i + 1}",
                            args.thinking)) for i, r in enumerate(rows)]


def _compare(paths: list[str]) -> int:
    from dflash.eval.benchmarks import BenchError, format_compare, load_result

    try:
        a, b = load_result(paths[0]), load_result(paths[1])
    except BenchError as e:
        raise CliError(str(e)) from None
    print(format_compare(a, b, (paths[0], paths[1])))
    return 0


def _sampling(args: argparse.Namespace):
    """The sampling settings, refused in one line before anything loads."""
    from dflash.eval.speculative import Sampling

    if args.temperature == 0 and (args.top_p != 1.0 or args.top_k != 0):
        raise CliError("--top-p and --top-k cut the distribution a temperature samples from: add --temperature T")
    try:
        return Sampling(args.temperature, args.top_p, args.top_k)
    except ValueError as e:
        raise CliError(str(e)) from None


def _load(args: argparse.Namespace, need_prompts: bool = True) -> tuple:
    """The drafter, its target (this thread bound to its GPU), the prompts and the drafter's run config,
    each refused in one line when it does not load; `args.block_size` and `args.target` filled in."""
    import torch

    from dflash.model.export import DrafterLoadError
    from dflash.model.loading import load_drafter
    from dflash.model.speculators_format import speculators_dir, with_target
    from dflash.targets import TargetError, load_target
    from dflash.targets.hf import slow_kernel_note
    from dflash.train.config import ConfigError, check_device
    from dflash.train.device.binding import bind_thread, resolve, thread_device

    if args.max_new_tokens < 1 or args.num_prompts < 1:
        raise CliError("--max-new-tokens and --num-prompts must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be at least 1")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        check_device(device)
    except ConfigError as e:
        raise CliError(str(e)) from None
    bind_thread(thread_device(resolve(device)))  # never a context on GPU 0 for a run on another GPU
    try:
        drafter = load_drafter(args.drafter)
    except DrafterLoadError as e:
        raise CliError(str(e)) from e
    run_cfg = _run_config(args.drafter, target_given=args.target is not None)
    speculators = speculators_dir(drafter.loaded_from)
    if args.target is None:
        args.target = _verifier_of(speculators) if speculators and run_cfg is None else _trained_against(run_cfg)
    args.block_size = args.block_size or drafter.config.block_size
    if not 2 <= args.block_size <= drafter.config.block_size:
        raise CliError(f"--block-size must be between 2 and the drafter's {drafter.config.block_size}")
    try:
        target = load_target(args.target, device=device, layer_ids=drafter.config.target_layer_ids)
    except TargetError as e:
        raise CliError(str(e)) from e
    if speculators is not None:  # it names its verifier, not the verifier's layer count: the target's it is
        try:
            drafter.config = with_target(drafter.config, target)
        except DrafterLoadError as e:
            raise CliError(f"{speculators}: {e}") from None
    if note := slow_kernel_note(target.config):
        print(f"dflash eval: target {args.target}: {note}", file=sys.stderr)
    if target.tokenizer is None:
        raise CliError(f"target {args.target!r} has no tokenizer, so prompts from {args.data!r} cannot be encoded")
    if not need_prompts:
        return drafter.to(device=target.device, dtype=target.dtype), target, [], run_cfg
    from dflash.data import load_prompts

    try:
        prompts = load_prompts(args.data, target.tokenizer, args.num_prompts, thinking=args.thinking)
    except (OSError, ValueError) as e:
        raise CliError(str(e).splitlines()[0] if str(e) else repr(e)) from e
    if not prompts:
        raise CliError(f"no prompts in {args.data!r}")
    return drafter.to(device=target.device, dtype=target.dtype), target, prompts, run_cfg


def _run_config(drafter: str, target_given: bool):
    """The training config of the run the drafter comes from (its target and threads), None where
    there is no run around it. With --target given it only lends the threads, so one that does not
    parse is passed over with a note instead of ending the evaluation."""
    from dflash.train.config import ConfigError
    from dflash.train.config.schema import config_beside

    try:
        return config_beside(drafter)
    except ConfigError as e:
        if target_given:
            print(f"dflash eval: the drafter's run config is not read ({e}); threads as set here", file=sys.stderr)
            return None
        raise CliError(f"{e}; give --target to say which target the drafter is for") from None


def _verifier_of(checkpoint) -> str:
    """The verifier a speculators checkpoint names (said on stderr), or the built-in target."""
    from dflash.model.speculators_format import verifier_named

    name = verifier_named(checkpoint)
    if name is None:
        return "tiny"
    print(f"dflash eval: target {name} (the verifier its speculators config names; --target to change)",
          file=sys.stderr)
    return name


def _trained_against(cfg) -> str:
    """The target named in the drafter's run config, its --eval-target first (said on stderr, so --json
    output stays one object), or the built-in one where there is no run around the drafter."""
    if cfg is None:
        return "tiny"
    if cfg.eval.eval_target is not None:
        print(f"dflash eval: target {cfg.eval.eval_target} (the one its run evaluated with; --target to change)",
              file=sys.stderr)
        return cfg.eval.eval_target
    print(f"dflash eval: target {cfg.run.target} (the one its run trained against; --target to change)",
          file=sys.stderr)
    return cfg.run.target


def format_result(r) -> str:
    """Human-readable report of an EvalResult."""
    hist = " ".join(f"{i}:{n}" for i, n in enumerate(r.acceptance_histogram))
    acc = " ".join(f"{a:.2f}" for a in r.per_position_acceptance)
    lossless = {True: "yes", False: "NO", None: "not checked"}[r.lossless]
    if r.lossless is not None:
        lossless = (f"{lossless}, {r.exact_prompts} of {r.num_prompts} prompts token for token"
                    if r.near_ties or r.lossless is False else lossless)
    if r.temperature > 0:
        lossless = (f"sampled at temperature {r.temperature:g}, top-p {r.top_p:g}, top-k {r.top_k or 'all'}: "
                    "verified by rejection sampling, no token-for-token check")
    if r.near_ties:
        lossless += (f"; {r.near_ties} near-tie(s), not exact: prompt(s) {r.near_tie_prompts} left greedy only at a "
                     "near-tie (two logits within the rounding measured between verification and plain decoding)")
    return "\n".join([
        f"tau {r.tau:.3f} tokens/round over {r.rounds} rounds ({r.num_prompts} prompts, block {r.block_size}, "
        f"{r.tokens_generated} tokens); mean over prompts {r.acceptance_length:.3f}",
        speed_text(r),
        f"target forwards {r.target_forwards} vs {r.baseline_forwards} greedy (saved {r.forwards_saved})",
        f"accepted drafts per round (count): {hist}",
        *([f"confidence-scheduled: {r.mean_verified:.2f} drafts verified per round of "
           f"{len(r.per_position_acceptance)} (running survival >= {r.confidence_threshold:g})"]
          if r.confidence_threshold is not None else []),
        f"acceptance by position 1..{len(r.per_position_acceptance)}: {acc}",
        f"lossless: {lossless}" if r.temperature > 0 else f"lossless (== target greedy): {lossless}",
    ])


def speed_text(r) -> str:
    """The number a user decides on: wall time against plain greedy decoding, and when speculation is
    slower, why, in the run's own measurements (a round costs more plain steps than it yields tokens)."""
    if r.speedup is None:
        return "speedup: not measured (the plain greedy decode it is timed against runs with the lossless check)"
    times = f"{r.speculative_seconds:.1f} s speculative vs {r.greedy_seconds:.1f} s plain greedy"
    if r.speedup >= 1:
        return f"speedup {r.speedup:.2f}x in wall time ({times})"
    return (f"SLOWER than plain decoding: {r.speedup:.2f}x in wall time ({times}): a round (draft a block of "
            f"{r.block_size}, verify it in one target forward) takes as long as {r.round_cost:.1f} plain decoding "
            f"steps but yields tau {r.tau:.2f} tokens; it pays only where tau exceeds that cost (a drafter far "
            "cheaper than its target, as on a large model, or a better-trained one)")
