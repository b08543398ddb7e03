"""The one frame reader: the same bytes give the same frames and the same complaints however they are
cut into pieces, and whether a recording or a live socket carries them."""

from __future__ import annotations

import queue
import random
import socket
import threading
import time
from pathlib import Path

from dflash.telemetry.wire import protocol as P
from dflash.telemetry.wire.reader import FrameReader, read_frames
from dflash_tui import synthetic
from dflash_tui.sources import Connection, LiveSource, ReplaySource, SourceUpdate

NESTED = b'{"type":"event","t":1.0,"kind":"info","message":"m","data":{"x":' + b"[" * 40 + b"]" * 40 + b"}}\n"


def stream(oversized: int = 0) -> bytes:
    """A hello, snapshots, and between them a line that is not JSON, one nested too deep and (when
    asked) one longer than the frame limit."""
    snaps = [P.encode(synthetic.snapshot(i)) for i in range(1, 5)]
    bad = [b"not json at all\n", NESTED] + (
        [b'{"type":"event","x":"' + b"y" * oversized + b'"}\n'] if oversized else [])
    return b"".join([P.encode(synthetic.hello()), snaps[0], *bad, *snaps[1:]])


def outcomes(reader: FrameReader, pieces: list[bytes]) -> list[tuple]:
    reads = [r for piece in pieces for r in reader.feed(piece)] + reader.finish()
    return [(r.lineno, P.to_builtins(r.frame) if r.frame else None, r.error, r.note, r.truncated) for r in reads]


def test_any_split_of_the_bytes_gives_the_same_reads() -> None:
    foreign = P.encode(synthetic.hello()).replace(b'"proto":1', b'"proto":9')
    data = (stream(oversized=100_000) + foreign + P.encode(synthetic.snapshot(50)) + P.encode(synthetic.hello())
            + P.encode(synthetic.snapshot(6)) + b'{"type":"snapshot","seq":7')  # cut off mid-write
    whole = outcomes(FrameReader(limit=65536), [data])
    assert outcomes(FrameReader(limit=65536), [data[i:i + 1] for i in range(len(data))]) == whole
    rng = random.Random(7)
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(data)), 40))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        assert outcomes(FrameReader(limit=65536), pieces) == whole

    used = [f["seq"] for _, f, *_ in whole if f and f["type"] == "snapshot"]
    assert used == [1, 2, 3, 4, 6]  # the v9 segment's snapshot 50 is skipped, and nothing else
    errors = {n: e for n, _, e, _, _ in whole if e}
    assert errors[3].startswith("malformed frame") and "nested deeper" in errors[4]
    assert errors[5] == "line exceeds the 65536-byte limit"
    assert errors[len(whole)] == "truncated last line ignored" and whole[-1][4]
    assert sum(1 for *_, note, _ in whole if note and "protocol v9" in note) == 1


def test_a_line_longer_than_the_limit_is_never_held_whole() -> None:
    reader = FrameReader(limit=1 << 20)
    reads = []
    chunk = b"x" * (64 << 10)
    for _ in range(160):  # 10 MiB without a newline, as a hostile peer would send it
        reads += reader.feed(chunk)
        assert len(reader.lines._buf) <= (1 << 20) + len(chunk)
    reads += reader.feed(b"xx\n" + P.encode(synthetic.snapshot(1)))
    assert [(r.lineno, r.error) for r in reads[:1]] == [(1, f"line exceeds the {1 << 20}-byte limit")]
    assert len(reads) == 2 and isinstance(reads[1].frame, P.Snapshot) and reads[1].lineno == 2


def _serve_once(path: Path, data: bytes) -> threading.Thread:
    """A Unix socket that sends `data` to its first client, in uneven pieces, and hangs up."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            for i in range(0, len(data), 7001):
                conn.sendall(data[i:i + 7001])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def _collect(source, until: Connection, timeout: float = 30.0) -> tuple[list, list[str]]:
    q: queue.Queue[SourceUpdate] = queue.Queue()
    source.start(q.put)
    frames, errors = [], []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                u = q.get(timeout=0.2)
            except queue.Empty:
                continue
            frames += u.frames
            errors += u.errors
            if u.state == until:
                return frames, errors
        raise AssertionError(f"no {until} within {timeout} s")
    finally:
        source.stop()


def test_a_recording_and_a_socket_carrying_the_same_bytes_read_alike(tmp_path: Path) -> None:
    data = stream(oversized=P.MAX_FRAME_BYTES + 10)
    rec = tmp_path / "telemetry.jsonl"
    rec.write_bytes(data)
    sock = tmp_path / "run-1.sock"
    _serve_once(sock, data)

    live_frames, live_errors = _collect(LiveSource(sock, reconnect=False), Connection.DISCONNECTED)
    replay_frames, replay_errors = _collect(ReplaySource(rec, speed=0), Connection.ENDED)
    listed: list[tuple[int, str]] = []
    recorded = list(read_frames(rec, on_error=lambda n, m: listed.append((n, m))))

    as_data = [P.to_builtins(f) for f in live_frames]
    assert as_data == [P.to_builtins(f) for f in replay_frames] == [P.to_builtins(f) for f in recorded]
    assert [f["seq"] for f in as_data if f["type"] == "snapshot"] == [1, 2, 3, 4]
    # the same three complaints, in the same words, whichever way the bytes came
    assert len(live_errors) == len(replay_errors) == len(listed) == 3
    for live, replay, (n, message) in zip(live_errors, replay_errors, listed, strict=True):
        assert live == message and replay == f"telemetry.jsonl:{n}: {message}"
    assert listed[2] == (5, f"line exceeds the {P.MAX_FRAME_BYTES}-byte limit")
