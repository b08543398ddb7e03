"""Training data: JSONL rows in three shapes, tokenized with a loss mask on what the drafter learns.

* ``{"messages": [{"role": ..., "content": ...}, ...]}`` — rendered with the tokenizer's chat template;
  the loss mask is on what each assistant turn writes (its reasoning where the template renders it, its
  content, and the special token that ends the turn), never on headers or other roles' turns. An
  assistant message may carry its reasoning in ``reasoning_content`` (or ``thinking``) or as a leading
  ``<think>...</think>`` block in its content.
* ``{"prompt": "...", "response": "..."}`` — the mask is on the response.
* ``{"text": "..."}`` — the mask is on everything.

A row `dflash data regenerate` wrote may carry each regenerated answer's token ids as the server returned
them (``regen.token_ids``, one list per assistant turn, or one for a prompt row's response). Those ids are
what the target wrote: re-tokenizing the decoded text can give other ids for the same text (a tokenizer's
merges are not the only way to spell a string), and the drafter should learn the target's. So an answer's
tokens are the server's, the rest (prompt, headers, the template's end of turn) the template's, as long as
the ids provably are the row's text: they decode to the rendered answer, start and end on token boundaries
of the rendering, and any end-of-turn token the server returned is the one the template closes the turn
with. Otherwise the row falls back to its text, and the Sample says why (prepare counts and names them).

A bad line stops loading with ``file:line: reason``: silently skipping rows hides broken data pipelines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class DataError(ValueError):
    """Bad data: the message names the file and line."""


#: the object a regenerated row carries about how it was made (dflash/data/regen_output.py writes it)
REGEN_KEY = "regen"


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the drafter is trained to predict (response / assistant tokens)
    #: the answers' tokens are the server's own (the row carried token ids that match its text)
    server_ids: bool = False
    #: why the row's token ids were not used (they disagree with its text); None when it had none or they were
    ids_fallback: str | None = None


class _IdsMismatch(Exception):
    """A row's server token ids are not its text; the message says how (one line)."""


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


THINKING_MODES = ("auto", "on", "off")
# Where datasets keep an assistant turn's reasoning: most use reasoning_content (Qwen's templates read
# it); the gpt-oss template reads `thinking`.
REASONING_KEYS = ("reasoning_content", "thinking")
# A reasoning block written inline at the start of an assistant's content.
_INLINE_THINK = re.compile(r"\s*<think>(.*?)</think>(.*)", re.S)


def _check_messages(row: dict, where: str) -> list[dict]:
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{i}] needs string 'role' and 'content'")
        for key in REASONING_KEYS:
            if m.get(key) is not None and not isinstance(m[key], str):
                raise DataError(f"{where}: messages[{i}].{key} must be a string, got {type(m[key]).__name__}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: 'messages' has no assistant turn to learn from")
    return messages


def _check_thinking(thinking: str) -> None:
    if thinking not in THINKING_MODES:
        raise ValueError(f"thinking must be one of {', '.join(THINKING_MODES)}, got {thinking!r}")


def _reasoning_field(m: dict) -> str:
    return next((m[k] for k in REASONING_KEYS if isinstance(m.get(k), str) and m[k].strip()), "")


def _split_inline(content: str) -> tuple[str, str] | None:
    """(reasoning, answer) of content that opens with a <think> block; None when it has none."""
    match = _INLINE_THINK.fullmatch(content)
    return (match.group(1), match.group(2)) if match else None


def carries_reasoning(row: dict) -> bool:
    """Whether a row has reasoning for the drafter to learn: a reasoning field, or a non-empty
    <think> block, on an assistant turn (or in a prompt row's response)."""
    if isinstance(row.get("messages"), list):
        for m in row["messages"]:
            if not isinstance(m, dict) or m.get("role") != "assistant":
                continue
            inline = _split_inline(m["content"]) if isinstance(m.get("content"), str) else None
            if _reasoning_field(m) or (inline and inline[0].strip()):
                return True
        return False
    inline = _split_inline(row["response"]) if isinstance(row.get("response"), str) else None
    return bool(inline and inline[0].strip())


def thinking_mismatch(n_rows: int, n_reasoning: int, mode: str) -> str | None:
    """One line warning that the data disagrees with the thinking mode, or None when it agrees.

    The drafter is trained on the data as the target will be served: rows with reasoning under
    thinking off lose it, and rows without it under thinking on teach answers the target, thinking
    first, never writes. Under auto the template's default decides, which the data cannot contradict."""
    _check_thinking(mode)
    if mode == "off" and n_reasoning:
        return (f"{n_reasoning} of {n_rows} rows carry reasoning but thinking is off: their reasoning is left "
                f"out (use thinking on if the target is served thinking)")
    if mode == "on" and n_reasoning < n_rows:
        return (f"{n_rows - n_reasoning} of {n_rows} rows carry no reasoning but thinking is on: the drafter "
                f"learns answers the target, thinking first, would not write straight away")
    return None


def served_messages(messages: list[dict], thinking: str) -> list[dict]:
    """The messages as a chat template (ours or a server's) should see them. Under thinking off an
    assistant turn loses its reasoning, field and inline block alike: templates differ in whether
    enable_thinking=False drops it (Qwen3's still renders the last turn's reasoning_content), so it is
    dropped here. Otherwise a
    reasoning field is offered under every name a template reads."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            reasoning = _reasoning_field(m)
            m = {k: v for k, v in m.items() if k not in REASONING_KEYS}
            if thinking == "off":
                inline = _split_inline(m["content"])
                if inline:
                    m["content"] = inline[1]
            elif reasoning:
                m.update(dict.fromkeys(REASONING_KEYS, reasoning))
        out.append(m)
    return out


def _render(tokenizer, messages: list[dict], thinking: str, where: str, generation_prompt: bool = False) -> str:
    """The chat template's text; on/off pass the template's enable_thinking, auto its default."""
    kwargs = {} if thinking == "auto" else {"enable_thinking": thinking == "on"}
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             **kwargs)
    except Exception as e:  # noqa: BLE001 - a template raises whatever its author chose (jinja, TypeError, ...)
        raise DataError(f"{where}: the chat template cannot render this row ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _find(text: str, piece: str, start: int) -> tuple[int, int] | None:
    """Where `piece` first occurs in `text` at or after `start`, or its whitespace-trimmed form (templates
    commonly trim turns); None if neither does or it is blank."""
    for candidate in (piece, piece.strip()):
        if candidate.strip():
            at = text.find(candidate, start)
            if at >= 0:
                return at, at + len(candidate)
    return None


def _assistant_span(text: str, m: dict, cursor: int) -> tuple[int, int, bool] | None:
    """(start, end, ends_turn) of what an assistant turn writes in the rendered text, searched from
    `cursor`: its reasoning if the template rendered it, through its content. ends_turn says the
    content was found, so the token right after it is the turn's end. None when it is not there.

    The content is tried as given, then (for a leading <think> block the template split off) as the
    answer after that block with the block's text as the reasoning."""
    inline = _split_inline(m["content"])
    tries = [(_reasoning_field(m), m["content"])] + ([inline] if inline else [])
    for reasoning, body in tries:
        if not body.strip():  # a turn of reasoning only: nothing ends it that the drafter writes next
            r = _find(text, reasoning, cursor) if reasoning.strip() else None
            return (r[0], r[1], False) if r else (cursor, cursor, False)
        b = _find(text, body, cursor)
        if b is None:
            continue
        r = _find(text, reasoning, cursor) if reasoning.strip() else None
        # Rendered reasoning comes before the content; content may repeat inside the reasoning, so the
        # content is then searched for again after it. Reasoning found only after (or overlapping) the
        # content's first occurrence was not rendered in this turn.
        if r and (r[1] <= b[0] or (r[0] <= b[0] and b[1] <= r[1])):
            after = _find(text, body, r[1])
            if after:
                return r[0], after[1], True
        return b[0], b[1], True
    return None


def _turn_spans(text: str, messages: list[dict], where: str) -> list[tuple[int, int, bool]]:
    """The character spans the drafter learns, one per assistant turn, found in order. Every turn's
    content anchors the search, so an assistant reply that repeats the user's words is found in the
    reply, not in the question."""
    spans = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            span = _assistant_span(text, m, cursor)
            if span is None:
                raise DataError(f"{where}: messages[{i}] (assistant) does not appear verbatim in the chat "
                                f"template's rendering (the template rewrote it), so its tokens cannot be found")
            spans.append(span)
            cursor = max(cursor, span[1])
        else:
            # A turn the template rewrote or dropped (a system prompt folded elsewhere) leaves the cursor.
            found = _find(text, m["content"], cursor)
            if found:
                cursor = found[1]
    return spans


def _special_ids(tokenizer) -> set[int]:
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    return ids


def server_answers(row: dict) -> list[list[int]] | None:
    """The token ids a regenerated row carries for its answers, or None when it carries none; ids that are
    not lists of token ids raise _IdsMismatch (the row still trains from its text)."""
    meta = row.get(REGEN_KEY)
    if not isinstance(meta, dict) or meta.get("token_ids") is None:
        return None
    answers = meta["token_ids"]
    if not isinstance(answers, list) or not all(
            isinstance(a, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in a)
            for a in answers):
        raise _IdsMismatch("regen.token_ids is not a list of token-id lists")
    return answers


def _answer_ids(answer: list[int], tokenizer, special: set[int]) -> tuple[list[int], list[int], str]:
    """(the answer's ids, the special tokens it ended with, its text): a server's ids end with the token
    that stopped it (EOS, end of turn), which the template writes itself."""
    body = list(answer)
    tail: list[int] = []
    while body and body[-1] in special:
        tail.insert(0, body.pop())
    if any(i >= len(tokenizer) for i in body):
        raise _IdsMismatch(f"token id {max(body)} is outside the tokenizer's {len(tokenizer)}")
    return body, tail, tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _splice_answers(ids: list[int], offsets: list, mask: list[int], text: str, spans: list[tuple[int, int, bool]],
                    answers: list[list[int]], tokenizer, special: set[int]) -> tuple[list[int], list[int]]:
    """The rendered conversation's tokens with each assistant turn's tokens replaced by the server's ids
    for it, which are all the drafter's to learn (the target wrote each). The ids may begin before the
    span the text path masks with the `<think>` opener the target wrote and the template renders, and
    must decode to the rendering right up to the span's end."""
    if len(answers) != len(spans):
        raise _IdsMismatch(f"{len(answers)} turns of token ids for {len(spans)} assistant turns")
    out_ids: list[int] = []
    out_mask: list[int] = []
    t = 0  # the next rendered token not yet copied
    done = 0  # the rendered text's characters up to the previous answer's end
    for (start, end, _), answer in zip(spans, answers, strict=True):
        body, tail, said = _answer_ids(answer, tokenizer, special)
        begin = end - len(said)
        # Before the span only what the target writes ahead of its reasoning may be in its ids: the
        # template renders the `<think>` opener it wrote (headers and other turns are the template's).
        if not done <= begin <= start or text[begin:end] != said or text[begin:start].strip() not in ("", "<think>"):
            raise _IdsMismatch("the ids decode to other text than the row's answer")
        t0 = t
        while t0 < len(ids) and offsets[t0][1] <= begin and offsets[t0][0] < begin:
            t0 += 1
        t1 = t0
        while t1 < len(ids) and offsets[t1][0] < end:
            t1 += 1
        if (t0 < t1 and offsets[t0][0] != begin) or (t1 > t0 and offsets[t1 - 1][1] > end):
            raise _IdsMismatch("the answer does not start and end on token boundaries of the rendered chat")
        # The server's stop token is the template's end of turn, or the model's EOS (a server stops at either;
        # the store keeps the template's, which closes the turn in the text path too); another is a mismatch.
        if tail and ids[t1:t1 + len(tail)] != tail and set(tail) != {tokenizer.eos_token_id}:
            raise _IdsMismatch(f"the server ended the turn with {tail}, the template with {ids[t1:t1 + len(tail)]}")
        out_ids += ids[t:t0] + body
        out_mask += mask[t:t0] + [1] * len(body)
        t, done = t1, end
    return out_ids + ids[t:], out_mask + mask[t:]


def _encode_messages(row: dict, tokenizer, where: str, thinking: str) -> Sample:
    messages = _check_messages(row, where)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: 'messages' rows need a tokenizer with a chat template")
    served = served_messages(messages, thinking)
    # Rendered once, as a whole: templates render a turn differently depending on what follows it
    # (Qwen3 gives the last assistant turn an empty <think> block and drops it once a user turn
    # follows), so a conversation is not its prefixes put together.
    text = _render(tokenizer, served, thinking, where)
    spans = _turn_spans(text, served, where)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise DataError(f"{where}: 'messages' rows need a fast tokenizer (one that reports character "
                        f"offsets)") from None
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    special = _special_ids(tokenizer)
    mask = [0] * len(ids)
    t = 0
    for start, end, ends_turn in spans:
        while t < len(ids) and offsets[t][1] <= start:
            t += 1
        while t < len(ids) and offsets[t][0] < end:
            if offsets[t][1] > offsets[t][0]:  # a token overlapping the span carries some of its text
                mask[t] = 1
            t += 1
        # The special token closing the turn (<|im_end|>, <|eot_id|>, <|return|>, ...) right after the
        # content is the drafter's to predict too: it is how the target stops.
        if ends_turn and t < len(ids) and ids[t] in special and offsets[t][0] == end:
            mask[t] = 1
    try:
        answers = server_answers(row)
        if answers is not None:
            return Sample(*_splice_answers(list(ids), offsets, mask, text, spans, answers, tokenizer, special),
                          server_ids=True)
    except _IdsMismatch as e:
        return Sample(list(ids), mask, ids_fallback=str(e))
    return Sample(list(ids), mask)


def _prompt_row_response(row: dict, response: str, tokenizer) -> tuple[list[int] | None, str | None]:
    """(the server's ids for a prompt row's response, or None; why its ids were not used, or None)."""
    try:
        answers = server_answers(row)
        if answers is None:
            return None, None
        if len(answers) != 1:
            raise _IdsMismatch(f"{len(answers)} answers of token ids for one response")
        body, _, said = _answer_ids(answers[0], tokenizer, _special_ids(tokenizer))
        if said != response:
            raise _IdsMismatch("the ids decode to other text than the row's answer")
        return body, None
    except _IdsMismatch as e:
        return None, str(e)


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_row(row: dict, tokenizer, where: str, thinking: str = "auto") -> Sample:
    """Tokenize one row in whichever of the three shapes it has; `thinking` (auto/on/off) renders chat
    rows as the target will be served (on/off pass the template's enable_thinking, auto its default)."""
    _check_thinking(thinking)
    if "messages" in row:
        return _encode_messages(row, tokenizer, where, thinking)
    if "prompt" in row or "response" in row:
        if "prompt" not in row or "response" not in row:
            raise DataError(f"{where}: a prompt row needs both 'prompt' and 'response'")
        p = _tokens(tokenizer, _text_field(row, "prompt", where))
        response = _text_field(row, "response", where)
        served, fallback = _prompt_row_response(row, response, tokenizer)
        r = served if served is not None else _tokens(tokenizer, response)
        return Sample(p + r, [0] * len(p) + [1] * len(r), server_ids=served is not None, ids_fallback=fallback)
    if "text" in row:
        t = _tokens(tokenizer, _text_field(row, "text", where))
        return Sample(t, [1] * len(t))
    raise DataError(f"{where}: row has none of 'messages', 'prompt'/'response' or 'text' (keys: {sorted(row)})")


def load_samples(path: Path, tokenizer, max_len: int = 512, min_loss_tokens: int = 1,
                 thinking: str = "auto") -> list[Sample]:
    """All rows of a JSONL file, truncated to max_len; rows with too few trainable tokens are dropped."""
    samples = []
    for lineno, row in iter_rows(path):
        s = encode_row(row, tokenizer, f"{path}:{lineno}", thinking)
        s.input_ids, s.loss_mask = s.input_ids[:max_len], s.loss_mask[:max_len]
        if sum(s.loss_mask) >= min_loss_tokens:
            samples.append(s)
    if not samples:
        raise DataError(f"{path}: no usable rows (need at least {min_loss_tokens} trainable tokens within {max_len})")
    return samples


def prompt_of(row: dict, tokenizer, where: str, thinking: str = "auto") -> list[int]:
    """The prompt part of a row as token ids (what a model is asked to continue): for a chat row, the
    turns before the first assistant turn with the template's generation prompt, under the same
    thinking mode and reasoning handling as encode_row."""
    _check_thinking(thinking)
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise DataError(f"{where}: 'messages' must be a list of objects")
        first_assistant = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        before = messages[:first_assistant]
        if not before or not all(isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in before):
            raise DataError(f"{where}: a chat row's prompt needs at least one turn with string 'role' and 'content' "
                            f"before the first assistant turn")
        return chat_prompt(before, tokenizer, where, thinking)
    if "prompt" in row:
        return _tokens(tokenizer, _text_field(row, "prompt", where))
    if "text" in row:
        raise DataError(f"{where}: a 'text' row has no prompt to continue; use prompt/response or messages rows")
    raise DataError(f"{where}: row has neither 'messages' nor 'prompt' (keys: {sorted(row)})")


def chat_prompt(messages: list[dict], tokenizer, where: str, thinking: str = "auto") -> list[int]:
    """Token ids that ask the target for the next assistant turn after `messages` (the template's
    generation prompt), rendered as the target is served, earlier assistant turns' reasoning handled as
    encode_row handles it (a benchmark's later turns carry the target's own earlier replies)."""
    _check_thinking(thinking)
    return _tokens(tokenizer, _render(tokenizer, served_messages(messages, thinking), thinking, where,
                                      generation_prompt=True))


def split_reasoning(content: str) -> tuple[str, str]:
    """(reasoning, answer) of an assistant's content: the leading <think> block's text, and what follows it
    (no block: no reasoning, the content whole)."""
    inline = _split_inline(content)
    return inline if inline else ("", content)
