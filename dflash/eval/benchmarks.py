"""The benchmarks users judge a drafter by, read from each data set's own schema, prompted as the
reference harness prompts them, and the table they compare.

Each benchmark's rows are read from ``--bench-dir/<name>.jsonl`` holding rows in the public data set's
own schema (tests/fixtures/bench/ ships a few real rows of each), or from the hub through ``datasets``
where it is installed and reachable. Prompts are normalised as the reference benchmark does (z-lab
``dflash/benchmark.py``): the maths sets get "Please reason step by step, and put your final answer
within \\boxed{}." after the problem, HumanEval its prompt in a python fence after "Write a solution to the
following problem and make sure that it passes the tests:", MBPP (sanitized) and MT-Bench their prompt
as is; MT-Bench is decoded turn by turn, each later turn after the target's own reply. The sets the
reference harness does not cover are prompted the plainest way their schema allows (below). Every turn is
rendered through the target's chat template under the thinking mode it is served with.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
#: a benchmark file far larger than any of these data sets is not one (SWE-bench Lite's test split,
#: the largest, is some 40 MB with its patches)
MAX_BENCH_BYTES = 256 << 20


class BenchError(ValueError):
    """A benchmark that cannot be read; the message is one line."""


def _field(name: str) -> Callable[[dict], list[str]]:
    return lambda row: [row[name]]


def _math(name: str) -> Callable[[dict], list[str]]:
    return lambda row: [row[name] + MATH_SUFFIX]


def _humaneval(row: dict) -> list[str]:
    return ["Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
            f"{row['prompt']}\n```"]


def _livecodebench(row: dict) -> list[str]:
    """The question, and the starter code in a python fence where the problem gives one (LeetCode's)."""
    starter = row.get("starter_code") or ""
    return [row["question_content"] + (f"\n\n```python\n{starter}\n```" if starter.strip() else "")]


def _alpaca(row: dict) -> list[str]:
    return [row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")]


@dataclass(frozen=True)
class Benchmark:
    name: str
    hub: tuple[str, ...]  # datasets.load_dataset arguments: path, config
    split: str
    fields: tuple[str, ...]  # the schema's fields the prompt needs
    turns: Callable[[dict], list[str]]


BENCHMARKS = {b.name: b for b in [
    Benchmark("gsm8k", ("openai/gsm8k", "main"), "test", ("question",), _math("question")),
    Benchmark("math500", ("HuggingFaceH4/MATH-500",), "test", ("problem",), _math("problem")),
    Benchmark("aime24", ("HuggingFaceH4/aime_2024",), "train", ("problem",), _math("problem")),
    Benchmark("aime25", ("yentinglin/aime_2025",), "train", ("problem",), _math("problem")),
    Benchmark("humaneval", ("openai/openai_humaneval",), "test", ("prompt",), _humaneval),
    Benchmark("mbpp", ("google-research-datasets/mbpp", "sanitized"), "test", ("prompt",), _field("prompt")),
    Benchmark("livecodebench", ("livecodebench/code_generation_lite",), "test", ("question_content",),
              _livecodebench),
    Benchmark("swe-bench-lite", ("princeton-nlp/SWE-bench_Lite",), "test", ("problem_statement",),
              _field("problem_statement")),
    Benchmark("mt-bench", ("HuggingFaceH4/mt_bench_prompts",), "train", ("prompt",), lambda row: list(row["prompt"])),
    Benchmark("alpaca", ("tatsu-lab/alpaca",), "train", ("instruction",), _alpaca),
]}

#: The DFlash paper's figures (arXiv 2602.06036, Table 1: Qwen3-8B with Qwen3-8B-DFlash-b16, batch 1,
#: transformers backend), benchmark -> (speedup over plain decoding, tau), by temperature; printed beside
#: a run whose target is the one they were measured on.
PAPER_TARGET = "Qwen3-8B"
PAPER = {
    0.0: {"gsm8k": (5.20, 6.55), "math500": (6.17, 7.87), "aime24": (5.91, 7.48), "aime25": (5.85, 7.31),
          "humaneval": (5.20, 6.55), "mbpp": (4.75, 6.00), "livecodebench": (5.43, 7.12),
          "swe-bench-lite": (2.92, 3.69), "mt-bench": (2.79, 4.25), "alpaca": (2.27, 3.16)},
    1.0: {"gsm8k": (4.78, 6.04)},
}


def parse_bench(spec: str) -> list[str]:
    """Benchmark names from ``--bench`` (comma-separated, or ``all``), refused in one line when unknown."""
    names = list(BENCHMARKS) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown or not names:
        raise BenchError(f"unknown benchmark {unknown[0] if unknown else spec!r}: one of {', '.join(BENCHMARKS)} "
                         "or all")
    return names


def bench_rows(name: str, bench_dir: str | Path | None, limit: int) -> list[list[str]]:
    """The first ``limit`` rows of a benchmark as lists of user turns, from ``bench_dir`` or the hub."""
    bench = BENCHMARKS[name]
    rows = _rows_from_dir(bench, Path(bench_dir), limit) if bench_dir is not None else _rows_from_hub(bench, limit)
    out = []
    for i, row in enumerate(rows, 1):
        missing = [f for f in bench.fields if not isinstance(row, dict) or not isinstance(row.get(f), (str, list))]
        if missing:
            raise BenchError(f"{name} row {i}: no {missing[0]!r} (the {bench.hub[0]} schema has it)")
        turns = bench.turns(row)
        if not turns or not all(isinstance(t, str) and t for t in turns):
            raise BenchError(f"{name} row {i}: its prompt turns are not non-empty strings")
        out.append(turns)
    if not out:
        raise BenchError(f"{name}: no rows")
    return out


def _rows_from_dir(bench: Benchmark, bench_dir: Path, limit: int) -> list:
    path = bench_dir / f"{bench.name}.jsonl"
    try:
        if path.stat().st_size > MAX_BENCH_BYTES:
            raise BenchError(f"{path}: {path.stat().st_size:,} bytes, far more than the {bench.name} data set")
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if len(rows) >= limit:
                    break
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except ValueError as e:
                        raise BenchError(f"{path}:{lineno}: not JSON ({e})") from None
        return rows
    except OSError as e:
        raise BenchError(f"{path}: {e.strerror or e} (--bench-dir holds <benchmark>.jsonl files in each data set's "
                         "own schema)") from None


def _rows_from_hub(bench: Benchmark, limit: int) -> list:
    try:
        from datasets import load_dataset
    except ImportError:
        raise BenchError(f"{bench.name}: the datasets package is not installed; give --bench-dir with "
                         f"{bench.name}.jsonl in the {bench.hub[0]} schema") from None
    try:
        ds = load_dataset(*bench.hub, split=bench.split)
    except Exception as e:  # noqa: BLE001 - the hub fails in many ways (offline, gated, renamed)
        raise BenchError(f"{bench.name}: cannot load {bench.hub[0]} ({type(e).__name__}); give --bench-dir") from None
    return [ds[i] for i in range(min(limit, len(ds)))]


def run_benchmark(drafter, target, rows: list[list[str]], max_new_tokens: int, sampling=None,
                  check_lossless: bool = True, thinking: str = "auto", block_size: int | None = None):
    """One benchmark's EvalResult: every row decoded turn by turn, each turn after the target's reply
    to the one before (greedy, that reply is the target's own output, speculative or not)."""
    from dflash.data.formats import chat_prompt
    from dflash.eval.speculative import decode_prompt, drafts_per_block, eval_mode, eval_settings, summarize

    sampling, check_lossless, stops, bs = eval_settings(drafter, target, sampling, check_lossless, None, block_size)
    runs = []
    with eval_mode(drafter):
        for i, turns in enumerate(rows):
            messages: list[dict] = []
            for turn in turns:
                messages.append({"role": "user", "content": turn})
                prompt = chat_prompt(messages, target.tokenizer, f"row {i + 1}", thinking)
                run = decode_prompt(drafter, target, len(runs), prompt, max_new_tokens, stops, bs, sampling,
                                    check_lossless)
                runs.append(run)
                messages.append({"role": "assistant",
                                 "content": target.tokenizer.decode(run.spec.tokens, skip_special_tokens=True)})
    return summarize(runs, bs, drafts_per_block(drafter, bs), max_new_tokens, sampling, check_lossless)


def paper_figures(target: str, temperature: float) -> dict[str, tuple[float, float]]:
    """The paper's (speedup, tau) per benchmark when ``target`` is the model they were measured on."""
    name = Path(str(target).rstrip("/")).name.lower()
    return PAPER.get(float(temperature), {}) if name == PAPER_TARGET.lower() else {}


def bar_chart(per_position: list[float], width: int = 30) -> list[str]:
    """Acceptance by block position as terminal bars: where in the block the drafter loses."""
    return [f"  {k:>2} {'#' * round(a * width):<{width}} {a:5.2f}" for k, a in enumerate(per_position, 1)]


def format_table(results: dict[str, dict], paper: dict[str, tuple[float, float]]) -> str:
    """The table users compare: per benchmark prompts, tau, speedup and lossless (the paper's beside
    where it applies), then each benchmark's acceptance by position. Lossless is "yes" only where every
    prompt agreed token for token; near-ties are counted apart ("near-tie N")."""
    from dflash.eval.speculative import lossless_label

    head = f"{'benchmark':<15} {'prompts':>7} {'tau':>6} {'speedup':>8} {'lossless':>10}"
    lines = [head + ("   paper tau  speedup" if paper else "")]
    for name, r in results.items():
        speed = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x"
        row = (f"{name:<15} {r['num_prompts']:>7} {r['tau']:>6.2f} {speed:>8} "
               f"{lossless_label(r['lossless'], r.get('near_ties', 0)):>10}")
        if name in paper:
            row += f"   {paper[name][1]:>9.2f} {paper[name][0]:>7.2f}x"
        lines.append(row)
    for name, r in results.items():
        lines.append(f"{name}: acceptance by block position (fraction of rounds slot k was accepted)")
        lines += bar_chart(r["per_position_acceptance"])
    return "\n".join(lines)


def format_compare(a: dict, b: dict, names: tuple[str, str]) -> str:
    """Two ``--bench --json`` results side by side: tau and speedup per benchmark, and B's change."""
    ra, rb = a.get("benchmarks") or {}, b.get("benchmarks") or {}
    lines = [f"{'benchmark':<15} {'tau A':>7} {'tau B':>7} {'change':>7} {'speedup A':>10} {'speedup B':>10}",
             f"A = {names[0]}", f"B = {names[1]}"]
    lines[1:1] = []
    for name in [n for n in BENCHMARKS if n in ra or n in rb]:
        ta, tb = (ra.get(name) or {}).get("tau"), (rb.get(name) or {}).get("tau")
        sa, sb = (ra.get(name) or {}).get("speedup"), (rb.get(name) or {}).get("speedup")
        change = f"{tb - ta:+.2f}" if ta is not None and tb is not None else "-"
        lines.insert(-2, f"{name:<15} {_num(ta):>7} {_num(tb):>7} {change:>7} {_num(sa, 'x'):>10} "
                         f"{_num(sb, 'x'):>10}")
    return "\n".join(lines)


def _num(v, unit: str = "") -> str:
    return "-" if v is None else f"{v:.2f}{unit}"


def load_result(path: str | Path) -> dict:
    """A saved ``dflash eval --bench ... --json`` result, bounded before it is decoded."""
    p = Path(path)
    try:
        if p.stat().st_size > 64 << 20:
            raise BenchError(f"{p}: far larger than an evaluation result")
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise BenchError(f"{p}: unreadable ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("benchmarks"), dict):
        raise BenchError(f"{p}: not a `dflash eval --bench ... --json` result (no 'benchmarks')")
    return d
