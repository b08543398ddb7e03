"""Training data: JSONL rows in three shapes, tokenized with a loss mask on what the drafter learns.

* ``{"messages": [{"role": ..., "content": ...}, ...]}`` — rendered with the tokenizer's chat template;
  the loss mask is on assistant turns only.
* ``{"prompt": "...", "response": "..."}`` — the mask is on the response.
* ``{"text": "..."}`` — the mask is on everything.

A bad line stops loading with ``file:line: reason``: silently skipping rows hides broken data pipelines.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class DataError(ValueError):
    """Bad data: the message names the file and line."""


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the drafter is trained to predict (response / assistant tokens)


def iter_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, row) for every non-blank line; a line that is not a JSON object is an error."""
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                # json's messages end in "at" ("Unterminated string starting at"), the column follows
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg.removesuffix(' at')} at column "
                                f"{e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def _text_field(row: dict, key: str, where: str) -> str:
    value = row[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _check_messages(row: dict, where: str) -> list[dict]:
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}] needs string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: 'messages' has no assistant turn to learn from")
    return messages


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_row(row: dict, tokenizer, where: str) -> Sample:
    """Tokenize one row in whichever of the three shapes it has."""
    if "messages" in row:
        messages = _check_messages(row, where)
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{where}: 'messages' rows need a tokenizer with a chat template")
        # Render turn by turn: an assistant turn's tokens are what the conversation up to it adds over
        # the conversation before it. Templates close every turn with a special token, which the
        # tokenizer splits on, so earlier turns tokenize the same in every prefix.
        ids: list[int] = []
        mask: list[int] = []
        for i, m in enumerate(messages):
            new = _tokens(tokenizer, tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
            added = new[len(ids):]
            ids = new
            mask.extend([1 if m["role"] == "assistant" else 0] * len(added))
        return Sample(ids, mask)
    if "prompt" in row or "response" in row:
        if "prompt" not in row or "response" not in row:
            raise DataError(f"{where}: a prompt row needs both 'prompt' and 'response'")
        p = _tokens(tokenizer, _text_field(row, "prompt", where))
        r = _tokens(tokenizer, _text_field(row, "response", where))
        return Sample(p + r, [0] * len(p) + [1] * len(r))
    if "text" in row:
        t = _tokens(tokenizer, _text_field(row, "text", where))
        return Sample(t, [1] * len(t))
    raise DataError(f"{where}: row has none of 'messages', 'prompt'/'response' or 'text' (keys: {sorted(row)})")


def load_samples(path: Path, tokenizer, max_len: int = 512, min_loss_tokens: int = 1) -> list[Sample]:
    """All rows of a JSONL file, truncated to max_len; rows with too few trainable tokens are dropped."""
    samples = []
    for lineno, row in iter_rows(path):
        s = encode_row(row, tokenizer, f"{path}:{lineno}")
        s.input_ids, s.loss_mask = s.input_ids[:max_len], s.loss_mask[:max_len]
        if sum(s.loss_mask) >= min_loss_tokens:
            samples.append(s)
    if not samples:
        raise DataError(f"{path}: no usable rows (need at least {min_loss_tokens} trainable tokens within {max_len})")
    return samples


def prompt_of(row: dict, tokenizer, where: str) -> list[int]:
    """The prompt part of a row as token ids (what a model is asked to continue)."""
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of objects")
        first_assistant = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        text = tokenizer.apply_chat_template(messages[:first_assistant], tokenize=False, add_generation_prompt=True)
        return _tokens(tokenizer, text)
    if "prompt" in row:
        return _tokens(tokenizer, _text_field(row, "prompt", where))
    if "text" in row:
        raise DataError(f"{where}: a 'text' row has no prompt to continue; use prompt/response or messages rows")
    raise DataError(f"{where}: row has neither 'messages' nor 'prompt' (keys: {sorted(row)})")
