"""Regenerate responses with the target, as the DFlash recipe trains on target-written responses.

A drafter learns to predict *the target's* next tokens; responses written by someone else teach it a
distribution the target does not follow at decode time, and acceptance suffers.

What is shared by both ways of asking the target (a serving endpoint, dflash/data/regen_server.py, or the
target in this process, here): reading the input rows (malformed ones named, not fatal), the shard of
them a job takes, each row as a conversation answered turn by turn, how reasoning is kept, and the
sampling settings.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash.data.formats import DataError, chat_prompt, prompt_of, served_messages, split_reasoning
from dflash.data.regen_output import META, RegenOutput

#: --reasoning: keep the target's reasoning in the trained response, drop it (the target still thinks),
#: or ask for none (the template's enable_thinking=False)
REASONING_MODES = ("keep", "drop", "off")
#: generation_config.json fields every OpenAI-compatible server takes, and those only some do (vLLM and
#: SGLang take them; a server that refuses unknown fields, as `transformers serve` does, gets none)
STANDARD_SAMPLING = ("temperature", "top_p")
EXTRA_SAMPLING = ("top_k", "min_p", "repetition_penalty")


def request_thinking(reasoning: str) -> str:
    """The thinking mode (formats.py's) a request is rendered under: `off` asks for no reasoning; keep and
    drop leave the template's default, so the target answers as it is served."""
    return "off" if reasoning == "off" else "auto"


def prepare_thinking(reasoning: str) -> str:
    """The `dflash data prepare --thinking` that trains on the rows as they were written."""
    return "auto" if reasoning == "keep" else "off"


@dataclass
class Answer:
    """One turn's answer as the target wrote it."""

    text: str
    #: the reasoning the server returned apart (vLLM's and SGLang's reasoning parsers), "" when none
    reasoning: str = ""
    finish: str = "stop"
    token_ids: list[int] | None = None


@dataclass
class Conversation:
    """One input row, answered turn by turn: each assistant turn is asked for given the conversation
    so far, earlier turns already regenerated. A prompt row is one turn (a completion)."""

    line: int
    row: dict
    reasoning: str
    messages: list[dict] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)

    def __post_init__(self) -> None:
        if "messages" in self.row:
            self.messages = copy.deepcopy(self.row["messages"])
            self.turns = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
            if not self.turns:  # a conversation waiting for its answer gets one
                self.messages.append({"role": "assistant", "content": ""})
                self.turns = [len(self.messages) - 1]

    @property
    def chat(self) -> bool:
        return "messages" in self.row

    @property
    def done(self) -> bool:
        return len(self.answers) == (len(self.turns) if self.chat else 1)

    def history(self) -> list[dict]:
        """The messages before the next turn, as a server's template should see them."""
        return served_messages(self.messages[:self.turns[len(self.answers)]], request_thinking(self.reasoning))

    def prompt_ids(self, tokenizer, where: str) -> list[int]:
        """The next turn's prompt as token ids (the in-process path, and the tokenizer check)."""
        if not self.chat:
            return prompt_of(self.row, tokenizer, where)
        return chat_prompt(self.messages[:self.turns[len(self.answers)]], tokenizer, where,
                           request_thinking(self.reasoning))

    def answer(self, a: Answer) -> None:
        reasoning, text = (a.reasoning, a.text) if a.reasoning else split_reasoning(a.text)
        if reasoning and self.reasoning != "keep":
            # the row keeps the answer without its reasoning: the ids of the whole answer are not its text
            a = dataclasses.replace(a, token_ids=None)
        if self.chat:
            m = {"role": "assistant", "content": text.strip() if reasoning else text}
            if reasoning and self.reasoning == "keep":
                m["reasoning_content"] = reasoning.strip()
            self.messages[self.turns[len(self.answers)]] = m
        self.answers.append(a)

    def output(self) -> dict:
        meta: dict = {"line": self.line, "finish": [a.finish for a in self.answers],
                      "cut": any(a.finish == "length" for a in self.answers)}
        if all(a.token_ids is not None for a in self.answers):
            meta["token_ids"] = [a.token_ids for a in self.answers]
        if self.chat:
            return {"messages": self.messages, META: meta}
        text = self.answers[0].text
        if self.reasoning != "keep":
            text = split_reasoning(text)[1]
        return {"prompt": self.row["prompt"], "response": text, META: meta}


def passes_through(row: dict) -> bool:
    """Rows with tool calls are kept as they are: the server cannot call the tools again, so a
    regenerated turn would answer results that never came."""
    return isinstance(row.get("messages"), list) and any(
        isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in row["messages"])


def malformed(row: object) -> str | None:
    """Why a row cannot be regenerated, or None when it can."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    if passes_through(row):
        return None
    if "messages" in row:
        ms = row["messages"]
        if not isinstance(ms, list) or not ms:
            return "'messages' must be a non-empty list"
        for i, m in enumerate(ms):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return f"messages[{i}] needs string 'role' and 'content'"
        if ms[0]["role"] == "assistant":
            return "the conversation opens with an assistant turn: nothing asks for it"
        return None
    if "prompt" in row:
        return None if isinstance(row["prompt"], str) else "field 'prompt' must be a string"
    if "text" in row:
        return "a 'text' row has no prompt to answer; use prompt/response or messages rows"
    return f"row has neither 'messages' nor 'prompt' (keys: {sorted(row)})"


def parse_shard(spec: str | None) -> tuple[int, int]:
    """`K/N` -> (K, N): the K-th (from 0) of N contiguous parts."""
    if spec is None:
        return 0, 1
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise DataError(f"--shard {spec!r}: expected K/N, the K-th (from 0) of N parts") from None
    if not (n >= 1 and 0 <= k < n):
        raise DataError(f"--shard {spec}: K must be 0..N-1")
    return k, n


def shard_lines(data: Path, shard: tuple[int, int], limit: int | None = None) -> range:
    """The input lines (1-based, blank ones included, skipped when read) of this shard: contiguous, so
    merging the parts restores the input order."""
    with data.open("rb") as f:
        total = sum(1 for _ in f)
    total = min(total, limit) if limit is not None else total
    k, n = shard
    return range(k * total // n + 1, (k + 1) * total // n + 1)


def read_shard(data: Path, lines: range) -> Iterator[tuple[int, object, str | None]]:
    """(line number, row, why it is malformed or None) for each non-blank line in `lines`, read lazily."""
    with data.open(encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno < lines.start:
                continue
            if lineno >= lines.stop:
                return
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as e:
                yield lineno, None, f"not valid JSON ({e.msg} at column {e.colno})"
                continue
            yield lineno, row, malformed(row)


def sampling_defaults(target_dir: Path | None, extras: bool) -> tuple[dict, list[str]]:
    """The request's sampling from the target's generation_config.json (greedy where it does not sample),
    and the fields left out because the server takes no extra fields."""
    cfg = {}
    if target_dir is not None and (target_dir / "generation_config.json").is_file():
        cfg = json.loads((target_dir / "generation_config.json").read_text(encoding="utf-8"))
    if not cfg.get("do_sample"):
        return {"temperature": 0.0}, []
    out = {k: cfg[k] for k in STANDARD_SAMPLING if k in cfg}
    left = [k for k in EXTRA_SAMPLING if k in cfg]
    if extras:
        out.update({k: cfg[k] for k in left})
        left = []
    return out, left


def settings_of(args, model: str | None, sampling: dict) -> dict:
    """What makes a job's rows what they are (a resume must match it)."""
    return {"data": str(Path(args.data).resolve()), "shard": args.shard or "0/1", "limit": args.limit,
            "model": model, "sampling": sampling, "max_tokens": args.max_tokens, "reasoning": args.reasoning}


def regenerate_rows(target, rows: list[tuple[str, dict]], max_new_tokens: int = 128, batch_size: int = 32,
                    progress: Callable[[int], None] | None = None, thinking: str = "auto") -> list[dict]:
    """New rows whose first response the target wrote, greedily, all in memory (the demo set's builder:
    2,000 short rows; a data set goes through `dflash data regenerate`, which resumes)."""
    prompts = [prompt_of(row, target.tokenizer, where, thinking) for where, row in rows]
    out: list[dict] = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        for (_, row), resp in zip(batch, generate_batch(target, prompts[start:start + batch_size], max_new_tokens),
                                  strict=True):
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


# --- in this process -------------------------------------------------------------------------------

#: the in-process job's one worker on the telemetry wire (and its thread's name, whose CPU is read by it)
IN_PROCESS_WORKER = "regen-target"


def generate_batch(target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of token-id prompts (left-padded into one batch), without the prompts."""
    return [ids for ids, _ in generate_finished(target, prompts, max_new_tokens)]


def generate_finished(target, prompts: list[list[int]], max_new_tokens: int,
                      sampling: dict | None = None) -> list[tuple[list[int], str]]:
    """Continuations of token-id prompts (left-padded into one batch), without the prompts, each with its
    finish reason ("stop" at EOS, "length" when cut); greedy unless `sampling` has a temperature."""
    import torch

    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    sampling = sampling or {}
    temperature = float(sampling.get("temperature", 0.0))
    how = {"do_sample": False} if temperature <= 0 else {
        "do_sample": True, "temperature": temperature,
        **{k: sampling[k] for k in ("top_p", "top_k", "min_p", "repetition_penalty") if k in sampling}}
    with torch.no_grad():
        out = target.model.generate(
            input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
            max_new_tokens=max_new_tokens, pad_token_id=pad, **how,
        )
    results = []
    for row in out[:, width:].tolist():
        # A finished row is padded after its EOS; a pad id the target wrote before it is text.
        if tok.eos_token_id in row:
            results.append((row[: row.index(tok.eos_token_id)], "stop"))
        else:
            results.append((row, "length"))
    return results


def regenerate_in_process(target, data: Path, output: RegenOutput, lines: range, max_new_tokens: int,
                          batch_size: int, reasoning: str, sampling: dict | None = None,
                          log: Callable[[str], None] = print, stats=None) -> None:
    """Answer every row of `lines` not yet done with the target here: a chunk of rows at a time, each of
    their turns batched with prompts of like length (less padding), the chunk appended durably once all
    its conversations are answered. `stats` (a ProfileStats): the job's time on the telemetry wire, on one
    worker (this thread): the target's `generate` against the durable `row_write`, counters rows and tokens,
    as the endpoint path publishes them."""
    from dflash.telemetry import ProfileStats
    from dflash.telemetry.wire.vocab import GENERATE, ROW_WRITE, Counter, Gauge, Role

    stats = stats if stats is not None else ProfileStats(enabled=False)
    w = stats.worker(IN_PROCESS_WORKER, Role.TARGET)
    tok = target.tokenizer
    chunk: list[Conversation] = []
    total = len(lines)

    def append(rows: list[dict]) -> None:
        with w.span(ROW_WRITE):
            output.append(rows)
        stats.count(Counter.ROWS, len(rows))
        stats.count(Counter.CUT_ROWS, sum(1 for r in rows if r[META].get("cut")))
        stats.gauge(Gauge.PROGRESS, min(1.0, (len(output.done) + output.failed) / max(1, total)))

    def fail(line: int, reason: str) -> None:
        with w.span(ROW_WRITE):
            output.error(line, reason)
        stats.count(Counter.ROW_ERRORS)

    def flush() -> None:
        while any(not c.done for c in chunk):
            todo = sorted((c for c in chunk if not c.done), key=lambda c: len(c.prompt_ids(tok, f"{data}:{c.line}")))
            for start in range(0, len(todo), batch_size):
                batch = todo[start:start + batch_size]
                prompts = [c.prompt_ids(tok, f"{data}:{c.line}") for c in batch]
                with w.span(GENERATE):
                    answers = generate_finished(target, prompts, max_new_tokens, sampling)
                for c, (ids, finish) in zip(batch, answers, strict=True):
                    c.answer(Answer(tok.decode(ids, skip_special_tokens=True), finish=finish, token_ids=ids))
                stats.count(Counter.TOKENS, sum(len(ids) for ids, _ in answers))
        append([c.output() for c in chunk])
        chunk.clear()
        log(f"regenerate: {len(output.done)} rows done, {output.failed} failed")

    for line, row, bad in read_shard(data, lines):
        if line in output.done:
            continue
        if bad is not None:
            fail(line, bad)
        elif passes_through(row):
            append([{**row, META: {"line": line, "passed": "tool calls"}}])
        else:
            try:
                chunk.append(Conversation(line, row, reasoning))
                chunk[-1].prompt_ids(tok, f"{data}:{line}")  # a template that cannot render it is named now
            except DataError as e:
                chunk.pop()
                fail(line, str(e).split(": ", 1)[-1])
        if len(chunk) >= batch_size * 8:
            flush()
    if chunk:
        flush()
