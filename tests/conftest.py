"""Shared fixtures: code run in a fresh interpreter; for telemetry, a short socket directory and a
line-oriented Unix-socket client."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dflash.telemetry.wire import protocol

REPO = Path(__file__).resolve().parents[1]


def wait_until(cond: Callable[[], object], timeout: float = 10.0, what: str = "the condition",
               proc: subprocess.Popen | None = None, output: Callable[[], str] | None = None) -> None:
    """Poll `cond` until it holds: tests wait on conditions, never on fixed pauses. With `proc`, a
    process that exits first fails at once; `output()` (a log's tail, say) goes into either failure."""
    deadline = time.monotonic() + timeout
    while not cond():
        tail = f":\n{output()}" if output is not None else ""
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited (code {proc.returncode}) before {what}{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}{tail}")
        time.sleep(0.02)


@pytest.fixture(scope="session")
def transformers_server() -> Iterator:
    """One `transformers serve` on the tiny target for the whole session (tests/openai_server.py): each
    start costs seconds, and the files that need a real OpenAI-compatible server share it."""
    from openai_server import transformers_serve

    with transformers_serve() as served:
        yield served


@pytest.fixture(scope="session")
def served(transformers_server) -> str:
    """The session's `transformers serve`, by its URL."""
    return transformers_server.url


@pytest.fixture
def run_python() -> Callable[..., str]:
    """`run_python(code, timeout=60)`: run `code` in a fresh interpreter from the repository root and
    return its stdout; a non-zero exit fails the test with the child's stderr. For what a process
    imports, which this one cannot show once it has imported anything itself."""

    def run(code: str, timeout: float = 60) -> str:
        r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=timeout)
        assert r.returncode == 0, r.stderr
        return r.stdout

    return run



def demo_cache(root: Path, lines: int, taps: str = "1,3,5") -> Path:
    """The tiny target's hidden-state cache of the first `lines` demo rows, as `dflash data cache` writes
    it, in `root/hs` (the rows' JSONL beside it, `root/data.jsonl`, for training in-process)."""
    from dflash.cli import main

    demo = (REPO / "dflash" / "data" / "demo.jsonl").read_text().splitlines()[:lines]
    (root / "data.jsonl").write_text("\n".join(demo) + "\n")
    assert main(["data", "cache", "--target", "tiny", "--data", str(root / "data.jsonl"), "--out", str(root / "hs"),
                 "--target-layer-ids", taps, "--max-seq-len", "256", "--no-telemetry"]) == 0
    return root / "hs"

def train_following(writer: str, writer_args: list[str], dst: Path, log: Path, train_args: list[str],
                    started: str) -> bool:
    """A writer (`python -c writer src dst ...`: the rows and sidecar first, files once `dst/go` exists)
    with `dflash train --hidden-states dst --follow` beside it. Once the trainer says `started` (its
    cache opened before a single file exists) the writer is told to go; the trainer must exit 0 and its
    output is in `log`. Returns whether the writer was still writing when the trainer finished."""
    proc = subprocess.Popen([sys.executable, "-c", writer, *writer_args])
    cmd = [sys.executable, "-m", "dflash", "train", "--target", "tiny", "--hidden-states", str(dst), "--follow",
           *train_args]
    with log.open("w") as out:
        trainer = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_until(lambda: started in log.read_text(), timeout=120, what="the trainer to start", proc=trainer,
                   output=log.read_text)
        assert not list((dst / "hidden_states").glob("hs_*")), "a file was there before the writer was told to go"
        (dst / "go").touch()
        assert trainer.wait(timeout=300) == 0, log.read_text()[-3000:]
        return proc.poll() is None
    finally:
        for p in (trainer, proc):
            p.kill()
            p.wait()


def start_regenerate(args: list[str]) -> tuple[subprocess.Popen, Path]:
    """A real `dflash data regenerate` job with ``args``, and its telemetry socket as it announces it
    (`telemetry: PATH`, read off its output before anything else is waited on)."""
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "data", "regenerate", *args], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = ""
    while not line.startswith("telemetry: "):
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise AssertionError("the job ended before it opened its telemetry socket")
    return proc, Path(line.split(": ", 1)[1].strip())


def bench_quick(script: str, timeout: float = 600) -> dict:
    """The JSON report of `scripts/<script> --quick --json`, run from the repository root (a smoke run
    of a benchmark: its figures mean nothing); a non-zero exit fails with the script's stderr."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--quick", "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A fresh socket directory with a short path (sun_path holds only 107 bytes; tmp_path can be long)."""
    d = Path(tempfile.mkdtemp(prefix="dft-")) / "s"
    yield d
    shutil.rmtree(d.parent, ignore_errors=True)


class LineClient:
    """A real Unix-socket client reading newline-delimited frames, for telemetry tests."""

    def __init__(self, path: Path, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self, timeout: float = 5.0) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame within timeout")
            self.sock.settimeout(left)
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError("server closed the connection")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line

    def frame(self, kind: type | None = None, timeout: float = 5.0) -> protocol.Frame:
        """The next frame (of type `kind`, skipping others)."""
        deadline = time.monotonic() + timeout
        while True:
            f = protocol.decode(self.line(max(0.01, deadline - time.monotonic())))
            if kind is None or isinstance(f, kind):
                return f

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def connect() -> Iterator:
    clients: list[LineClient] = []

    def _connect(path: Path, timeout: float = 5.0) -> LineClient:
        c = LineClient(path, timeout)
        clients.append(c)
        return c

    yield _connect
    for c in clients:
        c.close()


def screen_text(app) -> str:
    """What a running Textual app has on the terminal, as plain text: tests of the TUI assert on this
    (what a user sees), since a widget's own text can be right while the layout hides it."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True, color_system=None,
                      legacy_windows=False)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return console.export_text()


def screen_styles(app, text: str) -> list:
    """The Rich styles the terminal shows `text` in, one per place it appears on one line of the screen
    (the compositor's own strips: what is drawn, whichever widget drew it)."""
    update = app.screen._compositor.render_update(full=True, screen_stack=app._background_screens)
    found = []
    for line in update.strips:
        for strip in line:
            found.extend(seg.style for seg in strip if text in seg.text)
    return found



async def until(pilot, cond: Callable[[], object], what: str = "the condition", timeout: float = 30.0) -> None:
    """`wait_until` for a running Textual app: the app keeps running (pauses) while the test waits."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await pilot.pause(0.05)
