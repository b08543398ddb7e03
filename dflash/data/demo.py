"""The demo dataset: prompts cut from the standard library's source, answered by the tiny target.

It ships with the package (built once by ``dflash data demo``), so `make train` starts at once.
Training rows come from the files the target was trained on; the evaluation prompts come from the
files it never saw, so `dflash eval --data demo` does not measure a drafter on its own training text.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEMO_PATH = Path(__file__).with_name("demo.jsonl")
DEMO_EVAL_PATH = Path(__file__).with_name("demo-eval.jsonl")


def stdlib_prompts(n: int, seed: int = 0, min_chars: int = 120, max_chars: int = 480,
                   held_out: bool = False) -> list[str]:
    """Snippets that start at a line boundary of a randomly chosen stdlib file: from the target's
    training files, or (held_out) from the files it never saw."""
    from dflash.targets.tiny_build import TinyRecipe, read_text, split_files, stdlib_files

    train, held = split_files(stdlib_files(), TinyRecipe().heldout_every)
    files = held if held_out else train
    rng = random.Random(seed)
    prompts: list[str] = []
    while len(prompts) < n:
        lines = read_text(rng.choice(files)).splitlines(keepends=True)
        if len(lines) < 10:
            continue
        i = rng.randrange(len(lines) - 5)
        want = rng.randint(min_chars, max_chars)
        chunk = ""
        while i < len(lines) and len(chunk) < want:
            chunk += lines[i]
            i += 1
        if chunk.strip():
            prompts.append(chunk)
    return prompts


def build_demo(target, out: Path = DEMO_PATH, n: int = 2000, max_new_tokens: int = 128, batch_size: int = 64,
               log=print, eval_out: Path | None = DEMO_EVAL_PATH, n_eval: int = 64) -> int:
    """Training rows (prompt + the target's greedy response) and held-out evaluation prompts."""
    from dflash.data.regenerate import regenerate_rows

    rows = [(f"demo:{i}", {"prompt": p, "response": ""}) for i, p in enumerate(stdlib_prompts(n))]
    new = regenerate_rows(target, rows, max_new_tokens, batch_size, progress=lambda k: log(f"demo: {k}/{n} rows"))
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new), encoding="utf-8")
    if eval_out is not None:
        prompts = stdlib_prompts(n_eval, seed=1, held_out=True)
        eval_out.write_text("".join(json.dumps({"prompt": p, "response": ""}) + "\n" for p in prompts))
    return len(new)


def demo_path(build_if_missing: bool = True, evaluation: bool = False) -> Path:
    """The shipped demo set (or its held-out evaluation prompts); rebuilt with the tiny target only if
    missing."""
    if not DEMO_PATH.exists() or not DEMO_EVAL_PATH.exists():
        if not build_if_missing:
            raise FileNotFoundError(f"demo data missing at {DEMO_PATH}; run `dflash data demo`")
        from dflash.targets import load_target

        build_demo(load_target("tiny"))
    return DEMO_EVAL_PATH if evaluation else DEMO_PATH
