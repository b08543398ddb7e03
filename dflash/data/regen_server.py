"""Regenerate through OpenAI-compatible servers (vLLM, SGLang, `transformers serve`): many requests in
flight over several endpoints, each row appended durably when all its turns are answered, failures
retried with backoff and then recorded, and the job's time published on the telemetry wire.

The job runs on one thread (an asyncio loop): its own work, timed as `client_work` and `row_write` on
the client's worker, against the time requests spend at each endpoint (`server_request` on that
endpoint's worker) is what tells dflash-top whether the servers or this client limit throughput.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from dflash.data.formats import DataError, chat_prompt
from dflash.data.regen_output import META, RegenOutput
from dflash.data.regenerate import Answer, Conversation, passes_through, read_shard, request_thinking
from dflash.server_api import ServerError, base_url, chosen_model, model_cards
from dflash.telemetry.wire.vocab import (
    CLIENT_WORK,
    ROW_WRITE,
    SERVER_REQUEST,
    Counter,
    Gauge,
    Role,
    endpoint_gauge,
)

#: answers worth another try: timeouts, conflicts, too early, too many requests, and any server error
RETRY_STATUS = frozenset({408, 409, 425, 429})
#: the longest wait between tries, whatever the backoff or a Retry-After says
MAX_BACKOFF_S = 30.0
#: what a server's error says, at most (it goes into one line of the errors file)
MAX_REASON = 300
#: how long a job waits for a server that is still starting (vLLM loads a large model for minutes)
WAIT_FOR_SERVER_S = 600.0
#: the longest pause between two looks at a server that is starting, and how often the wait is logged
MAX_WAIT_PAUSE_S = 5.0
WAIT_LOG_EVERY_S = 30.0
#: the request the tokenizer check sends (one token of answer)
PROBE = [{"role": "user", "content": "Reply with one word: hello."}]


class RowFailed(Exception):
    """A row that cannot be answered; the message is the reason in the errors file."""


def _retryable(status: int) -> bool:
    return status in RETRY_STATUS or status >= 500


def _detail(r: httpx.Response) -> str:
    text = r.text.strip().replace("\n", " ")
    return f"HTTP {r.status_code}" + (f": {text[:MAX_REASON]}" if text else "")


@dataclass
class Endpoint:
    index: int
    url: str
    worker: object = None
    in_flight: int = 0
    tokens: int = 0
    #: tokens at the last gauge update, for tok/s
    _tokens_seen: int = 0


class ServerJob:
    """One regenerate job against `urls`. `connect()` checks every endpoint (reachable, OpenAI-compatible,
    serving the model, with the target's tokenizer) before anything is written; `run()` does the rows."""

    def __init__(self, urls: list[str], tokenizer, target: str, model: str | None, reasoning: str,
                 concurrency: int, max_tokens: int | None, retries: int = 5, backoff_s: float = 1.0,
                 api_key: str | None = None, timeout_s: float = 600.0, stats=None,
                 log: Callable[[str], None] = print, log_every_s: float = 10.0,
                 wait_for_server_s: float = WAIT_FOR_SERVER_S) -> None:
        from dflash.telemetry import ProfileStats

        self.endpoints = [Endpoint(i, base_url(u)) for i, u in enumerate(urls)]
        self.tokenizer, self.target, self.model, self.reasoning = tokenizer, target, model, reasoning
        self.concurrency, self.max_tokens, self.retries, self.backoff_s = concurrency, max_tokens, retries, backoff_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout_s, connect=10.0)
        self.stats = stats if stats is not None else ProfileStats()
        self.log, self.log_every_s, self.wait_for_server_s = log, log_every_s, wait_for_server_s
        self.sampling: dict = {}
        #: whether the servers return token ids (vLLM's return_token_ids) and take fields beyond OpenAI's
        self.token_ids = False
        for ep in self.endpoints:
            ep.worker = self.stats.worker(f"endpoint{ep.index}", Role.ENDPOINT)
        self.client_worker = None

    # --- start: every endpoint checked, one line for what is wrong ---------------------------------

    async def connect(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            try:
                for ep in self.endpoints:
                    names = [c["id"] for c in await self._ready_cards(client, ep)]
                    self.model = chosen_model(names, self.model, ep.url, "--model")
            except ServerError as e:
                raise DataError(f"endpoint {e}") from None
            flags = {await self._probe(client, ep) for ep in self.endpoints}
            self.token_ids = flags == {True}

    async def _ready_cards(self, client: httpx.AsyncClient, ep: Endpoint) -> list[dict]:
        """`ep`'s model cards once it answers: a server that is not listening yet or answers 502/503/504 is
        still loading its model (vLLM takes minutes), so it is asked again, with a growing pause, until
        `wait_for_server_s` have passed; anything else is refused at once."""
        deadline = time.monotonic() + self.wait_for_server_s
        pause, said = 0.1, 0.0
        while True:
            try:
                return await model_cards(client, ep.url)
            except ServerError as e:
                left = deadline - time.monotonic()
                if not e.not_ready or self.wait_for_server_s <= 0:
                    raise
                if left <= 0:
                    raise ServerError(f"{e} (still not ready after {self.wait_for_server_s:g} s of "
                                      "--wait-for-server)") from None
                if time.monotonic() - said >= WAIT_LOG_EVERY_S:
                    said = time.monotonic()
                    self.log(f"waiting for {ep.url} (model loading?): {str(e).removeprefix(ep.url + ': ')}; "
                             f"giving up in {left:.0f} s")
                await asyncio.sleep(min(pause, left))
                pause = min(pause * 2, MAX_WAIT_PAUSE_S)

    def _chat_body(self, messages: list[dict], max_tokens: int | None, token_ids: bool) -> dict:
        body: dict = {"model": self.model, "messages": messages, **self.sampling}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        if self.reasoning == "off":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        if token_ids:
            body["return_token_ids"] = True
        return body

    async def _probe(self, client: httpx.AsyncClient, ep: Endpoint) -> bool:
        """Whether `ep` returns token ids; raises when its tokenizer or template differ from the target's
        (the prompt it counts for a probe is not the one the target's tokenizer makes)."""
        r = await client.post(f"{ep.url}/v1/chat/completions", json=self._chat_body(PROBE, 1, True))
        token_ids = r.status_code == 200
        if r.status_code in (400, 422):  # a server that refuses fields beyond OpenAI's (transformers serve)
            r = await client.post(f"{ep.url}/v1/chat/completions", json=self._chat_body(PROBE, 1, False))
        if r.status_code != 200:
            raise DataError(f"endpoint {ep.url}: a one-token chat completion failed ({_detail(r)[:200]})")
        j = r.json()
        ours = chat_prompt(PROBE, self.tokenizer, "the tokenizer check", request_thinking(self.reasoning))
        theirs = j.get("prompt_token_ids")
        if theirs is None:
            n = (j.get("usage") or {}).get("prompt_tokens")
            same, said = n == len(ours), f"it counts {n} prompt tokens, {self.target}'s tokenizer {len(ours)}"
        else:
            at = next((i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
                      min(len(theirs), len(ours)))
            same, said = theirs == ours, f"its prompt token ids differ from {self.target}'s from token {at}"
        if not same:
            raise DataError(f"endpoint {ep.url}: its tokenizer or chat template is not --target {self.target}'s "
                            f"({said} for the same chat)")
        return token_ids and "token_ids" in (j.get("choices") or [{}])[0]

    # --- the rows --------------------------------------------------------------------------------

    async def _ask(self, client: httpx.AsyncClient, conv: Conversation) -> Answer:
        """One turn of `conv`, tried on the least busy endpoint, again after a backoff when the answer is
        worth another try."""
        w = self.client_worker
        with w.span(CLIENT_WORK):
            if conv.chat:
                msgs = [{k: v for k, v in m.items() if k != "thinking"} for m in conv.history()]
                path, body = "/v1/chat/completions", self._chat_body(msgs, self.max_tokens, self.token_ids)
            else:
                path = "/v1/completions"
                body = {"model": self.model, "prompt": conv.row["prompt"], **self.sampling}
                if self.max_tokens is not None:
                    body["max_tokens"] = self.max_tokens
                if self.token_ids:
                    body["return_token_ids"] = True
        reason, retry_after = "", None
        for attempt in range(self.retries + 1):
            if attempt:
                self.stats.count(Counter.RETRIES)
                await asyncio.sleep(self._delay(attempt, retry_after))
            ep = min(self.endpoints, key=lambda e: e.in_flight)
            ep.in_flight += 1
            t0 = time.perf_counter()
            try:
                r = await client.post(ep.url + path, json=body)
            except httpx.TransportError as e:
                reason = f"{type(e).__name__}: {e}"[:MAX_REASON]
                continue
            finally:
                ep.in_flight -= 1
                ep.worker.add(SERVER_REQUEST, time.perf_counter() - t0)
            if r.status_code == 200:
                with w.span(CLIENT_WORK):
                    a = _answer(r, conv.chat)
                    n = len(a.token_ids) if a.token_ids is not None else _completion_tokens(r)
                ep.tokens += n
                self.stats.count(Counter.TOKENS, n)
                return a
            reason, retry_after = _detail(r), r.headers.get("retry-after")
            if not _retryable(r.status_code):
                raise RowFailed(reason)
        raise RowFailed(f"{reason} (after {self.retries + 1} tries)")

    def _delay(self, attempt: int, retry_after: str | None) -> float:
        """Exponential backoff with jitter (requests refused together do not return together); a server's
        Retry-After, in seconds, where it gives one."""
        try:
            if retry_after is not None:
                return min(MAX_BACKOFF_S, max(0.0, float(retry_after)))
        except ValueError:
            pass
        return min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    async def run(self, data: Path, lines: range, output: RegenOutput) -> None:
        """Every row of `lines` not yet done: `concurrency` conversations in flight over all endpoints."""
        self.client_worker = self.stats.worker("regen-client", Role.CLIENT)
        self.stats.gauge(Gauge.CONCURRENCY, self.concurrency)
        rows = read_shard(data, lines)
        pending: list[dict] = []
        wrote = asyncio.Event()
        start, total = time.perf_counter(), len(lines)
        finished = False

        def write() -> None:
            if pending:
                with self.client_worker.span(ROW_WRITE):
                    batch = pending[:]
                    pending.clear()
                    output.append(batch)
                self.stats.count(Counter.ROWS, len(batch))
                self.stats.count(Counter.CUT_ROWS, sum(1 for r in batch if r[META].get("cut")))

        def fail(line: int, reason: str) -> None:
            with self.client_worker.span(ROW_WRITE):
                output.error(line, reason)
            self.stats.count(Counter.ROW_ERRORS)

        async def worker(client: httpx.AsyncClient) -> None:
            for line, row, bad in rows:  # one shared iterator: each row is taken by one worker
                if line in output.done:
                    continue
                if bad is not None:
                    fail(line, bad)
                    continue
                if passes_through(row):
                    pending.append({**row, META: {"line": line, "passed": "tool calls"}})
                    wrote.set()
                    continue
                conv = Conversation(line, row, self.reasoning)
                try:
                    while not conv.done:
                        a = await self._ask(client, conv)
                        with self.client_worker.span(CLIENT_WORK):
                            conv.answer(a)
                except RowFailed as e:
                    fail(line, str(e))
                    continue
                with self.client_worker.span(CLIENT_WORK):
                    pending.append(conv.output())
                wrote.set()

        async def writer() -> None:
            # rows finished in the same turn of the loop share one fsync
            while not finished or pending:
                await wrote.wait()
                wrote.clear()
                write()

        async def ticker() -> None:
            last_log = time.perf_counter()
            while True:
                await asyncio.sleep(1.0)
                now = time.perf_counter()
                self._gauges(now - start)
                if now - last_log >= self.log_every_s:
                    last_log = now
                    self.log(self.progress(output, total, now - start))

        done_before = len(output.done)
        self._start_done = done_before
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers,
                                     limits=httpx.Limits(max_connections=self.concurrency + len(self.endpoints),
                                                         max_keepalive_connections=self.concurrency)) as client:
            w_task, t_task = asyncio.create_task(writer()), asyncio.create_task(ticker())
            try:
                await asyncio.gather(*(worker(client) for _ in range(self.concurrency)))
            finally:
                finished = True
                wrote.set()
                await w_task
                t_task.cancel()
        self._gauges(time.perf_counter() - start)
        self.log(self.progress(output, total, time.perf_counter() - start))

    def _gauges(self, elapsed: float) -> None:
        self.stats.gauge(Gauge.IN_FLIGHT, sum(e.in_flight for e in self.endpoints))
        for ep in self.endpoints:
            self.stats.gauge(endpoint_gauge(ep.index, Gauge.IN_FLIGHT), ep.in_flight)
            self.stats.gauge(endpoint_gauge(ep.index, Gauge.TOK_S), ep.tokens - ep._tokens_seen)
            ep._tokens_seen = ep.tokens

    def progress(self, output: RegenOutput, total: int, elapsed: float) -> str:
        """The log's line: rows and tokens per second, what failed or was cut, and the ETA."""
        new = len(output.done) - self._start_done
        tokens = sum(e.tokens for e in self.endpoints)
        rate = new / elapsed if elapsed > 0 else 0.0
        left = max(0, total - len(output.done) - output.failed)
        eta = left / rate if rate > 0 else float("inf")
        if rate > 0:
            self.stats.gauge(Gauge.ETA_S, eta)
        self.stats.gauge(Gauge.PROGRESS, min(1.0, (len(output.done) + output.failed) / max(1, total)))
        return (f"regenerate: {len(output.done):,} rows done ({new:,} now), {output.failed} failed; {rate:.2f} rows/s, "
                f"{tokens / elapsed if elapsed > 0 else 0:.0f} tok/s; ETA "
                + (f"{eta / 60:.1f} min" if eta != float("inf") else "unknown"))


def _completion_tokens(r: httpx.Response) -> int:
    try:
        return int((r.json().get("usage") or {}).get("completion_tokens") or 0)
    except (ValueError, TypeError, AttributeError):
        return 0


def _answer(r: httpx.Response, chat: bool) -> Answer:
    """The first choice of a completion, whichever of the two shapes; anything else fails the row."""
    try:
        choice = r.json()["choices"][0]
        if chat:
            msg = choice["message"]
            text = msg.get("content") or ""
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        else:
            text, reasoning = choice["text"], ""
        ids = choice.get("token_ids")
        if not isinstance(text, str) or not isinstance(reasoning, str) or not (
                ids is None or (isinstance(ids, list) and all(isinstance(i, int) for i in ids))):
            raise TypeError
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        raise RowFailed(f"the server's answer is not a completion ({r.text[:MAX_REASON]})") from None
    return Answer(text, reasoning, str(choice.get("finish_reason") or "stop"), ids)
