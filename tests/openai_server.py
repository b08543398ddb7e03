"""A real OpenAI-compatible server for the regenerate tests, and a real HTTP proxy in front of it.

`transformers serve` (transformers' own server) serves the tiny target from its directory, nothing
downloaded; the session starts it once (conftest's `served`), as starting one costs seconds of the suite.
The proxy sits between a job and that server on real sockets and changes only what a test asks for:
requests refused (429/5xx) or always failing, a server still loading (503 on everything), and the token
ids vLLM returns, which `transformers serve` does not.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from dflash.targets.tiny import TINY_DIR


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    url: str
    pid: int


@contextmanager
def transformers_serve() -> Iterator[Served]:
    """`transformers serve` on the tiny target, on the CPU with one thread, in float32 as the in-process
    path runs it (in float16 the two differ in the last bits, and greedy answers in near-ties)."""
    import pytest
    from conftest import wait_until

    exe = shutil.which("transformers", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("transformers' CLI is not installed beside this interpreter")
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"dflash-serve-{port}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                                 "--dtype", "float32", "--log-level", "warning", str(TINY_DIR)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/v1/models", timeout=1.0).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, timeout=120, what="transformers serve to answer /v1/models", proc=proc,
                   output=lambda: log.read_text()[-2000:])
        yield Served(url, proc.pid)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.unlink(missing_ok=True)


def vllm_token_ids(request: dict, answer: dict, tokenizer) -> dict:
    """`answer` (a chat or text completion) with the token-id fields vLLM adds when a request sets
    `return_token_ids: true`, in vLLM's documented shape: `prompt_token_ids` at the top level, each
    choice's generated ids in `choices[i].token_ids`, ending with the stop token when the answer stopped
    (vLLM's ids keep it). This imitates vLLM; it is not vLLM: the ids are the tiny target's tokenizer's
    canonical ones for the prompt and the answer's text."""
    if "messages" in request:
        kwargs = request.get("chat_template_kwargs") or {}
        text = tokenizer.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True,
                                             **kwargs)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        prompt = tokenizer(request["prompt"], add_special_tokens=False)["input_ids"]
    out = {**answer, "prompt_token_ids": prompt, "choices": []}
    for choice in answer["choices"]:
        said = choice["message"]["content"] if "message" in choice else choice["text"]
        ids = tokenizer(said or "", add_special_tokens=False)["input_ids"]
        if choice.get("finish_reason") == "stop":
            ids.append(tokenizer.eos_token_id)
        out["choices"].append({**choice, "token_ids": ids})
    return out


class ServerProxy:
    """A proxy in front of a real server (`upstream`), on `port` (0: any free one):

    * `plan`: status codes answered, in turn, to completions before any is forwarded (429, 500, ...); the
      start's one-token probe passes;
    * `always`: a completion whose body contains it always gets 500;
    * `loading`: how many requests (of any kind) get 503, as a server still loading its model answers;
    * `tokenizer`: answer `return_token_ids` as vLLM does (`vllm_token_ids`); without it the field is
      forwarded, and `transformers serve` refuses it, as it refuses any field beyond OpenAI's.
    """

    def __init__(self, upstream: str, plan: list[int] = (), always: str | None = None, loading: int = 0,
                 tokenizer=None, port: int = 0) -> None:
        proxy = self
        self.upstream, self.plan, self.always, self.loading = upstream, list(plan), always, loading
        self.tokenizer, self.seen, self.asked_ids = tokenizer, 0, 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a) -> None:
                pass

            def _reply(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _loading(self) -> bool:
                if proxy.loading > 0:
                    proxy.loading -= 1
                    self._reply(503, b'{"error": "the model is loading"}')
                    return True
                return False

            def do_GET(self) -> None:
                if self._loading():
                    return
                r = httpx.get(proxy.upstream + self.path, timeout=60)
                self._reply(r.status_code, r.content)

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                proxy.seen += 1
                if self._loading():
                    return
                if proxy.always and proxy.always.encode() in body:
                    return self._reply(500, b'{"error": "this row always fails"}')
                request = json.loads(body)
                if request.get("max_tokens") != 1 and proxy.plan:
                    return self._reply(proxy.plan.pop(0), b'{"error": "busy"}')
                ids = proxy.tokenizer is not None and request.pop("return_token_ids", False)
                if ids:
                    proxy.asked_ids += 1
                    body = json.dumps(request).encode()
                r = httpx.post(proxy.upstream + self.path, content=body, timeout=60,
                               headers={"content-type": "application/json"})
                if ids and r.status_code == 200:
                    return self._reply(200, json.dumps(vllm_token_ids(request, r.json(), proxy.tokenizer)).encode())
                self._reply(r.status_code, r.content)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> ServerProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
