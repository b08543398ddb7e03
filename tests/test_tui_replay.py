"""Replay and discovery: a telemetry.jsonl is real input, so these tests write real files and sockets."""

from __future__ import annotations

import os
import queue
import socket
import time
from pathlib import Path

import pytest
from conftest import wait_until

from dflash.telemetry.wire import protocol
from dflash.telemetry.wire.sockets import SocketInfo, discover, group_jobs
from dflash_tui import synthetic
from dflash_tui.ranks import rank_list, rank_socket, rank_sockets
from dflash_tui.sources import (
    AttachError,
    Connection,
    LiveSource,
    ReplaySource,
    SourceUpdate,
    open_source,
    resolve,
)


def drain(q: queue.Queue, until: str | None = None, timeout: float = 10.0) -> list[SourceUpdate]:
    """Updates from a source until one carries state `until` (or the queue stays quiet)."""
    out: list[SourceUpdate] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            u = q.get(timeout=0.3 if until is None else 0.1)
        except queue.Empty:
            if until is None:
                return out
            continue
        out.append(u)
        if until is not None and u.state == until:
            return out
    if until is not None:
        raise AssertionError(f"no {until!r} update within {timeout} s; got {[u.state for u in out]}")
    return out


def frames_of(updates: list[SourceUpdate]) -> list:
    return [f for u in updates for f in u.frames]


def test_replay_at_full_speed_skips_bad_lines(tmp_path: Path) -> None:
    rec = synthetic.write_recording(tmp_path / "telemetry.jsonl", 30)
    with open(rec, "ab") as f:
        # a crash mid-write leaves a fragment, the recorder starts on a new line, the run goes on
        f.write(b'{"type":"snapshot","seq":\n')
        f.write(protocol.encode(synthetic.snapshot(31)))
        f.write(b'{"type":"event","t":1.0,"kind":"info","mess')  # truncated last line
    src = ReplaySource(rec, speed=0)
    q: queue.Queue = queue.Queue()
    src.start(q.put)
    ups = drain(q, Connection.ENDED)
    frames = frames_of(ups)
    errors = [e for u in ups for e in u.errors]
    assert isinstance(frames[0], protocol.Hello)
    assert [f.seq for f in frames if isinstance(f, protocol.Snapshot)] == list(range(1, 32))
    assert len(errors) == 2
    assert "truncated last line" in errors[-1]
    assert "32 frames" not in ups[-1].detail and "2 bad lines" in ups[-1].detail


def test_replay_paces_by_snapshot_time(tmp_path: Path) -> None:
    rec = synthetic.write_recording(tmp_path / "telemetry.jsonl", 21, interval_s=0.5)  # 10 s recorded
    src = ReplaySource(rec, speed=10)
    q: queue.Queue = queue.Queue()
    t0 = time.monotonic()
    src.start(q.put)
    drain(q, Connection.ENDED)
    took = time.monotonic() - t0
    assert 0.7 < took < 4.0, took  # 10 s at 10x is ~1 s


def test_replay_pause_step_and_resume(tmp_path: Path) -> None:
    rec = synthetic.write_recording(tmp_path / "telemetry.jsonl", 10)
    src = ReplaySource(rec, speed=0, paused=True)
    q: queue.Queue = queue.Queue()
    src.start(q.put)
    first = drain(q)
    assert first[0].state == Connection.PAUSED
    assert not [f for f in frames_of(first) if isinstance(f, protocol.Snapshot)]
    src.step()
    stepped = [f for f in frames_of(drain(q)) if isinstance(f, protocol.Snapshot)]
    assert [f.seq for f in stepped] == [1]
    src.step()
    src.step()
    assert [f.seq for f in frames_of(drain(q)) if isinstance(f, protocol.Snapshot)] == [2, 3]
    src.resume()
    rest = drain(q, Connection.ENDED)
    assert [f.seq for f in frames_of(rest) if isinstance(f, protocol.Snapshot)] == list(range(4, 11))
    src.stop()


def test_replay_of_another_protocol_version_says_so(tmp_path: Path) -> None:
    rec = tmp_path / "telemetry.jsonl"
    rec.write_bytes(b'{"type":"hello","proto":99,"run":"x","pid":1,"host":"h","future":{"a":1}}\n')
    src = ReplaySource(rec, speed=0)
    q: queue.Queue = queue.Queue()
    src.start(q.put)
    ups = drain(q, Connection.INCOMPATIBLE)
    assert "protocol v99" in ups[-1].detail and f"v{protocol.PROTO}" in ups[-1].detail


def test_socket_names_and_discovery(tmp_path: Path) -> None:
    info = SocketInfo.from_path(Path("/x/my-run-2-4242-r3.sock"))
    assert (info.run, info.pid, info.rank) == ("my-run-2", 4242, 3)
    assert SocketInfo.from_path(Path("/x/forwarded.sock")).run is None
    d = Path("/tmp") / f"dft-{time.monotonic_ns()}"
    d.mkdir()
    try:
        live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        live.bind(str(d / "alive-1.sock"))
        live.listen(1)
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(d / "stale-2.sock"))
        stale.close()  # the file stays, nobody listens: a trainer killed with SIGKILL
        (d / "notes-3.sock.txt").write_text("not a socket")
        found = {i.run: i.alive for i in discover(d)}
        assert found == {"alive": True, "stale": False}
        assert resolve(str(d / "alive-1.sock")) == d / "alive-1.sock"
        assert isinstance(open_source(d / "alive-1.sock"), LiveSource)
        live.close()
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def test_resolve_run_dir_and_errors(tmp_path: Path) -> None:
    rec = synthetic.write_recording(tmp_path / "run" / "telemetry.jsonl", 2)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert resolve(str(tmp_path / "run"), directory=tmp_path / "nosockets") == rec
    assert resolve(str(rec)) == rec
    assert resolve(None) is None
    with pytest.raises(AttachError, match="no telemetry.jsonl"):
        resolve(str(empty), directory=tmp_path / "nosockets")
    with pytest.raises(AttachError, match="not a socket"):
        resolve("no-such-run", directory=tmp_path / "nosockets")


def test_sockets_of_one_run_group_into_a_job_led_by_rank_0() -> None:
    infos = [SocketInfo.from_path(Path(f"/x/{name}")) for name in
             ("alone-7.sock", "job-11-r1.sock", "job-10-r0.sock", "job-12-r3.sock", "twice-1-r0.sock",
              "twice-2-r0.sock", "forwarded.sock")]
    jobs = [[i.path.name for i in job] for job in group_jobs(infos)]
    assert jobs == [["alone-7.sock"], ["job-10-r0.sock", "job-11-r1.sock", "job-12-r3.sock"],
                    ["twice-1-r0.sock"], ["twice-2-r0.sock"], ["forwarded.sock"]]
    assert rank_list([3, 0, 1, 2, 6, 8, 9]) == "0-3,6,8-9" and rank_list([]) == ""


def test_a_rank_is_found_by_its_reported_socket_or_by_name_and_a_remote_one_is_explained() -> None:
    d = Path("/tmp") / f"dft-{time.monotonic_ns()}"
    d.mkdir()
    listeners = []
    try:
        for name in (f"job-{os.getpid()}-r0.sock", f"job-{os.getpid()}-r1.sock", "job-999999999-r2.sock"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(str(d / name))
            listeners.append(s)
        assert set(rank_sockets("job", d)) == {0, 1}, "rank 2's pid is dead: its file is a leftover"
        here, local = socket.gethostname(), rank_sockets("job", d)
        reported = protocol.ClusterRank(rank=1, host=here, socket=str(d / f"job-{os.getpid()}-r1.sock"))
        assert rank_socket(1, {}, d, reported) == (d / f"job-{os.getpid()}-r1.sock", "")
        assert rank_socket(0, local, d) == (d / f"job-{os.getpid()}-r0.sock", ""), "found by name alone"
        path, why = rank_socket(2, local, d, protocol.ClusterRank(rank=2, host="node-b", socket=str(d / "x.sock")))
        assert path is None and "runs on node-b" in why and "not on this machine" in why
        path, why = rank_socket(2, local, d, protocol.ClusterRank(rank=2, state="silent"))
        assert path is None and "has not reported yet" in why
    finally:
        for s in listeners:
            s.close()
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def _snapshot_seqs(updates: list[SourceUpdate]) -> list[int]:
    return [f.seq for f in frames_of(updates) if isinstance(f, protocol.Snapshot)]


def test_replay_knows_its_length_and_seeks_both_ways(tmp_path: Path) -> None:
    """A 60 s recording (121 snapshots 0.5 s apart), paused: +10 s delivers up to that time at once,
    -10 s starts the stream over (reset) and fast-forwards to the earlier time, and a jump past the
    end stops at the last snapshot."""
    rec = synthetic.write_recording(tmp_path / "telemetry.jsonl", 121, interval_s=0.5)
    src = ReplaySource(rec, speed=1, paused=True)
    q: queue.Queue = queue.Queue()
    src.start(q.put)
    drain(q)
    assert src.end_t - src.start_t == 60.0
    assert src.where() == "0:00 / 1:00 at 1x, paused"
    src.step()
    wait_until(lambda: src.position == src.start_t)
    drain(q)
    src.seek(delta=10)
    wait_until(lambda: src.position == src.start_t + 10)
    assert _snapshot_seqs(drain(q)) == list(range(2, 22)) and src.where() == "0:10 / 1:00 at 1x, paused"
    src.seek(delta=-4)
    wait_until(lambda: src.position == src.start_t + 6)
    back = drain(q)
    assert back[0].reset and _snapshot_seqs(back) == list(range(1, 14))
    src.seek(to=1000)
    wait_until(lambda: src.position == src.end_t)
    assert src.where() == "1:00 / 1:00 at 1x, paused"
    src.stop()


def test_seeking_back_after_the_end_reads_the_recording_again(tmp_path: Path) -> None:
    rec = synthetic.write_recording(tmp_path / "telemetry.jsonl", 21, interval_s=0.5)
    src = ReplaySource(rec, speed=0)
    q: queue.Queue = queue.Queue()
    src.start(q.put)
    drain(q, Connection.ENDED)
    src.seek(to=2)
    wait_until(lambda: src.finished.is_set() and src.position == src.end_t)
    again = drain(q, Connection.ENDED)
    assert again[0].reset and _snapshot_seqs(again) == list(range(1, 22))
    src.stop()


def test_jump_times_parse() -> None:
    from dflash_tui.widgets.jump import parse_time

    assert [parse_time(t, 600) for t in ("90", "1:30", "1:02:03", "50%", " 2:00 ")] == [90, 90, 3723, 300, 120]
    assert [parse_time(t) for t in ("50%", "abc", "-5", "1:2:3:4")] == [None, None, None, None]
