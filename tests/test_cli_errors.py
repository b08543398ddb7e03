"""Bad input gets one clear line (or just works): the rough edges a new user hit in the first hour."""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from dflash.cli import main
from dflash.data.formats import iter_rows
from dflash.train.config import ConfigError
from dflash.train.config.schema import make_config
from dflash.train.reporting.monitoring import top_command
from dflash.train.trainer import train


@pytest.mark.parametrize("key, value, says", [
    ("batch_size", 8.5, "batch_size must be a whole number, got 8.5"),
    ("metrics_port", "9400", "metrics_port must be a whole number (or unset), got '9400'"),
    ("max_time", "60", "max_time must be a number (or unset)"),
    ("target_layer_ids", [1, "a"], "target_layer_ids must be a list of whole numbers (or unset)"),
    ("target_devices", [0], "target_devices must be a list of strings"),
    ("run_name", 3, "run_name must be a string (or unset)"),
    ("pipeline", "yes", "pipeline must be true or false"),
])
def test_every_config_field_is_type_checked_at_load(key, value, says):
    with pytest.raises(ConfigError) as e:
        make_config({key: value, "max_steps": 1}, {})
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_config_keeps_what_is_right():
    cfg = make_config({"gamma": 7, "metrics_port": 9400, "target_layer_ids": [1, 3], "max_steps": 2}, {})
    assert cfg.model.gamma == 7.0 and isinstance(cfg.model.gamma, float) and cfg.telemetry.metrics_port == 9400
    assert cfg.model.target_layer_ids == [1, 3]


@pytest.mark.parametrize("argv, says", [
    (["train", "--max-stesp", "5"], "dflash train: error: unknown flag --max-stesp; did you mean --max-steps?"),
    (["train", "--xyzzy"], "dflash train: error: unknown flag --xyzzy"),
    (["export", "ckpt", "--out", "o", "--dtpye=bf16"],
     "dflash export: error: unknown flag --dtpye; did you mean --dtype?"),
    (["train", "--max-steps", "abc"], "dflash train: error: argument --max-steps: invalid int value: 'abc'"),
])
def test_a_bad_flag_is_one_line_with_the_closest_flag(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == f"{says} (`dflash {argv[0]} --help` lists every flag)\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_eval_on_a_missing_cuda_device_is_one_line(capsys):
    assert main(["eval", "--drafter", "nowhere", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err == "dflash eval: error: device 'cuda' requested but CUDA is not available on this machine\n"


def test_a_json_error_reads_right(tmp_path):
    bad = tmp_path / "d.jsonl"
    for line, says in (('{"text": "unterminated', "(Unterminated string starting at column 10)"),
                       ('{"text": "a\tb"}', "(Invalid control character at column 12)")):
        bad.write_text(line)
        with pytest.raises(ValueError) as e:
            list(iter_rows(bad))
        assert str(e.value).endswith(says), str(e.value)


def test_a_failed_start_leaves_no_run_dir_it_created(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    run = tmp_path / "runs" / "new"
    assert train(make_config({}, {"data": str(bad), "run_dir": str(run), "max_steps": 1, "telemetry": False})) == 2
    assert not (tmp_path / "runs").exists()
    run.mkdir(parents=True)  # a directory the user made stays, even empty
    assert train(make_config({}, {"data": str(bad), "run_dir": str(run), "max_steps": 1, "telemetry": False})) == 2
    assert run.is_dir()


def test_the_attach_hint_works_as_printed_without_the_venv_on_path():
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    r = subprocess.run(f"{top_command()} --help", shell=True, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "dflash-top" in r.stdout, r.stderr


def test_an_unknown_setting_names_the_closest_valid_one():
    with pytest.raises(ConfigError) as e:
        make_config({"learning_rate": 1e-3, "max_steps": 1}, {})
    # another trainer's name
    assert str(e.value) == "unknown setting 'learning_rate' in config file; did you mean 'lr'?"
    with pytest.raises(ConfigError) as e:
        make_config({"optim": {"learning_rate": 1e-3}, "max_steps": 1}, {})
    assert str(e.value) == "unknown setting 'learning_rate' in [optim] of config file; did you mean 'lr'?"
    with pytest.raises(ConfigError) as e:
        make_config({"zebra": 1, "max_steps": 1}, {})
    assert str(e.value) == "unknown setting 'zebra' in config file"  # nothing close enough to guess
    with pytest.raises(ConfigError, match=r"unknown setting 'bach_size' in config file; did you mean 'batch_size'\?"):
        make_config({"bach_size": 4, "max_steps": 1}, {})
    with pytest.raises(ConfigError, match=r"unknown setting 'l' in \[optim\] of config file; did you mean 'lr'\?"):
        make_config({"optim": {"l": 1e-3}, "max_steps": 1}, {})
    with pytest.raises(ConfigError, match=r"'batch_size' in \[optim\] of config file: it belongs in \[data\]"):
        make_config({"optim": {"batch_size": 4}, "max_steps": 1}, {})


def test_a_sectioned_toml_and_a_flat_one_make_the_same_config(tmp_path):
    from dflash.train.config.schema import load_toml

    flat, sectioned = tmp_path / "flat.toml", tmp_path / "sectioned.toml"
    flat.write_text('[train]\nlr = 3e-3\nbatch_size = 2\nmax_steps = 5\npipeline = false\ndata = "demo"\n')
    sectioned.write_text('max_steps = 5\n[optim]\nlr = 3e-3\n[data]\nbatch_size = 2\n[pipeline]\npipeline = false\n'
                         '[run]\ndata = "demo"\n')
    a, b = make_config(load_toml(flat), {}), make_config(load_toml(sectioned), {})
    assert a.to_dict() == b.to_dict() and (b.optim.lr, b.data.batch_size, b.pipeline.enabled) == (3e-3, 2, False)
