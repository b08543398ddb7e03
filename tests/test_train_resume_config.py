"""`dflash train --resume` continues the run its directory holds: the saved config.json's settings, not
the recipe's defaults; what the run trains may not change, the rest may, and each change is said."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
from test_model_helpers import make_target_dir, make_tokenizer, one_thread  # noqa: F401 (one_thread: autouse)
from test_train_pipeline import _write_data

from dflash.cli import main
from dflash.train.config import ConfigError
from dflash.train.config.schema import make_config, resumed


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, str]:
    """A finished 1-step run with trackers and a log interval of its own (what a resume once dropped)."""
    root = tmp_path_factory.mktemp("resume")
    target = make_target_dir(root / "target", layers=4, tokenizer=make_tokenizer())
    data = _write_data(root / "data.jsonl")
    run, out = root / "run", io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["train", "--target", str(target), "--data", str(data), "--run-dir", str(run),
                     "--batch-size", "4", "--num-anchors", "8", "--drafter-layers", "1", "--eval-prompts", "0",
                     "--max-steps", "1", "--log-every", "5", "--report-to", "tensorboard", "--no-telemetry",
                     "--checkpoint-every", "1e9"])
    assert code == 0, out.getvalue()[-2000:]
    return run, out.getvalue()


def test_one_step_is_said_as_such(first_run: tuple[Path, str]) -> None:
    assert "done: 1 step, " in first_run[1]


def saved(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


def test_resume_keeps_the_saved_settings_and_says_what_changed(first_run: tuple[Path, str], capsys) -> None:
    run = first_run[0]
    before = saved(run)
    assert main(["train", "--resume", "--run-dir", str(run), "--max-steps", "3"]) == 0
    out = capsys.readouterr().out
    assert (f"dflash train: --resume: the settings of {run}/config.json; changed: max_steps 1 -> 3"
            in out), out
    assert "resumed from step 1" in out and "done: 3 steps" in out
    after = saved(run)
    assert after["telemetry"]["report_to"] == ["tensorboard"] and after["run"]["log_every"] == 5.0
    assert after["run"]["target"] == before["run"]["target"] and after["run"]["data"] == before["run"]["data"]
    assert after["model"] == before["model"] and after["optim"] == before["optim"]


@pytest.mark.parametrize("flag, value, says", [
    ("--lr", "0.1", "lr is 0.003 in {cfg}, not 0.1"),
    ("--num-anchors", "16", "num_anchors is 8 in {cfg}, not 16"),
    ("--target", "tiny", "target is '{target}' in {cfg}, not 'tiny'"),
])
def test_resume_refuses_a_change_to_what_the_run_trains(first_run: tuple[Path, str], capsys, flag, value, says) -> None:
    run = first_run[0]
    before = (run / "config.json").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", "--run-dir", str(run), flag, value]) == 2
    err = capsys.readouterr().err
    cfg = f"{run}/config.json"
    assert err == (f"dflash train: error: --resume keeps what the run trains: "
                   f"{says.format(cfg=cfg, target=saved(run)['run']['target'])} "
                   "(start a new --run-dir to train with it)\n")
    assert (run / "config.json").read_bytes() == before, "a refused resume leaves config.json alone"


def test_the_limits_given_replace_the_saved_ones_and_placement_is_this_starts() -> None:
    old = make_config({}, {"run_dir": "r", "epochs": 1.0, "max_steps": 40, "log_every": 5.0,
                           "report_to": ["tensorboard"], "threads_per_worker": 4})
    new = make_config({}, {"run_dir": "r", "max_time": 600.0, "threads_per_worker": 1})
    cfg, lines = resumed(old, new, {"run_dir", "max_time"}, "r/config.json")
    assert (cfg.run.max_time, cfg.run.max_steps, cfg.run.epochs) == (600.0, None, None)
    assert cfg.pipeline.threads_per_worker == 1, "where it runs comes from this start"
    assert cfg.run.log_every == 5.0 and cfg.telemetry.report_to == ["tensorboard"]
    assert lines == ["max_time None -> 600.0", "max_steps 40 -> None (the limits given replace the saved ones)",
                     "epochs 1.0 -> None (the limits given replace the saved ones)"]
    with pytest.raises(ConfigError, match=r"^--resume keeps what the run trains: batch_size is 8 in r/config.json"):
        resumed(make_config({}, {"run_dir": "r", "batch_size": 8}), make_config({}, {"run_dir": "r", "batch_size": 4}),
                {"batch_size"}, "r/config.json")
