"""Hostile and foreign frames cost one error each, never a traceback, a crash or a rejected file.

Real sockets (a running TelemetryServer), real recordings on disk, and the real `dflash stats` and
`dflash-top --once` commands in subprocesses.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.telemetry import ProfileStats, TelemetryServer
from dflash.telemetry.wire import protocol as P
from dflash.telemetry.wire.reader import read_frames
from dflash_tui import synthetic

NESTED = 1000  # ~2 KB of brackets: what made msgspec raise RecursionError


def _nested_request(rid: int) -> bytes:
    return (b'{"type":"request","id":%d,"op":"stacks","args":{"x":' % rid + b"[" * NESTED + b"]" * NESTED
            + b"}}\n")


def test_decode_bounds_nesting_and_size_before_decoding() -> None:
    for line in (_nested_request(1), b"[" * NESTED, b'{"type":"event","data":' + b"{" * NESTED):
        with pytest.raises(P.ProtocolError):
            P.decode(line)
    # brackets inside strings are text, not nesting; escaped quotes do not end a string
    text = P.encode(P.Event(t=1.0, kind="info", message='a\\"' + "[" * NESTED, data={"k": "]" * NESTED}))
    assert P.decode(text).message.endswith("[" * 10)
    depth = P.MAX_DEPTH - 1  # the event object itself is one level
    ok = b'{"type":"event","t":1,"kind":"x","message":"","data":{"a":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}}"
    assert isinstance(P.decode(ok), P.Event)
    with pytest.raises(P.ProtocolError, match="nested deeper than"):
        P.decode(ok.replace(b"[", b"[[", 1).replace(b"]", b"]]", 1))
    with pytest.raises(P.ProtocolError, match="exceeds the 100-byte limit"):
        P.decode(b'{"type":"bye","t":1,"reason":"' + b"x" * 100 + b'"}', limit=100)


def _depth(value: object) -> int:
    children = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max(map(_depth, children), default=0)


def _bracket_text(rng: random.Random) -> str:
    """Strings of brackets, letters and nothing: the ones that could pass for nesting."""
    return "".join(rng.choice("[]{}[]{}ab") for _ in range(rng.choice((0, 0, 1, 2, 5))))


def _value(rng: random.Random, depth: int) -> object:
    if depth == 0:
        return rng.choice((_bracket_text(rng), 1, None))
    kids = [_value(rng, depth - 1 if i == 0 else rng.randrange(min(depth, 3))) for i in range(rng.randint(1, 3))]
    rng.shuffle(kids)
    return kids if rng.random() < 0.5 else {_bracket_text(rng) + str(i): kid for i, kid in enumerate(kids)}


def test_the_nesting_bound_counts_brackets_outside_strings_only() -> None:
    """Every depth around the bound, with strings of brackets (empty ones too) beside and between the
    real ones: a line is refused exactly when its value nests deeper than MAX_DEPTH, with or without
    escapes in it."""
    rng = random.Random(7)
    for trial in range(400):
        value = _value(rng, rng.randint(P.MAX_DEPTH - 3, P.MAX_DEPTH + 3))
        if trial % 4 == 0:  # an escaped quote sends the line down the other path
            value = [value, 'say "[["']
        line = json.dumps(value, separators=(",", ":")).encode()
        assert (b"\\" in line) == (trial % 4 == 0)
        if _depth(value) > P.MAX_DEPTH:
            with pytest.raises(P.ProtocolError, match="nested deeper than"):
                P.check_bounds(line)
        else:
            P.check_bounds(line)


@pytest.fixture
def server(sock_dir: Path, tmp_path: Path):
    srv = TelemetryServer("t", ProfileStats(), interval_s=0.05, run_dir=tmp_path / "run", socket_dir=sock_dir).start()
    yield srv
    srv.close()


def test_nested_requests_get_one_error_reply_each_and_the_log_stays_clean(server, connect, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="dflash.telemetry")
    c = connect(server.path)
    c.frame(P.Hello)
    c.send(b"".join(_nested_request(i) for i in range(100)))
    replies = [c.frame(P.Reply) for _ in range(100)]
    assert all(not r.ok and f"nested deeper than {P.MAX_DEPTH} levels" in r.error for r in replies)
    c.send(b'{"type":"request","id":7,"op":"ptrace_allow"}\n')
    assert c.frame(P.Reply).id == 7  # the same connection is still served
    assert [r for r in caplog.records if r.name.startswith("dflash.telemetry")] == []


def test_a_request_over_64_kib_is_refused_even_when_it_arrives_whole(server, connect) -> None:
    c = connect(server.path)
    c.frame(P.Hello)
    big = P.encode(P.Request(id=3, op="ptrace_allow", args={"pad": "x" * 120_000}))
    c.send(big)
    r = c.frame(P.Reply)
    assert not r.ok and f"exceeds the {64 * 1024}-byte limit" in r.error, r
    c.send(P.encode(P.Request(id=4, op="ptrace_allow")))
    assert c.frame(P.Reply).id == 4


def _recording(path: Path, middle: list[bytes]) -> Path:
    """hello, snapshots 1-5, the given raw lines, snapshots 6-8: a run with something odd inside."""
    with path.open("wb") as f:
        f.write(P.encode(synthetic.hello()))
        for i in range(1, 6):
            f.write(P.encode(synthetic.snapshot(i)))
        f.writelines(middle)
        for i in range(6, 9):
            f.write(P.encode(synthetic.snapshot(i)))
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


def _top_once(rec: Path) -> subprocess.CompletedProcess:
    return _run("-c", "import sys; from dflash_tui.cli import main; sys.exit(main())", "--once", "--json",
                "--timeout", "30", str(rec))


NESTED_EVENT = b'{"type":"event","t":1767225600.5,"kind":"info","message":"m","data":{"x":' + \
    b"[" * NESTED + b"]" * NESTED + b"}}\n"


def test_a_nested_event_in_a_recording_is_one_skipped_line(tmp_path: Path) -> None:
    rec = _recording(tmp_path / "telemetry.jsonl", [NESTED_EVENT])
    errors: list[tuple[int, str]] = []
    seqs = [f.seq for f in read_frames(rec, on_error=lambda n, m: errors.append((n, m)))
            if isinstance(f, P.Snapshot)]
    assert seqs == list(range(1, 9)) and errors == [(7, f"frame nested deeper than {P.MAX_DEPTH} levels")]

    stats = _run("-m", "dflash", "stats", str(rec), "--json")
    assert stats.returncode == 0, stats.stderr
    assert "line 7: frame nested deeper" in stats.stderr and "Traceback" not in stats.stderr
    assert json.loads(stats.stdout)

    top = _top_once(rec)
    assert top.returncode == 0, top.stderr
    summary = json.loads(top.stdout)
    assert summary["seq"] == 8 and any("nested deeper" in e for e in summary["errors"]), summary["errors"]


def test_a_segment_of_another_protocol_version_is_skipped_not_the_whole_file(tmp_path: Path) -> None:
    """A resumed run appended by a trainer of another version: its segment is skipped with a note."""
    foreign_hello = P.encode(synthetic.hello()).replace(b'"proto":1', b'"proto":2')
    assert b'"proto":2' in foreign_hello
    foreign = [foreign_hello, P.encode(synthetic.snapshot(100)), P.encode(synthetic.snapshot(101)),
               P.encode(synthetic.hello())]
    rec = _recording(tmp_path / "telemetry.jsonl", foreign)
    errors: list[tuple[int, str]] = []
    seqs = [f.seq for f in read_frames(rec, on_error=lambda n, m: errors.append((n, m)))
            if isinstance(f, P.Snapshot)]
    assert seqs == list(range(1, 9))
    assert len(errors) == 1 and errors[0][0] == 7 and "protocol v2" in errors[0][1]

    top = _top_once(rec)
    assert top.returncode == 0, top.stderr
    summary = json.loads(top.stdout)
    assert summary["seq"] == 8 and summary["connection"] == "ended", summary["connection"]
    assert any("protocol v2" in e for e in summary["errors"])
