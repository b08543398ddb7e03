"""The demo dataset: prompts cut from the standard library's source, answered by the tiny target.

It ships with the package (built once by ``dflash data demo``), so `make train` starts at once.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

DEMO_PATH = Path(__file__).with_name("demo.jsonl")


def stdlib_prompts(n: int, seed: int = 0, min_chars: int = 120, max_chars: int = 480) -> list[str]:
    """Snippets that start at a line boundary of a randomly chosen stdlib file (the target's training
    files, so prompts look like what the target knows)."""
    from dflash.model.tiny import TinyRecipe, read_text, split_files, stdlib_files

    files, _ = split_files(stdlib_files(), TinyRecipe().heldout_every)
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
               log=print) -> int:
    from dflash.data.regenerate import regenerate_rows

    rows = [(f"demo:{i}", {"prompt": p, "response": ""}) for i, p in enumerate(stdlib_prompts(n))]
    new = regenerate_rows(target, rows, max_new_tokens, batch_size, progress=lambda k: log(f"demo: {k}/{n} rows"))
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new), encoding="utf-8")
    return len(new)


def demo_path(build_if_missing: bool = True) -> Path:
    """The shipped demo set; rebuilt with the tiny target only if it is missing."""
    if not DEMO_PATH.exists():
        if not build_if_missing:
            raise FileNotFoundError(f"demo data missing at {DEMO_PATH}; run `dflash data demo`")
        from dflash.model.target import load_target

        build_demo(load_target("tiny"))
    return DEMO_PATH
