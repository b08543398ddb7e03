"""A regenerate job's token ids, its wait for a server still starting, and its in-process telemetry.

The server is the session's real `transformers serve` (conftest's `served`); where a test needs what only
vLLM does (token ids in the answer, `return_token_ids`), a real HTTP proxy in front of it adds them in
vLLM's documented shape (tests/openai_server.py says how): an imitation of vLLM's format, not vLLM.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
from conftest import REPO, LineClient, start_regenerate, wait_until
from openai_server import ServerProxy, free_port

from dflash.cli import main
from dflash.data.formats import encode_row
from dflash.data.prepare import prepare
from dflash.data.regen_server import ServerJob
from dflash.data.store import TokenStore
from dflash.targets.tiny import TINY_DIR
from dflash.telemetry.wire import protocol
from dflash.telemetry.wire.vocab import GENERATE, ROW_WRITE, Counter

DEMO = REPO / "dflash" / "data" / "demo.jsonl"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TINY_DIR))


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _one_char_ids(tok, text: str) -> list[int]:
    """`text` spelt one character a token: the same text as the tokenizer's own ids, other ids."""
    ids = [i for c in text for i in _ids(tok, c)]
    assert tok.decode(ids) == text
    return ids


def _store_rows(tmp: Path, rows: list[dict], tok) -> tuple[TokenStore, list[str]]:
    src = tmp / "regen.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    said: list[str] = []
    prepare(src, tok, tmp / "store", max_seq_len=256, workers=0, log=said.append)
    return TokenStore(tmp / "store"), said


def test_prepare_stores_the_servers_ids_and_names_rows_whose_ids_are_not_their_text(tmp_path: Path, tok) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    chat = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "Hello world"}]
    served = [_one_char_ids(tok, "Hello") + [im_end], _one_char_ids(tok, "Hello world")]
    assert _one_char_ids(tok, "Hello") != _ids(tok, "Hello")  # re-tokenizing would give other ids
    wrong = _ids(tok, "Goodbye")
    rows = [
        {"messages": chat, "regen": {"line": 1, "token_ids": served}},
        {"prompt": "Say", "response": "Hello", "regen": {"line": 2, "token_ids": [_one_char_ids(tok, "Hello")]}},
        {"messages": chat, "regen": {"line": 3, "token_ids": [served[0], wrong]}},  # turn 2's ids: other text
        {"messages": chat},  # no ids: the text, and nothing said
        {"prompt": "Say", "response": "Hello", "regen": {"line": 5, "token_ids": [wrong]}},
        # ids that are the rendering's text but take in the template's header: not the target's to own
        {"messages": chat[:2], "regen": {"line": 6, "token_ids": [_ids(tok, "assistant\nHello")]}},
    ]
    store, said = _store_rows(tmp_path, rows, tok)
    by_line = {int(line): store[i] for i, line in enumerate(store.lines)}
    plain = encode_row({"messages": chat}, tok, "chat")  # what the text alone gives
    # row 1: the answers are the server's ids, the prompt, headers and end of turn the template's
    ids = [int(i) for i in by_line[1].input_ids]
    assert ids != plain.input_ids
    assert tok.decode(ids) == tok.decode(plain.input_ids)  # the same conversation
    for answer in served:
        body = [i for i in answer if i != im_end]
        at = next(k for k in range(len(ids)) if ids[k:k + len(body)] == body)
        mask = list(by_line[1].loss_mask)
        assert all(mask[at:at + len(body)]) and ids[at + len(body)] == im_end and mask[at + len(body)] == 1
    assert sum(by_line[1].loss_mask) == len(served[0]) - 1 + len(served[1]) + 2  # answers and both ends of turn
    assert list(by_line[2].input_ids) == _ids(tok, "Say") + _one_char_ids(tok, "Hello")
    # rows 3, 5 and 6: their ids are not their answers' text, so the text is stored, and the summary says so
    assert list(by_line[3].input_ids) == plain.input_ids and list(by_line[4].input_ids) == plain.input_ids
    assert list(by_line[5].input_ids) == _ids(tok, "Say") + _ids(tok, "Hello")
    (summary,) = [s for s in said if s.startswith("prepare: ") and "rows," in s]
    assert "2 rows take the server's token ids" in summary, summary
    assert "3 rows' token ids disagree with their text, re-tokenized instead (lines 3, 5, 6: the ids decode " \
           "to other text than the row's answer)" in summary, summary
    assert store.manifest["counts"]["ids_fallback"]["lines"] == [3, 5, 6]
    assert list(by_line[6].input_ids) == encode_row({"messages": chat[:2]}, tok, "chat").input_ids


def test_regenerate_asks_for_vllms_token_ids_and_prepare_trains_on_them(served: str, tmp_path: Path, tok,
                                                                          capsys) -> None:
    demo = [json.loads(line) for line in DEMO.read_text().splitlines()[:4]]
    rows = demo[:2] + [{"messages": [{"role": "user", "content": r["prompt"][:80]},
                                     {"role": "assistant", "content": "old"},
                                     {"role": "user", "content": "more?"},
                                     {"role": "assistant", "content": "older"}]} for r in demo[2:4]]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    with ServerProxy(served, tokenizer=tok) as vllm_like:
        assert main(["data", "regenerate", "--target", "tiny", "--data", str(data), "--out", str(out),
                     "--max-tokens", "10", "--no-telemetry", "--endpoint", vllm_like.url, "--concurrency", "2"]) == 0
    said = capsys.readouterr().out
    assert "token ids kept" in said, said
    assert vllm_like.asked_ids == 1 + 2 + 2 * 2  # the probe, two prompt rows, two chats of two turns
    written = [json.loads(line) for line in out.read_text().splitlines()]
    for row in written:
        ids = row["regen"]["token_ids"]
        answers = [row["response"]] if "response" in row else [m["content"] for m in row["messages"][1::2]]
        assert len(ids) == len(answers)
        for a, i in zip(answers, ids, strict=True):
            assert tok.decode([t for t in i if t != tok.eos_token_id]) == a
    assert main(["data", "prepare", "--target", "tiny", "--data", str(out), "--thinking", "auto",
                 "--out", str(tmp_path / "store")]) == 0
    summary = capsys.readouterr().out
    assert "4 rows take the server's token ids" in summary and "disagree" not in summary, summary


def test_a_server_still_loading_is_waited_for_then_used(served: str, tmp_path: Path, tok) -> None:
    """Nothing listens at first, then a server answers 503 (loading) twice, then it serves: the job
    waits, says so, and starts once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    said: list[str] = []
    waiting = threading.Event()

    def log(line: str) -> None:
        said.append(line)
        if line.startswith("waiting for"):
            waiting.set()

    job = ServerJob([url], tok, "tiny", None, "keep", 1, 4, log=log, wait_for_server_s=120)
    done: list[BaseException | None] = []

    def connect() -> None:
        try:
            asyncio.run(job.connect())
            done.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            done.append(e)

    t = threading.Thread(target=connect)
    t.start()
    assert waiting.wait(60), said  # the job found nothing listening, and said it waits
    late = ServerProxy(served, loading=2, port=port)  # the server starts (still loading its model)
    try:
        t.join(120)
        assert done == [None], done
        assert late.loading == 0  # both 503s were answered, and waited through
    finally:
        late.close()
    assert said[0].startswith(f"waiting for {url} (model loading?): unreachable (ConnectError"), said
    assert job.model and len(said) == 1  # one line for the whole wait (it logs every 30 s at most)


def test_a_server_that_never_comes_is_one_line_after_the_deadline(tmp_path: Path, capsys) -> None:
    data = tmp_path / "in.jsonl"
    data.write_text(DEMO.read_text().splitlines()[0] + "\n")
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["data", "regenerate", "--target", "tiny", "--data", str(data), "--out", str(tmp_path / "o.jsonl"),
                 "--endpoint", url, "--wait-for-server", "0.5", "--no-telemetry"]) == 2
    captured = capsys.readouterr()
    assert f"waiting for {url} (model loading?)" in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "unreachable (ConnectError" in err[0] and "still not ready after 0.5 s" in err[0], err
    assert not (tmp_path / "o.jsonl").exists()


def test_the_in_process_job_speaks_telemetry(tmp_path: Path, sock_dir: Path) -> None:
    """Without --endpoint the job publishes its one worker (the target's generate against the durable
    writes) and its rows and tokens on the same wire as the endpoint path."""
    data = tmp_path / "in.jsonl"
    data.write_text("\n".join(DEMO.read_text().splitlines()[:400]) + "\n")
    proc, socket_path = start_regenerate(["--target", "tiny", "--data", str(data), "--out", str(tmp_path / "o.jsonl"),
                                          "--max-tokens", "24", "--batch-size", "1", "--device", "cpu",
                                          "--socket-dir", str(sock_dir)])
    try:
        client = LineClient(socket_path)
        seen: list[protocol.Snapshot] = []

        def published() -> bool:
            seen.append(client.frame(protocol.Snapshot, timeout=30))
            s = seen[-1]
            return {GENERATE, ROW_WRITE} <= set(s.cumulative.get("regen-target", {})) and \
                s.counters.get(Counter.ROWS, 0) > 0 and s.counters.get(Counter.TOKENS, 0) > 0

        wait_until(published, timeout=120, what="the job's generate and row_write, rows and tokens", proc=proc)
        assert seen[-1].roles.get("regen-target") == "target"
        client.close()
    finally:
        proc.kill()
        proc.wait()
