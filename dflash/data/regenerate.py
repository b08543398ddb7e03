"""Regenerate responses with the target, as the DFlash recipe trains on target-written responses.

A drafter learns to predict *the target's* next tokens; responses written by someone else teach it a
distribution the target does not follow at decode time, and acceptance suffers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

from dflash.data.formats import DataError, iter_rows, prompt_of


def generate_batch(target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of token-id prompts (left-padded into one batch), without the prompts."""
    import torch

    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = target.model.generate(
            input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
        )
    results = []
    for row in out[:, width:].tolist():
        # A finished row is padded after its EOS; a pad id the target wrote before it is text.
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id)]
        results.append(row)
    return results


def regenerate_rows(target, rows: Iterable[tuple[str, dict]], max_new_tokens: int = 128, batch_size: int = 32,
                    progress: Callable[[int], None] | None = None, thinking: str = "auto") -> list[dict]:
    """New rows whose responses the target wrote: prompt rows keep their prompt, chat rows their
    conversation up to the first assistant turn (prompted under `thinking`, as the target is served)."""
    rows = list(rows)
    prompts = [prompt_of(row, target.tokenizer, where, thinking) for where, row in rows]
    out: list[dict] = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        responses = generate_batch(target, prompts[start:start + batch_size], max_new_tokens)
        for (_, row), resp in zip(batch, responses, strict=True):
            text = target.tokenizer.decode(resp, skip_special_tokens=True)
            if "messages" in row:
                first = next((i for i, m in enumerate(row["messages"]) if m.get("role") == "assistant"),
                             len(row["messages"]))
                out.append({"messages": row["messages"][:first] + [{"role": "assistant", "content": text}]})
            else:
                out.append({"prompt": row["prompt"], "response": text})
        if progress:
            progress(len(out))
    return out


def regenerate_file(target, data: Path, out: Path, max_new_tokens: int = 128, batch_size: int = 32,
                    limit: int | None = None, thinking: str = "auto") -> int:
    """Regenerate every row of `data` into `out` (written whole at the end, so a failure leaves no half file)."""
    rows = [(f"{data}:{n}", row) for n, row in iter_rows(data)][:limit]
    if not rows:
        raise DataError(f"{data}: no rows to regenerate")
    new = regenerate_rows(target, rows, max_new_tokens, batch_size, thinking=thinking)
    tmp = out.with_suffix(out.suffix + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new), encoding="utf-8")
    tmp.replace(out)
    return len(new)
