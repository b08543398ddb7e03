"""`dflash eval --endpoint URL --bench ...`: served tau read from a running engine, beside dflash's own.

vLLM and SGLang cannot run here (no GPU stack), so each test starts a real HTTP server on a real local
socket (a thread) that answers as the engine documents it, and dflash talks to it over HTTP:

* vLLM: ``/v1/models`` cards ``owned_by: vllm``; OpenAI chat completions; ``/metrics`` produced by
  prometheus_client itself (the library vLLM exposes with) from counters registered exactly as vLLM's
  ``SpecDecodingProm`` registers them (``vllm:spec_decode_num_drafts`` ... ``_per_pos``, labels
  ``model_name``, ``engine``, ``position``), advanced per request by a planned acceptance;
* SGLang: cards ``owned_by: sglang``; chat choices carry ``meta_info`` (``completion_tokens``,
  ``spec_verify_ct``, ``spec_accept_length`` = completion / verify, ``spec_draft_token_num``) when the
  request asks with ``return_meta_info``, as ``tokenizer_manager._calculate_spec_decoding_metrics`` fills it.

The prompt token counts the fake engines return come from rendering the request's messages with the
built-in target's real tokenizer and chat template, as a server does. A constructed drift (served
acceptance far below dflash's, a block size not carried, a template rendered otherwise) is caught and
explained; bad input is one line each.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash.cli import main
from dflash.eval.served import ServedResult, explain, parse_prometheus, vllm_counters
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.write_export import export_drafter
from dflash.targets import load_target

FIXTURES = Path(__file__).parent / "fixtures" / "bench"
MODEL = "Qwen/Qwen3-8B"


class Engine:
    """A vLLM- or SGLang-speaking server on 127.0.0.1 (see the module docstring). Every chat request is
    answered with ``completion`` tokens over ``rounds`` verify rounds accepting ``accepted`` drafts each
    (cycled), ``spec_tokens`` drafts per round."""

    def __init__(self, engine: str, tokenizer, accepted=(2, 1, 0), spec_tokens: int = 3, spec_metrics: bool = True,
                 system_prompt: str | None = None):
        self.engine, self.tokenizer, self.accepted, self.spec_tokens = engine, tokenizer, list(accepted), spec_tokens
        self.system_prompt = system_prompt  # a server whose template adds a system turn: renders otherwise
        self.requests: list[dict] = []
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
              registry=self.registry).labels(MODEL, "0").set(0)
        if spec_metrics:
            self.drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", labels,
                                  registry=self.registry).labels(MODEL, "0")
            self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", labels,
                                        registry=self.registry).labels(MODEL, "0")
            self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                           labels, registry=self.registry).labels(MODEL, "0")
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                              labels + ["position"], registry=self.registry)
            self.per_pos = [per_pos.labels(MODEL, "0", str(p)) for p in range(spec_tokens)]
        self.spec_metrics = spec_metrics
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def _prompt_tokens(self, req: dict) -> int:
        messages = req["messages"]
        if self.system_prompt:
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        kwargs = req.get("chat_template_kwargs") or {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat(self, req: dict) -> dict:
        with self.lock:
            self.requests.append(req)
            start = 3 * len(self.requests)  # three verify rounds per request, the planned acceptances cycled
            rounds = [self.accepted[i % len(self.accepted)] for i in range(start, start + 3)]
            if self.engine == "vllm" and self.spec_metrics:  # what SpecDecodingProm.observe adds for these rounds
                self.drafts.inc(len(rounds))
                self.draft_tokens.inc(len(rounds) * self.spec_tokens)
                self.accepted_tokens.inc(sum(rounds))
                for a in rounds:
                    for p in range(a):
                        self.per_pos[p].inc()
        completion = 1 + sum(a + 1 for a in rounds)  # the prefill's token, then each round's
        prompt = self._prompt_tokens(req)
        choice = {"index": 0, "message": {"role": "assistant", "content": "Natalia sold 48 clips in April.",
                                          "reasoning_content": None, "tool_calls": []},
                  "logprobs": None, "finish_reason": "length", "stop_reason": None}
        if self.engine == "sglang" and req.get("return_meta_info"):
            choice["meta_info"] = {"id": "x", "finish_reason": {"type": "length", "length": completion},
                                   "prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": 0,
                                   "spec_accept_rate": sum(rounds) / (len(rounds) * self.spec_tokens),
                                   "spec_accept_length": completion / len(rounds),
                                   "spec_accept_token_num": sum(rounds),
                                   "spec_draft_token_num": len(rounds) * self.spec_tokens,
                                   "spec_verify_ct": len(rounds) if self.spec_metrics else 0}
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": req["model"],
                "choices": [choice], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                               "total_tokens": prompt + completion}}

    def _handler(self):
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: bytes, kind: str = "application/json"):
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/v1/models":
                    card = {"id": MODEL, "object": "model", "created": 0, "owned_by": engine.engine, "root": MODEL}
                    self._send(200, json.dumps({"object": "list", "data": [card]}).encode())
                elif self.path == "/metrics" and engine.engine == "vllm":
                    self._send(200, generate_latest(engine.registry), "text/plain; version=0.0.4")
                else:
                    self._send(404, b'{"detail":"Not Found"}')

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if req.get("model") != MODEL:
                    body = {"object": "error", "message": f"The model `{req.get('model')}` does not exist.",
                            "type": "NotFoundError", "code": 404}
                    self._send(404, json.dumps(body).encode())
                else:
                    self._send(200, json.dumps(engine.chat(req)).encode())

        return Handler


@pytest.fixture(scope="module")
def tiny():
    return load_target("tiny", device="cpu", num_draft_layers=1)


@pytest.fixture(scope="module")
def export(tiny, tmp_path_factory):
    """An untrained block-4 drafter exported as vLLM and SGLang load it."""
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(tiny.config, num_layers=1, block_size=4, target_layer_ids=tiny.layer_ids,
                                   mask_token_id=tiny.default_mask_token_id())
    out = tmp_path_factory.mktemp("served") / "export"
    export_drafter(DFlashDrafter(cfg), out)
    return out


def run_cli(capsys, *args) -> tuple[int, str, str]:
    rc = main(["eval", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def bench_args(url: str, *more: str) -> list[str]:
    return ["--endpoint", url, "--bench", "gsm8k", "--bench-dir", str(FIXTURES), "--num-prompts", "2",
            "--max-new-tokens", "8", *more]


def test_vllm_counters_read_what_prometheus_client_exposes(tiny):
    """Both directions against prometheus_client: our reader on its exposition; its parser on the same text."""
    with Engine("vllm", tiny.tokenizer) as e:
        e.chat({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        text = generate_latest(e.registry).decode()
    c = vllm_counters(text, MODEL)
    assert (c.drafts, c.draft_tokens, c.accepted) == (3, 9, 3) and c.per_pos == {0: 2, 1: 1, 2: 0}
    theirs = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "vllm:spec_decode_num_drafts_total"}
    mine = {n: v for n, _, v in parse_prometheus(text) if n == "vllm:spec_decode_num_drafts_total"}
    assert mine == theirs == {"vllm:spec_decode_num_drafts_total": 3.0}
    two = text + 'vllm:spec_decode_num_drafts_total{engine="0",model_name="another-model"} 5.0\n'
    assert vllm_counters(two, MODEL).drafts == 3 and vllm_counters(two).drafts == 8  # the model asked for only
    assert vllm_counters('vllm:num_requests_running{engine="0"} 0.0\n') is None


def test_served_tau_from_vllm_counters_as_deltas(tiny, capsys):
    with Engine("vllm", tiny.tokenizer, accepted=(3, 2, 1)) as e:
        e.chat({"model": MODEL, "messages": [{"role": "user", "content": "traffic before the run"}]})
        rc, out, err = run_cli(capsys, *bench_args(e.url, "--json"))
    assert rc == 0, err
    s = json.loads(out)["served"]["gsm8k"]
    assert s["engine"] == "vllm" and s["requests"] == 2 and s["rounds"] == 6  # the earlier request is not counted
    assert s["tau"] == pytest.approx(1 + 12 / 6) and s["draft_tokens_per_round"] == 3
    assert s["per_position_acceptance"] == pytest.approx([1.0, 4 / 6, 2 / 6])
    assert s["dflash_tau"] is None and s["beyond_noise"] is None  # no --drafter: served only


def test_served_tau_from_sglang_meta_info(tiny, capsys):
    with Engine("sglang", tiny.tokenizer, accepted=(3, 3, 3)) as e:
        rc, out, err = run_cli(capsys, *bench_args(e.url, "--json", "--thinking", "off"))
        assert all(r["return_meta_info"] is True for r in e.requests)
        assert all(r["chat_template_kwargs"] == {"enable_thinking": False} for r in e.requests)
    s = json.loads(out)["served"]["gsm8k"]
    assert rc == 0 and s["engine"] == "sglang" and s["rounds"] == 6
    assert s["tau"] == pytest.approx(4.0)  # (completion - 1) / rounds: rounds only, as dflash counts
    assert s["engine_tau"] == pytest.approx(13 / 3)  # SGLang's own, with the prefill's token
    assert s["draft_tokens_per_round"] == 3


def test_beside_dflash_a_block_not_carried_is_caught_and_named(tiny, export, capsys):
    """The drafter trained on block 4 (3 drafts) and dflash's own tau on it is ~1 (untrained); the engine
    serves 7 drafts a round and reports tau 3: a gap beyond noise, its cause named."""
    with Engine("vllm", tiny.tokenizer, accepted=(2, 2, 2), spec_tokens=7) as e:
        rc, out, err = run_cli(capsys, *bench_args(e.url, "--drafter", str(export), "--target", "tiny",
                                                    "--device", "cpu"))
    assert rc == 1 and "served tau differs beyond noise on gsm8k" in err
    assert "GAP beyond noise" in out
    assert "block size not carried: served with 7 draft tokens per round, the drafter trained on block 4" in out
    assert "gsm8k" in out.splitlines()[1]  # dflash's own table first, then the served one


def test_same_prompts_same_drafts_no_gap(tiny, export, capsys):
    """Served as trained (3 drafts, nothing accepted, as dflash's untrained drafter): within noise, and the
    server rendered every prompt exactly as dflash did (no template cause)."""
    with Engine("vllm", tiny.tokenizer, accepted=(0,), spec_tokens=3) as e:
        rc, out, err = run_cli(capsys, *bench_args(e.url, "--drafter", str(export), "--target", "tiny",
                                                    "--device", "cpu", "--json"))
    d = json.loads(out)
    v = d["served"]["gsm8k"]
    assert rc == 0, err
    assert v["beyond_noise"] is False and v["causes"] == [] and v["dflash_tau"] == d["benchmarks"]["gsm8k"]["tau"]


def test_a_template_rendered_otherwise_is_named(tiny, export, capsys):
    with Engine("vllm", tiny.tokenizer, accepted=(0,), system_prompt="You are a helpful assistant.") as e:
        rc, out, err = run_cli(capsys, *bench_args(e.url, "--drafter", str(export), "--target", "tiny",
                                                    "--device", "cpu", "--json"))
    causes = json.loads(out)["served"]["gsm8k"]["causes"]
    assert any("rendered 2 of 2 prompts differently" in c and "chat template or thinking mode" in c for c in causes)


def _served(tau: float, per_pos: list[float], rounds: int = 400) -> ServedResult:
    return ServedResult("vllm", MODEL, 40, rounds, tau, tau, 15.0, per_pos, 4000, [])


OWN = {"tau": 6.5, "rounds": 400, "acceptance_histogram": [20] * 15 + [100],
       "per_position_acceptance": [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25]}


def test_served_far_below_is_explained_by_where_it_falls_off():
    """A constructed drift: dflash's own decode accepts 6.5 per round; served, 1.3."""
    v = explain(_served(1.3, [0.2] + [0.01] * 14), OWN, trained_block=16)
    assert v["beyond_noise"] and v["gap"] == pytest.approx(-5.2)
    assert any("misses from the first slot" in c and "tap layers off by one" in c for c in v["causes"])
    v = explain(_served(3.0, [0.93, 0.9, 0.3] + [0.05] * 12), OWN, trained_block=16)
    assert any("falls off from slot 3" in c and "causality or sliding window" in c for c in v["causes"])
    v = explain(_served(6.4, OWN["per_position_acceptance"]), OWN, trained_block=16)
    assert not v["beyond_noise"] and v["causes"] == []
    v = explain(_served(1.3, [0.2] + [0.01] * 14), OWN, trained_block=16,
                contract=["vllm: tap layers (target_layer_ids) is [0, 4] as served, [1, 5] as trained"])
    assert v["causes"][0].startswith("the export as this engine reads it: vllm: tap layers")


def test_bad_input_is_one_line(tiny, capsys):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    rc = main(["eval", *bench_args(dead)])
    err = capsys.readouterr().err
    assert rc == 2 and "unreachable" in err and len(err.strip().splitlines()) == 1

    class NotOpenAI(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "13")
            self.end_headers()
            self.wfile.write(b"<html></html>")

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc = main(["eval", *bench_args(f"http://127.0.0.1:{server.server_address[1]}")])
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert rc == 2 and "not an OpenAI-compatible server (GET /v1/models answered HTTP 200: <html></html>)" in err

    with Engine("vllm", tiny.tokenizer, spec_metrics=False) as e:
        rc = main(["eval", *bench_args(e.url)])
        err = capsys.readouterr().err
        assert rc == 2 and "exports no speculative-decoding metrics" in err and not e.requests
        rc = main(["eval", *bench_args(e.url, "--served-model", "Qwen/Qwen3-32B")])
        err = capsys.readouterr().err
        assert rc == 2 and "does not serve model 'Qwen/Qwen3-32B'" in err and "it serves: Qwen/Qwen3-8B" in err
    with Engine("sglang", tiny.tokenizer, spec_metrics=False) as e:
        rc = main(["eval", *bench_args(e.url)])
        assert rc == 2 and "no response was speculated" in capsys.readouterr().err
    rc = main(["eval", "--endpoint", "http://127.0.0.1:1"])
    assert rc == 2 and "--endpoint needs --bench" in capsys.readouterr().err
