"""`dflash-top --pid`: a real torch training script, sampled with the real py-spy from outside.

The script trains a tiny model from a DataLoader whose dataset sleeps for each item, so its training
thread waits on its loader most of the time however busy the machine is: the sampled view must find
the forward, backward and optimizer step, and judge it input-bound. CI runs as root, so py-spy may
attach; without py-spy the tests are skipped, not faked.
"""

from __future__ import annotations

import io
import json
import queue
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import screen_text, wait_until
from test_tui_live import until
from textual.widgets import OptionList

from dflash.telemetry.wire import verdicts
from dflash.telemetry.wire.protocol import Snapshot
from dflash_tui import cli
from dflash_tui.app import DFlashTop
from dflash_tui.headless import summarize_source
from dflash_tui.jobs import RecordSettings, take_record
from dflash_tui.pyspy import RecordReport, StackReport, find_pyspy
from dflash_tui.sampling.processes import torch_processes
from dflash_tui.sources import Connection, ReplaySource, SampledSource, SourceUpdate
from dflash_tui.widgets.picker import ChoiceScreen
from dflash_tui.widgets.stacks import StacksScreen

pytestmark = pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed")

TRAINER = """
import time
import torch
from torch.utils.data import DataLoader, Dataset

torch.set_num_threads(1)  # a small model: one intra-op thread, on purpose

class Slow(Dataset):
    def __len__(self):
        return 10**6
    def __getitem__(self, i):
        time.sleep(0.01)  # reading from a slow disk: 80 ms a batch, many times the step
        return torch.randn(64), torch.randn(1)

model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, (x, y) in enumerate(DataLoader(Slow(), batch_size=8)):
    for _ in range(8):  # micro-batches: a step long enough for a few samples to land in it
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
    opt.step()
    opt.zero_grad()
    if step == 0:
        print("ready", flush=True)
"""


@pytest.fixture(scope="module")
def trainer() -> Iterator[subprocess.Popen]:
    p = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    yield p
    p.kill()
    p.wait()


def drain(source: SampledSource, timeout: float = 120) -> list[SourceUpdate]:
    """Every update of a source that ends by itself (its duration), waiting on that end."""
    q: queue.Queue[SourceUpdate] = queue.Queue()
    got: list[SourceUpdate] = []
    source.start(q.put)

    def ended() -> bool:
        while not q.empty():
            got.append(q.get())
        return any(u.state == Connection.ENDED for u in got)

    try:
        wait_until(ended, timeout, "the sampling to end")
    finally:
        source.stop()
    return got


def test_a_torch_script_sampled_from_outside_is_input_bound(trainer: subprocess.Popen, tmp_path: Path) -> None:
    rec = tmp_path / "sampled.jsonl"
    updates = drain(SampledSource(trainer.pid, window_s=1, duration=4, record_to=rec))
    assert updates[0].state == Connection.SAMPLING and f"pid {trainer.pid}" in updates[0].detail
    snaps = [f for u in updates for f in u.frames if isinstance(f, Snapshot)]
    assert len(snaps) >= 3, [u.detail for u in updates if u.state]
    last = snaps[-1]
    cats = {c: st.share for c, st in last.cumulative["MainThread"].items()}
    assert cats["batch_queue_wait"] >= verdicts.THRESHOLD, cats
    assert {"drafter_forward", "drafter_backward", "optimizer_step"} & set(cats), cats
    assert last.bottleneck is not None and last.bottleneck.verdict == verdicts.INPUT_BOUND.name, last.bottleneck
    assert last.sampling is not None and last.sampling.total_samples > last.sampling.samples > 0
    assert last.system is not None and any(t.name == "MainThread" for t in last.system.threads)
    # the recording replays as the same run, still marked sampled
    out = io.StringIO()
    assert summarize_source(ReplaySource(rec, speed=0), str(rec), as_json=False, timeout=30, out=out) == 0
    assert "sampled: py-spy --nonblocking" in out.getvalue() and "input-bound" in out.getvalue()


def test_once_pid_prints_the_summary_and_bad_flags_are_one_line(trainer: subprocess.Popen, capsys) -> None:
    assert cli.main(["--once", "--pid", str(trainer.pid), "--duration", "2"]) == 0
    text = capsys.readouterr().out
    assert f"pid {trainer.pid}" in text, (trainer.pid, text[:300])
    assert "sampled: py-spy --nonblocking at 100 Hz" in text
    assert "MainThread/batch_queue_wait" in text and "bottleneck (whole sampling" in text
    assert cli.main(["--duration", "3"]) == 2
    assert "add --pid PID" in capsys.readouterr().err
    assert cli.main(["--once", "--pid", "999999999"]) == 2
    err = capsys.readouterr().err
    assert "no such process" in err and len(err.strip().splitlines()) == 1
    assert any(p.pid == trainer.pid for p in torch_processes())


async def test_dashboard_marks_sampled_figures_and_s_dumps_the_process(trainer: subprocess.Popen) -> None:
    app = DFlashTop(source=SampledSource(trainer.pid, window_s=1), pyspy_timeout=30)
    async with app.run_test(size=(160, 50)) as pilot:
        await until(pilot, lambda: "batch_queue_wait" in screen_text(app) and "INPUT-BOUND" in screen_text(app),
                    "the sampled bars and verdict", timeout=90)
        screen = screen_text(app)
        assert "SAMPLING" in screen and "SAMPLED  py-spy --nonblocking 100 Hz" in screen
        assert "samples/thread ±" in screen and "never pauses it" in screen
        assert "sampled: share of" in screen and "MainThread" in screen
        await pilot.press("s")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen), "the stacks screen", timeout=60)
        await until(pilot, lambda: app.screen.result is not None, "the dump", timeout=60)
        report = app.screen.result
        assert isinstance(report, StackReport), getattr(report, "reason", report)
        assert report.pid == trainer.pid and any(t.name == "MainThread" for t in report.threads)
        await until(pilot, lambda: "hot-thread snapshot (py-spy" in screen_text(app), "the dump on screen")



async def test_with_no_trainer_the_picker_offers_torch_processes(trainer: subprocess.Popen, tmp_path: Path) -> None:
    app = DFlashTop(None, socket_directory=tmp_path / "no-sockets")
    async with app.run_test(size=(120, 30)) as pilot:
        title = "no dflash trainer answers: sample a Python process using torch"
        await until(pilot, lambda: isinstance(app.screen, ChoiceScreen) and title in screen_text(app),
                    "the process picker", timeout=30)
        options = app.screen.query_one(OptionList)
        options.highlighted = [pid for _, pid in app.screen.choices].index(trainer.pid)  # scrolled into view
        await until(pilot, lambda: str(trainer.pid) in screen_text(app), "our trainer in the list")
        await pilot.press("enter")
        await until(pilot, lambda: "SAMPLED  py-spy" in screen_text(app), "the sampled dashboard", timeout=60)
        assert app.source is not None and app.source.watched is not None and app.source.watched.pid == trainer.pid


def test_r_records_a_watched_process_without_a_trainer_to_ask(trainer: subprocess.Popen) -> None:
    report = take_record(None, trainer.pid, RecordSettings(seconds=1, gil=False, native=False), exe=find_pyspy(),
                         run_dir=None, request_timeout=1)
    assert isinstance(report, RecordReport), getattr(report, "reason", report)
    assert report.samples > 0 and any("MainThread" in name for name in report.threads), report.threads


def test_native_sampling_says_it_pauses_the_process(trainer: subprocess.Popen, capsys) -> None:
    assert cli.main(["--once", "--json", "--pid", str(trainer.pid), "--duration", "1", "--native"]) == 0
    summary = json.loads(capsys.readouterr().out)
    sm = summary["sampling"]
    assert sm["native"] is True and sm["tool"] == "py-spy --native" and "stops the process" in sm["cost"]
    assert summary["pid"] == trainer.pid and "MainThread" in summary["workers"]
