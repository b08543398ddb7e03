"""Datasets for drafter training: formats, the demo set, regeneration with the target."""

from __future__ import annotations

from pathlib import Path

from dflash.data.formats import (
    DataError,
    Sample,
    carries_reasoning,
    iter_rows,
    load_samples,
    prompt_of,
    thinking_mismatch,
)

__all__ = ["DataError", "Sample", "carries_reasoning", "iter_rows", "load_samples", "prompt_of", "resolve_data",
           "load_prompts", "thinking_mismatch"]


def resolve_data(spec: str, evaluation: bool = False) -> Path:
    """`demo` (its held-out prompts when `evaluation`) or a path to a JSONL file."""
    if spec == "demo":
        from dflash.data.demo import demo_path

        return demo_path(evaluation=evaluation)
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"{spec}: no such data file (give a .jsonl path or 'demo')")
    return path


def load_prompts(spec: str, tokenizer, limit: int, skip: int = 0, thinking: str = "auto") -> list[list[int]]:
    """Token-id prompts for evaluation: rows `skip`..`skip+limit` of a dataset (for `demo`, prompts
    from the stdlib files the tiny target never saw), prompted under `thinking` as the target is served."""
    path = resolve_data(spec, evaluation=True)
    prompts = []
    for lineno, row in iter_rows(path):
        if lineno <= skip:
            continue
        prompts.append(prompt_of(row, tokenizer, f"{path}:{lineno}", thinking))
        if len(prompts) >= limit:
            break
    return prompts
