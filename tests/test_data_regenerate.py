"""`dflash data regenerate` against a real OpenAI-compatible server: `transformers serve` with the tiny
target from its directory (nothing downloaded), started once for the session (conftest's `served`). Faults
come from a small proxy in front of it (real sockets, real answers, a few refused)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import REPO, screen_text, start_regenerate, until, wait_until
from openai_server import ServerProxy, free_port

from dflash.cli import main
from dflash.data.formats import DataError, encode_row, iter_rows
from dflash.data.regen_output import RegenOutput, errors_path
from dflash.data.regen_server import ServerJob
from dflash.data.regenerate import Conversation, shard_lines
from dflash.targets.tiny import TINY_DIR
from dflash.telemetry.wire.vocab import Counter

DEMO = REPO / "dflash" / "data" / "demo.jsonl"
TOKENS = 12


def _rows(tmp: Path, n: int, chats: int = 0) -> Path:
    """The first `n` demo prompt rows, then `chats` two-turn conversations built from later ones."""
    demo = [json.loads(line) for line in DEMO.read_text().splitlines()]
    rows: list[dict] = demo[:n]
    for r in demo[n:n + chats]:
        rows.append({"messages": [{"role": "user", "content": r["prompt"][:120]},
                                  {"role": "assistant", "content": "old answer"},
                                  {"role": "user", "content": "and then?"},
                                  {"role": "assistant", "content": "another old answer"}]})
    path = tmp / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _regen(data: Path, out: Path, *extra: str) -> int:
    return main(["data", "regenerate", "--target", "tiny", "--data", str(data), "--out", str(out),
                 "--max-tokens", str(TOKENS), "--no-telemetry", "--log-every", "60", *extra])


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow  # needs the session's transformers serve
def test_server_gives_the_in_process_tokens_turn_by_turn(served: str, tmp_path: Path) -> None:
    data = _rows(tmp_path, 10, chats=3)
    assert _regen(data, tmp_path / "server.jsonl", "--endpoint", served, "--concurrency", "4") == 0
    assert _regen(data, tmp_path / "here.jsonl", "--batch-size", "1") == 0
    server, here = _lines(tmp_path / "server.jsonl"), _lines(tmp_path / "here.jsonl")
    assert [r["regen"]["line"] for r in server] == list(range(1, 14))  # input order once complete
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_DIR))
    for a, b in zip(server[:10], here[:10], strict=True):
        # what `dflash data prepare` reads: the same tokens and mask from both paths
        ea, eb = encode_row(a, tok, "server"), encode_row(b, tok, "here")
        assert (ea.input_ids, ea.loss_mask) == (eb.input_ids, eb.loss_mask)
        assert sum(ea.loss_mask) > 0
    for a, b in zip(server[10:], here[10:], strict=True):
        # `transformers serve` strips the whitespace around a chat answer's text (vLLM's token ids keep it)
        assert [m["content"].strip() for m in a["messages"]] == [m["content"].strip() for m in b["messages"]]
    chat = server[-1]["messages"]
    assert chat[1]["content"] != "old answer" and chat[3]["content"] != "another old answer"
    # the second turn was asked given the regenerated first turn, not the old one
    again = httpx.post(f"{served}/v1/chat/completions", timeout=60, json={
        "messages": chat[:3], "max_tokens": TOKENS, "temperature": 0}).json()
    assert again["choices"][0]["message"]["content"] == chat[3]["content"]
    assert server[0]["regen"]["cut"] is True and server[0]["regen"]["finish"] == ["length"]
    assert list(iter_rows(tmp_path / "server.jsonl"))  # prepare's reader takes the file


@pytest.mark.slow  # needs the session's transformers serve
def test_kill_9_then_resume_equals_an_uninterrupted_run(served: str, tmp_path: Path) -> None:
    data = _rows(tmp_path, 24)
    assert _regen(data, tmp_path / "whole.jsonl", "--endpoint", served, "--concurrency", "2") == 0
    out = tmp_path / "killed.jsonl"
    cmd = [sys.executable, "-m", "dflash", "data", "regenerate", "--target", "tiny", "--data", str(data),
           "--out", str(out), "--max-tokens", str(TOKENS), "--no-telemetry", "--endpoint", served,
           "--concurrency", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_until(lambda: out.exists() and out.read_text().count("\n") >= 6, timeout=120, what="6 rows written",
               proc=proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 6 <= out.read_text().count("\n") < 24  # killed mid-run
    with out.open("a") as f:
        f.write('{"prompt": "a row torn by the kill')  # an append the kill cut short
    assert subprocess.run([*cmd, "--resume"], cwd=REPO, env=env, capture_output=True).returncode == 0
    assert out.read_text() == (tmp_path / "whole.jsonl").read_text()


def _job(url: str, **kw) -> ServerJob:
    from transformers import AutoTokenizer

    job = ServerJob([url], AutoTokenizer.from_pretrained(str(TINY_DIR)), "tiny", None, "keep", 2, TOKENS,
                    backoff_s=0.01, log=lambda line: None, **kw)
    asyncio.run(job.connect())
    job.sampling = {"temperature": 0.0}
    return job


def _run(job: ServerJob, data: Path, out: Path) -> RegenOutput:
    output = RegenOutput(out, {"test": 1}, resume=False)
    asyncio.run(job.run(data, shard_lines(data, (0, 1)), output))
    return output


@pytest.mark.slow  # needs the session's transformers serve
def test_refused_requests_are_retried_and_counted_and_a_failing_row_is_recorded(served: str,
                                                                                 tmp_path: Path) -> None:
    data = _rows(tmp_path, 6)
    rows = _lines(data)
    marker = rows[3]["prompt"][:40]
    proxy = ServerProxy(served, [429, 500, 503], always=json.dumps(marker)[1:-1])
    try:
        job = _job(proxy.url, retries=3)
        output = _run(job, data, tmp_path / "out.jsonl")
    finally:
        proxy.close()
    counters = job.stats.drain().counters
    assert counters[Counter.RETRIES] == 3 + 3  # the three refusals, and the failing row's three retries
    assert counters[Counter.ROWS] == 5 and counters[Counter.ROW_ERRORS] == 1
    assert sorted(output.done) == [1, 2, 3, 5, 6]
    (err,) = _lines(errors_path(tmp_path / "out.jsonl"))
    assert err["line"] == 4 and "HTTP 500" in err["reason"] and "after 4 tries" in err["reason"]


@pytest.mark.slow  # needs the session's transformers serve
def test_bad_input_is_one_line_each(served: str, tmp_path: Path, capsys) -> None:
    data = _rows(tmp_path, 2)
    closed = free_port()
    bad_tpl = tmp_path / "other"
    shutil.copytree(TINY_DIR, bad_tpl)
    tpl = bad_tpl / "chat_template.jinja"
    tpl.write_text("{{ 'You are a helpful assistant.' }}" + tpl.read_text())
    for extra, said in ((["--endpoint", f"http://127.0.0.1:{closed}", "--wait-for-server", "0"],
                         "unreachable (ConnectError"),
                        (["--endpoint", served, "--model", "nope"], "does not serve model 'nope'"),
                        (["--endpoint", served + "/v1/models/x"], "not an OpenAI-compatible server"),
                        (["--endpoint", served, "--sampling", "{"], "--sampling: not JSON"),
                        (["--endpoint", served, "--shard", "3/2"], "--shard 3/2: K must be 0..N-1")):
        assert _regen(data, tmp_path / "never.jsonl", *extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
        assert not (tmp_path / "never.jsonl").exists()  # nothing written before the checks pass
    assert main(["data", "regenerate", "--target", str(bad_tpl), "--data", str(data), "--out",
                 str(tmp_path / "never.jsonl"), "--endpoint", served, "--no-telemetry"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer or chat template is not --target" in err[0], err

    # malformed rows: counted, skipped, named; a tool-call row is passed through intact
    tool = {"messages": [{"role": "user", "content": "time?"},
                         {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "now"}}]},
                         {"role": "tool", "content": "12:00"}, {"role": "assistant", "content": "noon"}]}
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(data.read_text() + "{not json\n" + json.dumps({"text": "plain"}) + "\n" + json.dumps(tool) + "\n")
    assert _regen(mixed, tmp_path / "mixed-out.jsonl", "--endpoint", served) == 0
    errors = {e["line"]: e["reason"] for e in _lines(errors_path(tmp_path / "mixed-out.jsonl"))}
    assert set(errors) == {3, 4} and "not valid JSON" in errors[3] and "'text' row has no prompt" in errors[4]
    out = _lines(tmp_path / "mixed-out.jsonl")
    assert len(out) == 3 and out[2]["messages"] == tool["messages"] and out[2]["regen"]["passed"] == "tool calls"
    assert "2 rows failed" in capsys.readouterr().out


def test_resume_refuses_other_settings_and_a_new_run_refuses_an_existing_output(tmp_path: Path) -> None:
    RegenOutput(tmp_path / "o.jsonl", {"model": "a"}, resume=False).append(
        [{"prompt": "p", "response": "r", "regen": {"line": 1}}])
    with pytest.raises(DataError, match="exists: --resume"):
        RegenOutput(tmp_path / "o.jsonl", {"model": "a"}, resume=False)
    with pytest.raises(DataError, match=r"other settings \(model differ\)"):
        RegenOutput(tmp_path / "o.jsonl", {"model": "b"}, resume=True)
    assert RegenOutput(tmp_path / "o.jsonl", {"model": "a"}, resume=True).done.keys() == {1}


def test_shards_in_process_merge_into_the_whole_run(tmp_path: Path) -> None:
    data = _rows(tmp_path, 7, chats=1)
    assert _regen(data, tmp_path / "whole.jsonl", "--max-tokens", "4") == 0
    parts = [tmp_path / f"part{k}.jsonl" for k in range(3)]
    for k, part in enumerate(parts):
        assert _regen(data, part, "--max-tokens", "4", "--shard", f"{k}/3") == 0
    assert [len(_lines(p)) for p in parts] == [2, 3, 3]
    assert main(["data", "merge", *map(str, parts), "--out", str(tmp_path / "merged.jsonl")]) == 0
    assert (tmp_path / "merged.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
    assert main(["data", "merge", str(parts[0]), str(parts[0]), "--out", str(tmp_path / "twice.jsonl")]) == 2


def test_reasoning_keep_drop_off() -> None:
    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]}
    from dflash.data.regenerate import Answer

    for mode, want in (("keep", {"role": "assistant", "content": "answer", "reasoning_content": "think"}),
                       ("drop", {"role": "assistant", "content": "answer"})):
        for a in (Answer("<think>think</think>\n\nanswer"), Answer("answer", reasoning="think")):
            c = Conversation(1, row, mode)
            c.answer(a)
            assert c.output()["messages"][1] == want, (mode, a)


@pytest.mark.slow  # needs the session's transformers serve
async def test_dflash_top_shows_a_running_job(served: str, tmp_path: Path, sock_dir: Path) -> None:
    """dflash-top attached to a regenerate job: its endpoint and client workers, their categories and a
    regenerate verdict on the screen."""
    from dflash_tui.app import DFlashTop

    data = _rows(tmp_path, 200)
    proc, socket_path = start_regenerate(["--target", "tiny", "--data", str(data), "--out", str(tmp_path / "o.jsonl"),
                                          "--max-tokens", "48", "--endpoint", served, "--concurrency", "4",
                                          "--socket-dir", str(sock_dir)])
    try:
        app = DFlashTop(socket_path)
        async with app.run_test(size=(140, 44)) as pilot:
            def shown() -> bool:
                text = screen_text(app)
                return all(w in text for w in ("endpoint0", "regen-client", "server_request")) and (
                    "SERVER-BOUND" in text or "CLIENT-BOUND" in text)

            await until(pilot, shown, "the job's workers, categories and verdict", timeout=60)
    finally:
        proc.kill()
        proc.wait()


def test_verdict_tells_a_server_bound_job_from_a_client_bound_one() -> None:
    from dflash.telemetry.verdict.evidence import agrees_with_evidence, analyze
    from dflash.telemetry.wire.protocol import CategoryStats

    def cs(share: float, p95: float = 0.1) -> CategoryStats:
        return CategoryStats(n=10, total=share, mean=0.1, p50=0.1, p95=p95, max=p95, share=share)

    roles = {"endpoint0": "endpoint", "endpoint1": "endpoint", "regen-client": "client"}
    for client_busy, want in ((0.1, "server-bound"), (0.8, "client-bound")):
        b = analyze({"endpoint0": {"server_request": cs(1.0, 2.5)}, "endpoint1": {"server_request": cs(0.6)},
                     "regen-client": {"client_work": cs(client_busy * 0.75), "row_write": cs(client_busy * 0.25)}},
                    roles)
        assert b.verdict == want and agrees_with_evidence(b), b
        assert b.evidence["endpoints.busy"] == 0.8 and b.evidence["server.p95_s"] == 2.5
    assert analyze({"endpoint0": {}, "regen-client": {}}, roles).verdict == "unknown"
