"""Served tau: the acceptance a running vLLM or SGLang server reports for a benchmark's prompts, set
beside dflash's own decode of the same prompts, and the gap between them explained in words.

A drafter that trains well and accepts little when served is the field's most common failure, and the
engines do not say why. So ``dflash eval --endpoint URL --bench ...`` sends each benchmark's prompts to
the server as chat requests (the same turns ``--bench`` decodes, MT-Bench turn by turn after the
server's own reply; the server renders its chat template, ``--thinking`` passed as its
``enable_thinking``; an asyncio httpx client, the one `dflash data regenerate` uses) and
reads the engine's own count of what it accepted:

* vLLM (v1 engine, ``vllm/v1/spec_decode/metrics.py``: ``SpecDecodingProm``): the Prometheus counters
  ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
  ``vllm:spec_decode_num_accepted_tokens`` and ``vllm:spec_decode_num_accepted_tokens_per_pos``
  (labels ``model_name``, ``engine`` and, per position, ``position`` 0 .. num_speculative_tokens - 1),
  exposed by prometheus_client as ``<name>_total``. Read from ``/metrics`` before and after each
  benchmark; the deltas are its rounds. tau = 1 + accepted / drafts (vLLM's own "mean acceptance
  length"), slot k's acceptance = per_pos[k - 1] / drafts. The counters are server-wide: other traffic
  during the run is counted too (run it on a quiet server).
* SGLang (``tokenizer_manager._calculate_spec_decoding_metrics``): each response's ``meta_info``
  (asked for with ``return_meta_info``) carries ``completion_tokens``, ``spec_verify_ct`` (verify rounds)
  and ``spec_accept_length`` = completion_tokens / spec_verify_ct, and ``spec_draft_token_num`` =
  rounds x (``--speculative-num-draft-tokens`` - 1). SGLang's figure counts the first token, which the
  prefill made and no round verified; dflash's tau counts rounds only, so the comparable figure is
  (completion_tokens - 1) / spec_verify_ct summed over responses (both are reported).

The same tau is dflash's (accepted + 1 per round, speculative.py), so the two compare directly: at
temperature 0 on the same prompts both decode the target's greedy text up to its first near-tie, and a
gap beyond noise is a difference in how the drafter runs. ``explain`` names the likely causes from the
evidence at hand: the engine contract check of the export (engine_contracts.py), the draft count the
engine served against the block the drafter trained on, the prompt lengths the server rendered against
dflash's rendering (template / thinking mode), and where along the block the served acceptance falls off.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import asdict, dataclass, field

from dflash.server_api import ServerError, base_url, chosen_model, model_cards

#: the counters vLLM's SpecDecodingProm registers (prometheus_client exposes a counter as <name>_total)
VLLM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
#: far beyond any chat response or metrics page a server sends; a larger body is not one
MAX_BODY_BYTES = 32 << 20
#: a gap is beyond noise when larger than this many standard errors of the two taus ...
NOISE_SIGMAS = 3.0
#: ... and than this share of dflash's tau: at temperature 0 the two decode the same greedy text only up
#: to its first near-tie (bf16 kernels differ between engines), after which the prompts the drafter
#: sees differ, which the per-round spread alone does not capture
NOISE_FLOOR = 0.05

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class ServedError(ServerError):
    """A server that cannot be measured; the message is one line. (The refusals of dflash.server_api are
    ServerErrors: callers catch that base.)"""


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a Prometheus text exposition: (name, labels, value); comments and blank lines skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue  # not a sample line this reader knows; the counters it needs are plain samples
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(2) or "")}
        try:
            out.append((m.group(1), labels, float(m.group(3))))
        except ValueError:
            continue
    return out


@dataclass
class VllmCounters:
    """vLLM's speculative-decoding counters at one moment, summed over engines (and over models unless
    one is named): drafts (rounds), draft tokens, accepted tokens, accepted per position."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)

    def minus(self, before: VllmCounters) -> VllmCounters:
        return VllmCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            {k: v - before.per_pos.get(k, 0.0) for k, v in self.per_pos.items()})


def vllm_counters(text: str, model: str | None = None) -> VllmCounters | None:
    """The counters in a ``/metrics`` page, None when it exports no speculative decoding (a server
    started without ``--speculative-config``). With ``model``, only its samples (label ``model_name``,
    vLLM's served model name), unless no sample carries that name (a renamed label): then all."""
    samples = parse_prometheus(text)
    if model is not None and not any(labels.get("model_name") == model for _, labels, _ in samples):
        model = None
    c, seen = VllmCounters(), False
    for name, labels, value in samples:
        base = name.removesuffix("_total")
        if name.endswith("_created") or not base.startswith("vllm:spec_decode_"):
            continue
        if model is not None and labels.get("model_name", model) != model:
            continue
        seen = seen or base == VLLM_DRAFTS
        if base == VLLM_DRAFTS:
            c.drafts += value
        elif base == VLLM_DRAFT_TOKENS:
            c.draft_tokens += value
        elif base == VLLM_ACCEPTED:
            c.accepted += value
        elif base == VLLM_PER_POS and labels.get("position", "").isdigit():
            k = int(labels["position"])
            c.per_pos[k] = c.per_pos.get(k, 0.0) + value
    return c if seen else None


@dataclass
class ServedResult:
    """One benchmark as the engine served it. ``tau`` is comparable with dflash's (tokens per verify
    round); ``engine_tau`` is the engine's own headline figure (vLLM: the same; SGLang: its
    spec_accept_length, which also counts the prefill's token)."""

    engine: str
    model: str
    requests: int
    rounds: int
    tau: float
    engine_tau: float
    draft_tokens_per_round: float | None  # the draft count the engine ran (block - 1 when served right)
    per_position_acceptance: list[float] | None  # slot k: fraction of rounds it was accepted (vLLM only)
    completion_tokens: int
    first_turn_prompt_tokens: list[int]  # usage.prompt_tokens of each row's first turn, as the server rendered it
    per_request_tau: list[float] = field(default_factory=list)  # SGLang: (completion - 1) / rounds per response
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Server:
    """A server that answered: its base URL, engine (vllm or sglang) and the model name to request."""

    url: str
    engine: str
    model: str


def _client(timeout: float):
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), follow_redirects=False)


def _transport_errors() -> tuple[type[BaseException], ...]:
    import httpx

    return (OSError, httpx.HTTPError)


async def _send(client, url: str, body: dict | None = None):
    """GET (or POST ``body`` as JSON) ``url``; a server that does not answer is one line."""
    try:
        r = await (client.get(url) if body is None else client.post(url, json=body))
    except _transport_errors() as e:
        reason = getattr(e, "reason", None) or str(e) or "no answer"
        raise ServedError(f"{url}: unreachable ({type(e).__name__}: {reason})") from None
    if len(r.content) > MAX_BODY_BYTES:
        raise ServedError(f"{url}: a {len(r.content):,}-byte answer, far larger than any this reads")
    return r


async def _get(client, url: str) -> tuple[int, bytes]:
    r = await _send(client, url)
    return r.status_code, r.content


def _json(body: bytes, what: str):
    import json

    try:
        return json.loads(body)
    except ValueError:
        raise ServedError(f"{what}: not JSON, so not an OpenAI-compatible server") from None


async def probe(client, url: str, model: str | None) -> Server:
    """Which engine serves at ``url`` and which model to ask for, refused in one line: unreachable, not
    OpenAI-compatible, an unknown model, an engine that is neither vLLM nor SGLang."""
    url = base_url(url)
    cards = await model_cards(client, url)  # ServerError, which ServedError extends: one line either way
    model = chosen_model([c["id"] for c in cards], model, url, "--served-model")
    owner = next(str(c.get("owned_by", "")) for c in cards if c["id"] == model).lower()
    engine = "vllm" if "vllm" in owner else "sglang" if "sglang" in owner else None
    if engine is None:  # a proxy may rename the owner: the metrics page still says which engine it is
        status, body = await _get(client, f"{url}/metrics")
        text = body.decode("utf-8", "replace") if status == 200 else ""
        engine = "vllm" if "vllm:" in text else "sglang" if "sglang:" in text else None
    if engine is None:
        raise ServedError(f"{url}: model {model!r} is owned by {owner or 'nobody'!r} and its /metrics names neither "
                          "vLLM nor SGLang; served tau is read from those two engines only")
    return Server(url, engine, model)


async def _read_counters(client, server: Server) -> VllmCounters:
    status, body = await _get(client, f"{server.url}/metrics")
    if status != 200:
        raise ServedError(f"{server.url}/metrics: HTTP {status}; vLLM's speculative-decoding counters are read there")
    c = vllm_counters(body.decode("utf-8", "replace"), server.model)
    if c is None:
        raise ServedError(f"{server.url}/metrics exports no speculative-decoding metrics ({VLLM_DRAFTS}): was vLLM "
                          "started with --speculative-config?")
    return c


async def _settled(client, server: Server, seen: VllmCounters, tries: int = 20) -> VllmCounters:
    """The counters once they stop moving: vLLM records a step's counts as its output is processed,
    which can land just after the last response went out."""
    for _ in range(tries):
        await asyncio.sleep(0.05)
        now = await _read_counters(client, server)
        if now.drafts == seen.drafts:
            return now
        seen = now
    return seen


async def _chat(client, server: Server, messages: list[dict], max_tokens: int, sampling: dict,
                thinking: str) -> dict:
    req = {"model": server.model, "messages": messages, "max_tokens": max_tokens, **sampling}
    if thinking != "auto":
        req["chat_template_kwargs"] = {"enable_thinking": thinking == "on"}
    if server.engine == "sglang":
        req["return_meta_info"] = True  # SGLang attaches meta_info to a chat choice only when asked
    url = f"{server.url}/v1/chat/completions"
    r = await _send(client, url, req)
    if r.status_code == 404 and b"model" in r.content.lower():
        raise ServedError(f"unknown model {server.model!r} at {server.url} (HTTP 404)")
    if r.status_code != 200:
        first = r.text.strip().splitlines()[0][:200] if r.text.strip() else ""
        raise ServedError(f"{url}: HTTP {r.status_code}: {first}")
    d = _json(r.content, url)
    try:
        choice = d["choices"][0]
        text = choice["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise ServedError(f"{url}: no choices[0].message, so not an OpenAI chat completion") from None
    return {"text": text, "usage": d.get("usage") or {}, "meta_info": choice.get("meta_info") or d.get("meta_info")}


async def _serve_row(client, server: Server, turns: list[str], max_tokens: int, sampling: dict, thinking: str,
                     gate: asyncio.Semaphore) -> list[dict]:
    """One row's turns in order, each after the server's own reply to the one before."""
    messages: list[dict] = []
    out = []
    async with gate:
        for turn in turns:
            messages.append({"role": "user", "content": turn})
            resp = await _chat(client, server, messages, max_tokens, sampling, thinking)
            out.append(resp)
            messages.append({"role": "assistant", "content": resp["text"]})
    return out


def _sglang_rounds(responses: list[dict], url: str) -> tuple[int, int, float, float | None, list[float]]:
    """(rounds, tokens verified in rounds, SGLang's own accept length, draft tokens per round, per-request
    tau) from the responses' meta_info."""
    rounds = tokens = drafts = completion = 0
    per_request = []
    for r in responses:
        meta = r["meta_info"] or {}
        ct = meta.get("spec_verify_ct")
        done = meta.get("completion_tokens", (r["usage"] or {}).get("completion_tokens"))
        if not isinstance(ct, (int, float)) or not isinstance(done, (int, float)):
            raise ServedError(f"{url}: responses carry no meta_info.spec_verify_ct: was SGLang started with "
                              "--speculative-algorithm, and is it new enough to honour return_meta_info?")
        if ct > 0:
            rounds += int(ct)
            tokens += int(done) - 1
            completion += int(done)
            drafts += int(meta.get("spec_draft_token_num") or 0)
            per_request.append((int(done) - 1) / int(ct))
    if rounds == 0:
        raise ServedError(f"{url}: no response was speculated (spec_verify_ct 0 in all): no spec-decode metrics "
                          "to read")
    return rounds, tokens, completion / rounds, (drafts / rounds if drafts else None), per_request


async def _serve_benchmark(client, server: Server, name: str, rows: list[list[str]], max_tokens: int,
                           sampling: dict, thinking: str, concurrency: int) -> ServedResult:
    before = await _read_counters(client, server) if server.engine == "vllm" else None
    gate = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    per_row = await asyncio.gather(*[_serve_row(client, server, turns, max_tokens, sampling, thinking, gate)
                                     for turns in rows])
    seconds = time.perf_counter() - t0
    responses = [r for row in per_row for r in row]
    completion = sum(int((r["usage"] or {}).get("completion_tokens") or 0) for r in responses)
    first_prompt = [int((row[0]["usage"] or {}).get("prompt_tokens") or 0) for row in per_row]
    common = dict(engine=server.engine, model=server.model, requests=len(responses), completion_tokens=completion,
                  first_turn_prompt_tokens=first_prompt, seconds=seconds)
    if server.engine == "vllm":
        after = await _settled(client, server, await _read_counters(client, server))
        d = after.minus(before)
        if d.drafts <= 0:
            raise ServedError(f"{server.url}/metrics: {VLLM_DRAFTS} did not move over {len(responses)} requests of "
                              f"{name}: nothing was speculated")
        per_pos = [d.per_pos[k] / d.drafts for k in sorted(d.per_pos)] if d.per_pos else None
        tau = 1 + d.accepted / d.drafts
        return ServedResult(rounds=int(d.drafts), tau=tau, engine_tau=tau,
                            draft_tokens_per_round=d.draft_tokens / d.drafts, per_position_acceptance=per_pos, **common)
    rounds, tokens, engine_tau, drafts, per_request = _sglang_rounds(responses, server.url)
    return ServedResult(rounds=rounds, tau=tokens / rounds, engine_tau=engine_tau, draft_tokens_per_round=drafts,
                        per_position_acceptance=None, per_request_tau=per_request, **common)


def measure_served(url: str, benches: dict[str, list[list[str]]], max_tokens: int, *, temperature: float = 0.0,
                   top_p: float = 1.0, top_k: int = 0, thinking: str = "auto", model: str | None = None,
                   concurrency: int = 8, timeout: float = 600.0) -> tuple[Server, dict[str, ServedResult]]:
    """Every benchmark sent to the server at ``url``, ``concurrency`` rows in flight (an asyncio client),
    each benchmark measured on its own; ServedError (one line) when the server cannot be measured."""
    sampling = {"temperature": temperature, "top_p": top_p}
    if top_k:
        sampling["top_k"] = top_k  # both engines take top_k beside the OpenAI fields

    async def run():
        async with _client(timeout) as client:
            server = await probe(client, url, model)
            if server.engine == "vllm":
                await _read_counters(client, server)  # refused before any request when nothing is exported
            out = {}
            for name, rows in benches.items():
                out[name] = await _serve_benchmark(client, server, name, rows, max_tokens, sampling, thinking,
                                                   concurrency)
            return server, out

    return asyncio.run(run())


def _round_sd(own: dict) -> float:
    """The spread of tokens per round in dflash's own decode (from its histogram of accepted drafts)."""
    hist = own["acceptance_histogram"]
    n = sum(hist)
    if n < 2:
        return 0.0
    mean = sum(a * c for a, c in enumerate(hist)) / n
    return math.sqrt(sum(c * (a - mean) ** 2 for a, c in enumerate(hist)) / (n - 1))


def explain(served: ServedResult, own: dict | None, trained_block: int | None = None,
            own_prompt_tokens: list[int] | None = None, contract: list[str] | None = None) -> dict:
    """Served tau against dflash's own (``own``: an EvalResult's dict on the same prompts): the gap, the
    noise it is judged against, whether it is beyond, and the likely causes, each from evidence."""
    causes: list[str] = []
    if contract:
        causes += [f"the export as this engine reads it: {line}" for line in contract]
    drafts = served.draft_tokens_per_round
    if trained_block is not None and drafts is not None and round(drafts) != trained_block - 1:
        flag = ("--speculative-config num_speculative_tokens" if served.engine == "vllm"
                else "--speculative-num-draft-tokens (the block itself)")
        causes.append(f"block size not carried: served with {drafts:g} draft tokens per round, the drafter trained "
                      f"on block {trained_block} ({trained_block - 1} drafts); set {flag}")
    if own_prompt_tokens and served.first_turn_prompt_tokens:
        pairs = [(s, o) for s, o in zip(served.first_turn_prompt_tokens, own_prompt_tokens, strict=False) if s]
        off = [(s, o) for s, o in pairs if s != o]
        if off:
            causes.append(f"the server rendered {len(off)} of {len(pairs)} prompts differently ({off[0][0]} tokens "
                          f"served vs {off[0][1]} in dflash's rendering): chat template or thinking mode mismatch "
                          "(--thinking, the server's --chat-template / enable_thinking)")
    out = {"served_tau": served.tau, "dflash_tau": None, "gap": None, "noise": None, "beyond_noise": None,
           "causes": causes}
    if own is None:
        return out
    sd = _round_sd(own)
    se = sd * math.sqrt(1 / max(own["rounds"], 1) + 1 / max(served.rounds, 1))
    noise = max(NOISE_SIGMAS * se, NOISE_FLOOR * own["tau"])
    gap = served.tau - own["tau"]
    beyond = abs(gap) > noise
    out.update(dflash_tau=own["tau"], gap=gap, noise=noise, beyond_noise=beyond)
    if not beyond:
        return out
    mine, theirs = own.get("per_position_acceptance") or [], served.per_position_acceptance or []
    if gap < 0 and mine and theirs:
        if theirs[0] < 0.5 * mine[0]:
            causes.append(f"it misses from the first slot (slot 1 accepted {theirs[0]:.2f} served vs {mine[0]:.2f} "
                          "here): the drafter's context is not what it trained on: tap layers off by one "
                          "(vLLM's aux ids are dflash's + 1), a dropped key, or the mask token")
        else:
            k = next((i for i, (t, m) in enumerate(zip(theirs, mine, strict=False)) if t < 0.5 * m), None)
            if k is not None:
                causes.append(f"slot 1 holds ({theirs[0]:.2f} served vs {mine[0]:.2f}) but acceptance falls off from "
                              f"slot {k + 1} ({theirs[k]:.2f} vs {mine[k]:.2f}): the block is attended otherwise as "
                              "served: layer causality or sliding window, or the block size")
    if gap < 0 and not causes:
        causes.append("no contract drift found here: check the tap layers, block size, layer causality and window, "
                      "and the mask token against the engine's loader (`dflash export --check`), and that the "
                      "server renders the chat template and thinking mode as the drafter was trained")
    if gap > 0 and not causes:
        causes.append("the engine accepts more than dflash's own decode: the two decoded different text (sampling, "
                      "or a template the drafter's data matched better as served)")
    return out


def format_served(server: Server, served: dict[str, ServedResult], verdicts: dict[str, dict]) -> str:
    """The served table: per benchmark the engine's tau beside dflash's, the gap, and its causes in words."""
    lines = [f"served by {server.engine} at {server.url} (model {server.model})",
             f"{'benchmark':<15} {'requests':>8} {'rounds':>7} {'served tau':>10} {'dflash tau':>10} {'gap':>7}  "
             "verdict"]
    for name, s in served.items():
        v = verdicts[name]
        own = "-" if v["dflash_tau"] is None else f"{v['dflash_tau']:.2f}"
        gap = "-" if v["gap"] is None else f"{v['gap']:+.2f}"
        verdict = ("served only" if v["beyond_noise"] is None else
                   f"{'GAP beyond' if v['beyond_noise'] else 'within'} noise (+-{v['noise']:.2f})")
        lines.append(f"{name:<15} {s.requests:>8} {s.rounds:>7} {s.tau:>10.2f} {own:>10} {gap:>7}  {verdict}")
        if s.engine == "sglang" and abs(s.engine_tau - s.tau) > 1e-9:
            lines.append(f"  {name}: SGLang's own spec_accept_length {s.engine_tau:.2f} (it also counts the "
                         "prefill's token)")
        if s.per_position_acceptance:
            lines.append(f"  {name}: served acceptance by position: "
                         + " ".join(f"{a:.2f}" for a in s.per_position_acceptance))
        for cause in v["causes"]:
            lines.append(f"  {name}: likely cause: {cause}")
    return "\n".join(lines)
