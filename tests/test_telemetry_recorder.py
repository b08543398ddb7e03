"""telemetry.jsonl: the tolerant reader, crash-and-resume recordings, and `dflash stats` on them
(run as a real `dflash` process)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash.telemetry import ProfileStats, TelemetryServer
from dflash.telemetry.publish.recorder import Recorder
from dflash.telemetry.summary import Summary, to_snapshot
from dflash.telemetry.wire import protocol as P
from dflash.telemetry.wire.reader import read_frames

REPO = Path(__file__).resolve().parents[1]


def _snap(seq: int, fwd: float, wait: float, tokens: float, window: float = 1.0) -> P.Snapshot:
    def cs(total: float, n: int = 10) -> P.CategoryStats:
        return P.CategoryStats(n=n, total=total, mean=total / n, p50=total / n, p95=total / n * 2, max=total / n * 3,
                               share=total / window)

    workers = {"target-0": {"target_forward": cs(fwd)},
               "drafter-0": {"hs_queue_wait": cs(wait), "drafter_forward": cs(1 - wait)}}
    cumulative = {
        w: {c: P.CategoryStats(n=s.n * seq, total=s.total * seq, mean=s.mean, p50=s.p50, p95=s.p95, max=s.max,
                               share=s.share)
            for c, s in cats.items()}
        for w, cats in workers.items()
    }
    summ = Summary(t=1000.0 + seq * window, window_s=window, workers=workers, cumulative=cumulative,
                   counters={"tokens": tokens})
    return to_snapshot(summ, seq, 1.0)


def _write(path: Path, frames: list, tail: bytes = b"") -> None:
    with open(path, "wb") as f:
        for fr in frames:
            f.write(P.encode(fr))
        f.write(tail)


def _hello(started: float = 1000.0) -> P.Hello:
    return P.Hello(proto=P.PROTO, run="rec", pid=42, host="box", started=started)


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    full = P.encode(_snap(3, 0.5, 0.5, 30))
    _write(p, [_hello(), _snap(1, 0.5, 0.5, 10), _snap(2, 0.5, 0.5, 20)], tail=full[: len(full) // 2])
    frames = list(read_frames(p, strict=True))
    assert [type(f).__name__ for f in frames] == ["Hello", "Snapshot", "Snapshot"]


def test_corrupt_middle_line_is_reported(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    _write(p, [_hello()])
    with open(p, "ab") as f:
        f.write(b'{"type":"snapshot","seq":\n')
        f.write(P.encode(_snap(2, 0.5, 0.5, 20)))
    errors: list[tuple[int, str]] = []
    frames = list(read_frames(p, on_error=lambda n, m: errors.append((n, m))))
    assert len(frames) == 2 and errors and errors[0][0] == 2
    with pytest.raises(P.ProtocolError, match="line 2"):
        list(read_frames(p, strict=True))


def test_recorder_resumes_on_a_fresh_line_after_a_crash(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    full = P.encode(_snap(1, 0.5, 0.5, 10))
    _write(p, [_hello()], tail=full[:40])  # the previous run died mid-write
    rec = Recorder(p)
    rec.write(P.encode(_hello(2000.0)))
    rec.write(P.encode(_snap(1, 0.5, 0.5, 5)))
    rec.close()
    errors: list = []
    frames = list(read_frames(p, on_error=lambda n, m: errors.append(n)))
    assert [type(f).__name__ for f in frames] == ["Hello", "Hello", "Snapshot"]
    assert errors == [2]  # the fragment is one bad line, not glued to the new hello


def test_recorder_survives_a_full_disk() -> None:
    rec = Recorder("/dev/full")  # every flush fails with ENOSPC
    rec.write(b"x\n" * 10)
    rec.flush()
    rec.write(b"more\n")
    rec.close()  # no exception anywhere
    assert rec.failed is not None and "No space" in rec.failed


def _dflash(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dflash", "stats", *args], capture_output=True, text=True, cwd=REPO, timeout=60
    )


@pytest.fixture
def recording(tmp_path: Path) -> Path:
    p = tmp_path / "telemetry.jsonl"
    # drafters starve early, then the targets catch up
    snaps = [_snap(i, 0.9, 0.6 if i <= 3 else 0.05, 100.0 * i) for i in range(1, 7)]
    full = P.encode(_snap(7, 0.9, 0.1, 700))
    _write(p, [_hello(), *snaps, P.Bye(t=1007.0, reason="done")], tail=full[:25])
    return p


def test_stats_whole_run(recording: Path) -> None:
    r = _dflash(str(recording))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "run 'rec' on box (pid 42): whole run: 6 windows" in out
    header = next(line for line in out.splitlines() if line.startswith("category"))
    assert header.split()[:3] == ["category", "n", "total"]
    # cumulative of the last snapshot: target_forward 0.9 * 6 = 5.4 s, n = 60
    row = next(line for line in out.splitlines() if line.startswith("target-0/target_forward"))
    assert row.split()[1:3] == ["60", "5.40s"]
    assert "counters: tokens 600" in out
    assert "ended: done" in out


def test_stats_last_n_and_json(recording: Path) -> None:
    r = _dflash(str(recording), "--last", "2", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["scope"] == "last 2 windows" and data["windows"] == 2
    assert data["wall_s"] == 2.0
    wait = data["workers"]["drafter-0"]["hs_queue_wait"]
    assert wait["n"] == 20 and wait["total"] == pytest.approx(0.1)
    assert data["rates"]["tokens"] == pytest.approx(100.0)
    assert data["bottleneck"]["verdict"] == "balanced"
    early = json.loads(_dflash(str(recording), "--json").stdout)
    assert early["windows"] == 6
    first3 = _dflash(str(recording), "--last", "6", "--by", "category")
    assert first3.returncode == 0 and first3.stdout.splitlines()[2].split()[0] == "target_forward"


def test_stats_errors_are_one_line(tmp_path: Path) -> None:
    r = _dflash(str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "no such file" in r.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    r = _dflash(str(empty))
    assert r.returncode == 2 and "no snapshot frames" in r.stderr
    r = _dflash(str(tmp_path))
    assert r.returncode == 2 and "is a directory" in r.stderr
    junk = tmp_path / "junk.jsonl"
    junk.write_text("hello\nworld\n")
    r = _dflash(str(junk))
    assert r.returncode == 2 and "warning: skipped malformed line 1" in r.stderr
    r = _dflash(str(junk), "--last", "0")
    assert r.returncode == 2 and "--last" in r.stderr


def test_stats_on_a_live_server_recording_with_resume(tmp_path: Path, sock_dir: Path) -> None:
    """Two real server runs append to one recording (crash-free resume); stats sums the segments."""
    for _ in range(2):
        stats = ProfileStats()
        srv = TelemetryServer("live", stats, interval_s=0.05, run_dir=tmp_path, socket_dir=sock_dir,
                              system=False).start()
        w = stats.worker("target-0")
        for _ in range(5):
            w.add("target_forward", 0.01)
            stats.count("tokens", 10)
            time.sleep(0.03)
        srv.close()
    frames = list(read_frames(tmp_path / "telemetry.jsonl", strict=True))
    assert [type(f).__name__ for f in frames].count("Hello") == 2
    r = _dflash(str(tmp_path / "telemetry.jsonl"), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["scope"] == "whole run (2 segments)"
    assert data["workers"]["target-0"]["target_forward"]["n"] == 10
    assert data["counters"]["tokens"] == 100
