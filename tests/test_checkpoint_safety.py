"""Checkpoints under attack and accident, with real files, real commands and a real small filesystem.

* A crafted ``.pt`` whose pickle runs a shell command is refused by every command that loads one
  (``dflash eval --drafter``, ``dflash export``, ``dflash train --resume``): the command never runs.
* An export whose config.json claims absurd sizes is refused before anything is allocated.
* A truncated or corrupted newest checkpoint is skipped on resume, for the newest one that verifies.
* A full disk (a tmpfs mounted for the test) costs one line and no checkpoint; ``--keep-checkpoints``
  makes room for the next write.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from conftest import wait_until
from test_model_helpers import make_target_dir, make_tokenizer
from test_train_pipeline import _cfg, _cli, _env, _write_data

from dflash.checkpoint_files import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from dflash.model.loading import load_drafter
from dflash.model.write_export import export_drafter
from dflash.train.checkpoint import rng
from dflash.train.trainer import Trainer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckptsafety")
    target = make_target_dir(root / "target", layers=4, tokenizer=make_tokenizer())
    data = _write_data(root / "data.jsonl")
    run = root / "run"  # three checkpoints, steps 1, 2, 3 (one per step)
    assert Trainer(_cfg(target, data, run, max_steps=3, checkpoint_every=0), log=lambda s: None).run() == 0
    assert [p.name for p in list_checkpoints(run)] == [f"step-{i:08d}.pt" for i in (1, 2, 3)]
    return target, data, run


def _copy_run(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def _dflash(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash", *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout)


# --- no code runs from a checkpoint --------------------------------------------------------------------


class _RunsCode:
    """Pickles as a call to os.system: what a hostile checkpoint does when unpickled."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _craft(path: Path, marker: Path) -> Path:
    real = load_checkpoint(path)  # a genuine checkpoint, with one entry replaced by the payload
    real["drafter_config"] = _RunsCode(f"touch {marker}")
    torch.save(real, path)
    return path


def test_a_checkpoint_that_runs_code_is_refused_by_every_command(setup, tmp_path):
    target, data, run = setup
    marker = tmp_path / "PWNED"
    bad = tmp_path / "evil.pt"
    shutil.copy(list_checkpoints(run)[-1], bad)
    _craft(bad, marker)

    for args in (["eval", "--drafter", str(bad), "--target", str(target), "--data", str(data), "--num-prompts", "1"],
                 ["export", str(bad), "--out", str(tmp_path / "out")]):
        proc = _dflash(*args)
        assert proc.returncode != 0 and not marker.exists(), (args[0], proc.stderr[-2000:])
        assert "refused: loading it would run code (it calls or builds posix.system)" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    # In a run directory it is the newest checkpoint, with a manifest entry that matches it (whoever
    # can write the file can write the manifest): --resume refuses it and uses the one before.
    resumed_dir = _copy_run(run, tmp_path / "run")
    newest = resumed_dir / "checkpoints" / "step-00000004.pt"
    shutil.copy(bad, newest)
    manifest = json.loads((resumed_dir / "checkpoints" / "manifest.json").read_text())
    manifest["checkpoints"][newest.name] = {"size": newest.stat().st_size,
                                            "sha256": hashlib.sha256(newest.read_bytes()).hexdigest()}
    (resumed_dir / "checkpoints" / "manifest.json").write_text(json.dumps(manifest))
    proc = subprocess.run(_cli(target, data, resumed_dir, "--resume", "--max-steps", "5", "--no-telemetry",
                               "--checkpoint-every", "1e9"), capture_output=True, text=True, env=_env(), timeout=240)
    assert not marker.exists(), "the crafted checkpoint ran its command"
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("--resume: skipping checkpoint step-00000004.pt: refused: loading it would run code "
            "(it calls or builds posix.system)") in proc.stdout, proc.stdout[-3000:]
    assert "resumed from step 3" in proc.stdout


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_hidden_layers"])
def test_an_export_config_with_absurd_sizes_is_refused_before_allocating(setup, tmp_path, field):
    _target, _data, run = setup
    out = export_drafter(load_drafter(run), tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    cfg[field] = 1 << 40  # terabytes of weights, if anything were allocated from it
    (out / "config.json").write_text(json.dumps(cfg))
    start = time.monotonic()
    proc = _dflash("export", str(out), "--out", str(tmp_path / "again"), timeout=120)
    assert proc.returncode != 0 and time.monotonic() - start < 60
    # (an absurd layer count is also caught by the per-layer types it must match, whichever check runs first)
    assert any(why in proc.stderr for why in ("weights do not match the config", "sizes are invalid",
                                              "entries for 1099511627776 drafter layers")), proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# --- verified checkpoints -------------------------------------------------------------------------------


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip(p: Path) -> None:
    """Same size, a few bytes changed in the middle (inside tensor data): loads fine, wrong weights."""
    data = bytearray(p.read_bytes())
    mid = len(data) // 2
    data[mid: mid + 8] = bytes(b ^ 0xFF for b in data[mid: mid + 8])
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, reason", [(_truncate, "truncated"), (_flip, "checksum mismatch")])
def test_resume_skips_a_damaged_newest_checkpoint(setup, tmp_path, damage, reason):
    target, data, run = setup
    run = _copy_run(run, tmp_path / "run")
    damage(list_checkpoints(run)[-1])
    proc = subprocess.run(_cli(target, data, run, "--resume", "--max-steps", "4", "--no-telemetry",
                               "--checkpoint-every", "1e9"), capture_output=True, text=True, env=_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"--resume: skipping checkpoint step-00000003.pt: {reason}" in proc.stdout, proc.stdout[-3000:]
    assert "--resume: using step-00000002.pt" in proc.stdout and "resumed from step 2" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_export_of_a_run_dir_uses_the_newest_checkpoint_that_verifies(setup, tmp_path):
    _target, _data, run = setup
    run = _copy_run(run, tmp_path / "run")
    _flip(list_checkpoints(run)[-1])
    proc = _dflash("export", str(run), "--out", str(tmp_path / "out"), "--dtype", "keep")
    assert proc.returncode == 0, proc.stderr
    assert "skipping checkpoint step-00000003.pt: checksum mismatch" in proc.stderr
    exported = load_drafter(tmp_path / "out").state_dict()
    step2 = load_checkpoint(list_checkpoints(run)[1])["drafter"]
    assert all(torch.equal(exported[k], step2[k]) for k in step2)


def test_resume_with_no_usable_checkpoint_stops_with_one_line(setup, tmp_path):
    target, data, run = setup
    run = _copy_run(run, tmp_path / "run")
    for p in list_checkpoints(run):
        _truncate(p)
    proc = subprocess.run(_cli(target, data, run, "--resume", "--max-steps", "4", "--no-telemetry"),
                          capture_output=True, text=True, env=_env(), timeout=240)
    assert proc.returncode == 2
    assert "none of the 3 checkpoint(s)" in proc.stderr and "start afresh" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.count("skipping checkpoint") == 3


def test_rng_state_is_plain_tensors_and_round_trips(tmp_path):
    g = torch.Generator().manual_seed(5)
    random.seed(11)
    torch.manual_seed(12)
    state = rng.capture(g)
    torch.save(state, tmp_path / "rng.pt")
    expected = (random.random(), torch.rand(3), torch.rand(2, generator=g))
    random.seed(0)
    torch.manual_seed(0)
    g.manual_seed(0)
    notes = rng.restore(torch.load(tmp_path / "rng.pt", weights_only=True), g)
    assert notes == []
    again = (random.random(), torch.rand(3), torch.rand(2, generator=g))
    assert again[0] == expected[0] and torch.equal(again[1], expected[1]) and torch.equal(again[2], expected[2])


def test_rng_state_from_older_checkpoints_still_restores() -> None:
    """Before RNG states were tensors, Python's was stored as random.getstate()'s tuple."""
    g = torch.Generator().manual_seed(3)
    random.seed(4)
    old = {"torch": torch.get_rng_state(), "python": random.getstate(), "anchors": g.get_state()}
    expected = random.random()
    random.seed(0)
    assert rng.restore(old, g) == [] and random.random() == expected


def test_cuda_rng_states_for_more_gpus_than_present_are_dropped_with_a_note():
    """A checkpoint from an 8-GPU box resumed on 4 GPUs (or on none: this machine) restores what
    matches instead of failing in set_rng_state_all."""
    assert rng.cuda_plan(4, 4) == (4, None)
    n, note = rng.cuda_plan(8, 4)
    assert n == 4 and "restored 4, dropped the states of GPUs 4-7" in note
    n, note = rng.cuda_plan(2, 8)
    assert n == 2 and "the others keep their fresh seeds" in note
    g = torch.Generator()
    state = {**rng.capture(g), "cuda": [torch.get_rng_state(), torch.get_rng_state()]}
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    notes = rng.restore(state, g)
    if present != 2:
        assert len(notes) == 1 and "holds CUDA RNG states for 2 GPU(s)" in notes[0]


# --- disk full, on a real small filesystem -------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt_size(setup) -> int:
    """Bytes of one checkpoint of the setup's run: the unit the small filesystems are sized in."""
    return list_checkpoints(setup[2])[-1].stat().st_size


@pytest.fixture
def small_fs(tmp_path):
    """Mount a tmpfs of the requested size (root only; CI runs as root)."""
    mounted: list[Path] = []

    def mount(size: int) -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        where = tmp_path / f"fs{len(mounted)}"
        where.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _wait(cond, timeout: float, proc: subprocess.Popen, log: Path) -> None:
    wait_until(cond, timeout, "the trainer", proc=proc, output=lambda: log.read_text()[-3000:])


def _verified_steps(run: Path) -> list[int]:
    manifest, _ = read_manifest(run)
    return [int(p.stem.split("-")[1]) for p in list_checkpoints(run) if p.name in manifest]


@contextmanager
def _training(target: Path, data: Path, run_dir: Path, log: Path, *flags: str) -> Iterator[subprocess.Popen]:
    """A long training run in the background, its output in `log`. The block's end stops it as a user
    would (SIGTERM, then up to 60 s to save and exit); a block that fails kills it."""
    with log.open("w") as out:
        proc = subprocess.Popen(_cli(target, data, run_dir, "--max-steps", "100000", "--no-telemetry", *flags),
                                stdout=out, stderr=subprocess.STDOUT, text=True, env=_env())
    try:
        yield proc
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()


def _fill_leaving(fs: Path, free: int) -> Path:
    """Fill the small filesystem until only `free` bytes are left."""
    filler = fs / "filler"
    with filler.open("wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(fs).free - free))
    return filler


def test_disk_full_costs_one_line_keeps_the_last_checkpoint_and_training_goes_on(setup, ckpt_size, small_fs,
                                                                                  tmp_path):
    target, data, _ = setup
    fs = small_fs(8 * ckpt_size)
    run_dir, log = fs / "run", tmp_path / "train.log"
    with _training(target, data, run_dir, log, "--checkpoint-every", "0.3", "--log-every", "100") as proc:
        _wait(lambda: _verified_steps(run_dir), 180, proc, log)
        filler = _fill_leaving(fs, ckpt_size // 3)  # a third of a checkpoint stays free
        _wait(lambda: "no space left on device" in log.read_text(), 60, proc, log)
        good = _verified_steps(run_dir)[-1]
        lines = [x for x in log.read_text().splitlines() if "no space left" in x]
        assert f"in {run_dir} (" in lines[0] and " MB free, this checkpoint needs ~" in lines[0], lines[0]
        assert f"newest good checkpoint: step-{good:08d}.pt; training continues" in lines[0], lines[0]
        assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
        load_checkpoint(list_checkpoints(run_dir)[-1], read_manifest(run_dir)[0][f"step-{good:08d}.pt"])
        filler.unlink()  # space comes back: the next interval saves again, further on
        _wait(lambda: _verified_steps(run_dir)[-1] > good, 60, proc, log)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "Traceback" not in text and "unexpected pos" not in text, text[-3000:]


def test_a_final_checkpoint_that_does_not_fit_exits_1_saying_so(setup, ckpt_size, small_fs, tmp_path):
    target, data, _ = setup
    fs = small_fs(4 * ckpt_size)
    run_dir, log = fs / "run", tmp_path / "train.log"
    with _training(target, data, run_dir, log, "--checkpoint-every", "1e9", "--log-every", "0.2") as proc:
        _wait(lambda: "step " in log.read_text(), 180, proc, log)
        _fill_leaving(fs, ckpt_size // 3)
    text = log.read_text()
    assert proc.returncode == 1, text[-3000:]
    assert "not saved: no space left on device" in text and "newest good checkpoint: none" in text, text[-3000:]
    assert "the final checkpoint was not saved" in text and "Traceback" not in text, text[-3000:]
    assert not list((run_dir / "checkpoints").iterdir())  # no partial file left behind


def test_keep_checkpoints_makes_room_for_the_next_write(setup, ckpt_size, small_fs):
    """Room for three and a half checkpoints, keep=3: the fourth write only fits if the oldest goes first."""
    target, data, _ = setup
    fs = small_fs((7 * ckpt_size // 2 + 4095) // 4096 * 4096)
    run_dir = fs / "run"
    proc = subprocess.run(_cli(target, data, run_dir, "--max-steps", "8", "--checkpoint-every", "0",
                               "--keep-checkpoints", "3", "--no-telemetry", "--log-every", "100"),
                          capture_output=True, text=True, env=_env(), timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "not saved" not in proc.stdout, proc.stdout[-3000:]
    assert "removed the oldest checkpoint" in proc.stdout
    assert _verified_steps(run_dir) == [6, 7, 8]


def test_making_room_never_deletes_the_newest_intact_checkpoint(setup, ckpt_size, small_fs):
    """keep=1, the newest file damaged, too little space even after pruning: the write fails, and the
    newest checkpoint that matches its manifest is still there to resume from."""
    _target, _data, run = setup
    fs = small_fs(6 * ckpt_size)
    run_dir = _copy_run(run, fs / "run")
    _truncate(list_checkpoints(run_dir)[-1])  # step 3: no longer what the manifest recorded
    _fill_leaving(fs, ckpt_size // 3)
    state = load_checkpoint(list_checkpoints(run_dir)[1])
    state["padding"] = torch.zeros(ckpt_size // 2, dtype=torch.uint8)  # needs more than pruning step 1 frees
    with pytest.raises(CheckpointError, match="no space left on device"):
        save_checkpoint(run_dir, 4, state, keep=1)
    names = [p.name for p in list_checkpoints(run_dir)]
    assert names == ["step-00000002.pt", "step-00000003.pt"], names  # step 1 went, step 2 stayed
    manifest, _ = read_manifest(run_dir)
    load_checkpoint(list_checkpoints(run_dir)[0], manifest["step-00000002.pt"])
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
