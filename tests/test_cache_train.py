"""Training from an offline hidden-states cache on the tiny target: the same losses and tau as online, a
cache the way vLLM leaves it, bad caches in one line, and following a directory a writer still fills."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import demo_cache, train_following

from dflash.cli import main
from dflash.data.cache_format import SIDECAR, CacheMeta, read_sample, sample_path, write_sample

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
TAPS = "1,3,5"
ROWS = 24


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A small JSONL (the first demo rows) and the tiny target's cache of it."""
    root = tmp_path_factory.mktemp("cachetrain")
    demo_cache(root, ROWS, TAPS)
    return root


def _train(run_dir: Path, **extra) -> list[float]:
    """A short real run in this process; the per-step losses, read after each step."""
    from dflash.train.config.schema import make_config
    from dflash.train.trainer import Trainer

    cfg = make_config({}, dict(target="tiny", run_dir=str(run_dir), max_steps=4, batch_size=4, num_anchors=16,
                               max_seq_len=256, drafter_layers=1, target_layer_ids=[1, 3, 5], log_every=1e9,
                               eval_prompts=0, checkpoint_every=1e9, threads_per_worker=1, telemetry=False,
                               **extra))
    trainer = Trainer(cfg, log=lambda s: None)
    losses: list[float] = []
    inner = trainer.on_step

    def on_step(r):
        losses.append(float(r.out.loss.detach()))
        return inner(r)

    trainer.on_step = on_step
    assert trainer.run() == 0
    return losses


def _tau(run_dir: Path, capsys) -> float:
    capsys.readouterr()
    assert main(["eval", "--drafter", str(run_dir), "--target", "tiny", "--data", "demo", "--num-prompts", "3",
                 "--max-new-tokens", "24", "--device", "cpu", "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tau"]


def test_cache_training_matches_online_training(work, tmp_path, capsys):
    online = _train(tmp_path / "online", data=str(work / "data.jsonl"))
    cached = _train(tmp_path / "cached", hidden_states=str(work / "hs"))
    assert len(online) == len(cached) == 4
    # the same batches, anchors and states; the cache's forward ran over other padding, so float noise at most
    torch.testing.assert_close(torch.tensor(cached), torch.tensor(online), rtol=1e-5, atol=1e-5)
    assert _tau(tmp_path / "cached", capsys) == _tau(tmp_path / "online", capsys)


def test_kl_from_a_cache_equals_kl_in_process(work, tmp_path):
    """--loss kl reads the verifier's distribution from the cache's final (pre-norm) slot through the
    target's own final norm and head: the same losses as the in-process target's normed output gives."""
    online = _train(tmp_path / "online", data=str(work / "data.jsonl"), loss="kl")
    cached = _train(tmp_path / "cached", hidden_states=str(work / "hs"), loss="kl")
    ce = _train(tmp_path / "ce", hidden_states=str(work / "hs"))
    torch.testing.assert_close(torch.tensor(cached), torch.tensor(online), rtol=1e-4, atol=1e-5)
    assert abs(cached[0] - ce[0]) > 1e-3  # another objective: the comparison can fail


def _cli_train(hs: Path, run_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dflash", "train", "--target", "tiny", "--hidden-states", str(hs), "--run-dir",
           str(run_dir), "--max-steps", "2", "--batch-size", "4", "--num-anchors", "8", "--eval-prompts", "0",
           "--no-telemetry", *flags]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_a_cache_as_vllm_leaves_it_trains_and_a_wrong_layer_count_is_one_line(work, tmp_path):
    vllm = tmp_path / "vllm"
    shutil.copytree(work / "hs", vllm)
    (vllm / SIDECAR).unlink()  # speculators + vLLM's connector write no sidecar
    r = _cli_train(vllm, tmp_path / "run", "--target-layer-ids", TAPS)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (f"--hidden-states {vllm}: no {SIDECAR} (an engine wrote this cache): assuming its 3 aux slots are "
            "taps [1, 3, 5] (engine ids [2, 4, 6])") in r.stdout
    r = _cli_train(vllm, tmp_path / "run2", "--target-layer-ids", "1,3")
    assert r.returncode == 2
    assert _last_line(r.stderr) == (
        f"dflash train: error: --hidden-states {vllm}: hs_0.safetensors holds 4 layers per token (3 aux + final) "
        "but the drafter taps 2 ([1, 3]); pass --target-layer-ids with the 3 layers the engine was given, each "
        "minus 1 (its aux_hidden_state_layer_ids)")


def test_another_tokenizer_is_refused_at_the_start(work, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(work / "hs", other)
    meta = CacheMeta.read(other)
    meta.tokenizer_sha256 = "f" * 64
    meta.write(other)
    r = _cli_train(other, tmp_path / "run")
    assert r.returncode == 2 and not (tmp_path / "run" / "checkpoints").exists()
    assert _last_line(r.stderr) == (f"dflash train: error: --hidden-states {other}: written with another tokenizer "
                                    "than --target's (the cache's target was 'tiny'); give that --target, or "
                                    "rewrite the cache with this one")


def test_a_cache_cut_short_is_refused_at_the_start(work, tmp_path):
    short = tmp_path / "short"
    shutil.copytree(work / "hs", short)
    sample_path(short, 5).unlink()
    r = _cli_train(short, tmp_path / "run")
    assert r.returncode == 2 and not (tmp_path / "run" / "checkpoints").exists()
    rows = CacheMeta.read(short).rows
    assert _last_line(r.stderr) == (
        f"dflash train: error: --hidden-states {short}: 1 of {rows} rows have no file (the first: "
        "hs_5.safetensors); finish it with `dflash data cache` (same --out), or train with --follow while it is "
        "written")


@pytest.mark.parametrize("damage", ["nan", "truncated"])
def test_a_cache_of_mostly_bad_files_stops_the_run_in_one_line_and_keeps_the_drafter(work, tmp_path, damage):
    """One bad file is skipped (tests/test_cache_bad_samples.py); a cache whose bad files outnumber its
    good ones is the cache's fault, and stops the run naming a file."""
    bad = tmp_path / "bad"
    shutil.copytree(work / "hs", bad)
    # every row of the epoch is read within the first 6 steps (batch 4): damage them all but row 0
    for i in range(1, CacheMeta.read(bad).rows):
        path = sample_path(bad, i)
        if damage == "nan":
            hs, ids = read_sample(path)
            hs = hs.clone()
            hs[0, 0, 0] = float("nan")
            write_sample(path, hs, ids)
        else:
            path.write_bytes(path.read_bytes()[:-64])
    r = _cli_train(bad, tmp_path / "run", "--max-steps", "6")
    assert r.returncode == 1, r.stdout[-2000:]
    line = next(x for x in r.stderr.splitlines() if x.startswith("dflash train: ") and "hs_" in x)
    why = {"nan": "non-finite values (NaN/inf) in layer slots [0]", "truncated": "truncated"}[damage]
    assert why in line and str(bad / "hidden_states") in line
    assert "Traceback" not in r.stderr
    assert f"fix the file, then dflash train --resume --run-dir {tmp_path / 'run'}" in line


# A producer beside the trainer: the rows and the sidecar first, then, once told to start, one file every
# PACE seconds (its own pace, the way an engine answers requests), each written the way vLLM's connector
# writes it: in place, under an exclusive flock on <file>.lock that the reader must wait for.
WRITER = textwrap.dedent("""
    import fcntl, os, shutil, sys, time
    from pathlib import Path
    src, dst, pace = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    (dst / "hidden_states").mkdir(parents=True)
    for f in sorted(src.iterdir(), key=lambda f: f.name == "state.json"):  # state.json last, as datasets does
        if f.is_file():
            shutil.copy(f, dst / f.name)
    while not (dst / "go").exists():
        time.sleep(0.01)
    for i in range(len(list((src / "hidden_states").iterdir()))):
        time.sleep(pace)
        name = f"hs_{i}.safetensors"
        data = (src / "hidden_states" / name).read_bytes()
        lock = os.open(dst / "hidden_states" / (name + ".lock"), os.O_CREAT | os.O_WRONLY, 0o644)
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(dst / "hidden_states" / name, "wb") as out:
            out.write(data[: len(data) // 2])
            out.flush()
            time.sleep(pace / 4)      # half a file on disk, at its final name, while the lock is held
            out.write(data[len(data) // 2:])
        os.close(lock)
""")


def test_follow_trains_while_a_writer_fills_the_directory(work, tmp_path, sock_dir):
    dst, log = tmp_path / "live", tmp_path / "train.log"
    still_writing = train_following(
        WRITER, [str(work / "hs"), str(dst), "1.0"], dst, log,
        ["--run-dir", str(tmp_path / "run"), "--max-steps", "4", "--batch-size", "2", "--num-anchors", "8",
         "--eval-prompts", "0", "--log-every", "1000", "--socket-dir", str(sock_dir), "--loss", "kl"],
        started="telemetry: ")
    assert still_writing, "the writer finished first: the trainer did not follow it"
    text = log.read_text()
    # every file it read was whole (each is checked against its row and shape on reading), and the
    # producer was the slower side: the verdict over the whole run names it
    verdict = next((x for x in text.splitlines() if x.startswith("bottleneck")), text[-3000:])
    assert ": input-bound - waiting for hidden states: the cache reader waits" in verdict, text[-3000:]
    # --loss kl read the verifier's states from the followed files; its logits are their own category
    from dflash.telemetry.wire.reader import read_frames

    last = [f for f in read_frames(tmp_path / "run" / "telemetry.jsonl") if type(f).__name__ == "Snapshot"][-1]
    assert "verifier_logits" in last.cumulative["drafter-0"] and "loss_kl" in last.gauges


def test_a_cache_cannot_evaluate_unless_eval_target_names_a_model_that_decodes(work, tmp_path):
    hs = work / "hs"
    r = _cli_train(hs, tmp_path / "run", "--eval-prompts", "2", "--eval-every", "30")
    assert r.returncode == 2 and not (tmp_path / "run" / "checkpoints").exists()
    assert _last_line(r.stderr) == (f"dflash train: error: --eval-every: --hidden-states {hs} supplies hidden "
                                    "states only and cannot decode; give --eval-target MODEL_DIR (e.g. "
                                    "--eval-target tiny) or drop --eval-every")
    # the final evaluation alone is skipped, and the start says so
    r = _cli_train(hs, tmp_path / "run2", "--eval-prompts", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"no final evaluation: --hidden-states {hs} cannot decode" in r.stdout
    assert not (tmp_path / "run2" / "evals.jsonl").exists()
    # --eval-target: the run evaluates with that model
    r = _cli_train(hs, tmp_path / "run3", "--eval-prompts", "1", "--eval-max-new-tokens", "8", "--eval-target", "tiny",
                   "--data", str(work / "data.jsonl"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "run3" / "evals.jsonl").read_text().splitlines()[-1])["tau"] >= 1.0
