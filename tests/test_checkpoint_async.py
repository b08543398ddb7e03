"""Checkpoints written in the background: the drafter thread only takes a host snapshot; the write keeps
every guarantee of a synchronous one (atomic file, manifest, safe read-back), one save at a time, a
failed one is one warning, and the run does not end with a save half written.

Real trainers on a tiny random target and real files; where a test needs the write to be still in
flight, it holds the real writer at a gate before it starts.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from test_model_helpers import make_target_dir, make_tokenizer, one_thread  # noqa: F401
from test_train_pipeline import _cfg, _params, _write_data

from dflash.checkpoint_files import checkpoint_dir, list_checkpoints, load_checkpoint, read_manifest
from dflash.train.checkpoint.checkpointer import checkpoint_bytes, default_interval
from dflash.train.checkpoint.writer import CheckpointWriter, HostSnapshot, Written
from dflash.train.trainer import Trainer

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckptasync")
    target = make_target_dir(root / "target", layers=4, tokenizer=make_tokenizer())
    return target, _write_data(root / "data.jsonl")


def _wired(setup, run_dir: Path, lines: list[str], **kw) -> Trainer:
    """A trainer with its parts built and wired, not started: the test plays the drafter thread."""
    target, data = setup
    t = Trainer(_cfg(target, data, run_dir, **kw), log=lines.append)
    t.setup()
    t._wire()
    return t


def _gate(writer: CheckpointWriter) -> threading.Event:
    """Hold the writer's real write until the returned event is set."""
    gate, write = threading.Event(), writer.write

    def held(step: int, state):
        gate.wait()
        return write(step, state)

    writer.write = held
    return gate


def test_a_save_returns_with_its_write_in_flight_and_writes_the_step_it_was_taken_at(setup, tmp_path):
    lines: list[str] = []
    t = _wired(setup, tmp_path / "run", lines)
    ck = t.checkpoints
    t.state.step = 5
    before = _params(t)
    gate = _gate(ck.writer)
    assert ck.save() is None  # returned on the snapshot, not on the write
    assert ck.writer.busy and not list_checkpoints(tmp_path / "run")
    with torch.no_grad():  # the next optimizer steps change the live weights in place ...
        for p in t.drafter.drafter.parameters():
            p.add_(1.0)
    gate.set()
    ck.close()
    [path] = list_checkpoints(tmp_path / "run")
    state = load_checkpoint(path, read_manifest(tmp_path / "run")[0][path.name])  # size and sha256 verified
    assert state["state"]["step"] == 5
    for k, v in before.items():  # ... and the file holds the step the save was taken at
        assert torch.equal(state["drafter"][k], v), k
    assert any("[checkpoint] saved step-00000005.pt" in x and "in the background" in x for x in lines), lines


def test_the_next_save_waits_for_the_previous_one_and_reuses_its_buffers(setup, tmp_path):
    t = _wired(setup, tmp_path / "run", [], keep_checkpoints=5)
    ck = t.checkpoints
    order: list[str] = []
    write = ck.writer.write
    gate = threading.Event()

    def traced(step: int, state):
        order.append(f"start {step}")
        if step == 1:
            gate.wait()
        path = write(step, state)
        order.append(f"end {step}")
        return path

    ck.writer.write = traced
    t.state.step = 1
    ck.save()
    first = dict(ck.snapshot._buffers)
    t.state.step = 2
    second = threading.Thread(target=ck.save)
    second.start()  # waits in save() for step 1's write ...
    gate.set()  # ... which may now finish
    second.join()
    ck.close()
    assert order == ["start 1", "end 1", "start 2", "end 2"]
    assert all(ck.snapshot._buffers[k] is b for k, b in first.items())  # no second set of host buffers
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000001.pt", "step-00000002.pt"]


def test_a_failed_background_write_is_one_warning_and_failed_at_the_end(setup, tmp_path):
    lines: list[str] = []
    run = tmp_path / "run"
    t = _wired(setup, run, lines)
    checkpoint_dir(run).parent.mkdir(parents=True, exist_ok=True)
    checkpoint_dir(run).write_text("not a directory")  # every write fails
    t.state.step = 3
    assert t.checkpoints.save() is None
    t.checkpoints.close()
    assert t.checkpoints.failed
    warnings = [x for x in lines if x.startswith("[warning] checkpoint")]
    assert len(warnings) == 1, lines
    assert "step-00000003.pt not saved" in warnings[0] and "training continues, next try in" in warnings[0]
    checkpoint_dir(run).unlink()
    t.state.step = 4  # the next try works and clears the flag
    assert t.checkpoints.save(final=True) == checkpoint_dir(run) / "step-00000004.pt"
    assert not t.checkpoints.failed
    t.checkpoints.close()


def test_a_run_waits_for_its_final_checkpoint_and_sizes_the_interval_from_it(setup, tmp_path):
    lines: list[str] = []
    target, data = setup
    t = Trainer(_cfg(target, data, tmp_path / "run", max_steps=3, checkpoint_every=None), log=lines.append)
    assert t.run() == 0
    [path] = list_checkpoints(tmp_path / "run")
    assert load_checkpoint(path, read_manifest(tmp_path / "run")[0][path.name])["state"]["step"] == 3
    assert not t.checkpoints.writer.busy
    size = checkpoint_bytes(t.drafter.drafter)
    assert any(x.startswith("checkpoints: every 60 s in the background") and f"{size / 1e9:.2f} GB" in x
               for x in lines), lines
    # The writer thread works on the host here: it must not have bound (or initialised) a GPU.
    assert t.checkpoints.writer.device is None and not torch.cuda.is_initialized()
    assert t.checkpoints.writer._thread is None  # ended with the run


def test_the_default_interval_is_a_minute_per_gigabyte_and_never_under_a_minute():
    assert default_interval(0) == default_interval(300_000_000) == 60.0
    assert default_interval(12_600_000_000) == pytest.approx(756.0)  # a 1B drafter with its AdamW state
    drafter = torch.nn.Linear(1000, 1000)  # fp32: 4 MB of weights, 12 MB with AdamW's two moments
    assert checkpoint_bytes(drafter) == 3 * 4 * (1000 * 1000 + 1000)


def test_a_snapshot_copies_nested_state_and_keeps_plain_values():
    snap = HostSnapshot()
    w = torch.arange(6.0).view(2, 3)
    state = {"w": w, "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [{"lr": 0.1}]}, "t": (1, "x")}
    host, ready = snap.take(state)
    assert ready is None  # all on the host: the copies are done on return
    assert torch.equal(host["w"], w) and host["w"].data_ptr() != w.data_ptr()
    assert host["opt"]["groups"] == [{"lr": 0.1}] and host["t"] == (1, "x")
    assert snap.nbytes == 6 * 4 + 4
    w.add_(1)
    again, _ = snap.take(state)
    assert again["w"] is host["w"] and torch.equal(again["w"], w)  # the same buffer, refreshed


def test_the_writer_reports_an_unexpected_error_and_keeps_working(tmp_path):
    done: list[Written] = []
    calls = iter([RuntimeError("boom"), tmp_path / "ok.pt"])

    def write(step: int, state) -> Path:
        r = next(calls)
        if isinstance(r, Exception):
            raise r
        return r

    w = CheckpointWriter(write, done.append, None)
    w.submit(1, {}, None, 0)
    w.submit(2, {}, None, 0)
    w.close()
    assert [d.step for d in done] == [1, 2]
    assert done[0].path is None and "RuntimeError: boom" in str(done[0].error)
    assert done[1].path == tmp_path / "ok.pt" and done[1].error is None


def test_the_first_save_uses_buffers_reserved_off_the_drafter_thread(setup, tmp_path):
    t = _wired(setup, tmp_path / "run", [])
    ck = t.checkpoints
    ck.writer.wait()  # the reservation runs on the writer thread from the start
    reserved = {b.data_ptr() for bufs in ck.snapshot._spare.values() for b in bufs}
    n = sum(1 for _ in t.drafter.drafter.parameters())
    assert len(reserved) == 3 * n  # each parameter and AdamW's two moments of it
    t.drafter.step(t.targets[0](t.source(0)), 0.5)  # AdamW's moments exist from the first step on
    t.state.step = 1
    ck.save(final=True)
    used = {b.data_ptr() for b in ck.snapshot._buffers.values()}
    assert reserved <= used and not ck.snapshot._spare  # all of them taken, nothing left over
    ck.close()
