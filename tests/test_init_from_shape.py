"""`--init-from RELEASE` takes the release's shape (layers, layer types, window, block size, taps)
unless the user set it on the command line or in a config file; what the hardware recipe filled in
yields; a conflict is one line naming the flag, or the file and the key."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from test_drafter_release import _sliding_drafter, setup  # noqa: F401 (the module's target fixture)
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash.cli import main
from dflash.model.drafter import FULL, SLIDING, DFlashDrafter
from dflash.model.write_export import export_drafter
from dflash.targets import load_target
from dflash.train.config import ConfigError
from dflash.train.config.recipes import CPU_RECIPE
from dflash.train.config.released import take_release_shape
from dflash.train.config.schema import load_toml, make_config

#: the release: 2 layers (sliding, full), window 3, block 8, taps [1, 3] of the 6-layer target
SHAPE = {"drafter_layers": 2, "drafter_layer_types": [SLIDING, FULL], "drafter_sliding_window": 3,
         "block_size": 8, "target_layer_ids": [1, 3]}


@pytest.fixture(scope="module")
def release(setup, tmp_path_factory):  # noqa: F811
    _, target_dir, _ = setup
    drafter = _sliding_drafter(load_target(target_dir, layer_ids=[1, 3]), window=3)
    out = tmp_path_factory.mktemp("shape") / "release"
    export_drafter(DFlashDrafter(replace(drafter.config, block_size=8, gamma=None)), out)
    return out


def _shape(cfg) -> dict:
    return {name: getattr(cfg.model, name) for name in SHAPE}


def _args(setup, release, run, *extra) -> list[str]:  # noqa: F811
    _, target_dir, data = setup
    return ["train", "--target", str(target_dir), "--data", str(data), "--init-from", str(release),
            "--run-dir", str(run), "--max-steps", "1", "--batch-size", "2", "--num-anchors", "4",
            "--eval-prompts", "0", "--no-telemetry", "--checkpoint-every", "1e9", *extra]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU recipe is chosen only without CUDA")
def test_a_bare_init_from_takes_the_releases_shape_over_the_recipes(setup, release, tmp_path, capsys):  # noqa: F811
    """No shape flag, no config file: the CPU recipe's one layer yields to the release's two, and the
    run trains with the release's layer kinds, window, block size and taps (config.json says so)."""
    assert CPU_RECIPE["drafter_layers"] == 1
    assert main(_args(setup, release, tmp_path / "run")) == 0
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert {name: saved[name] for name in SHAPE} == SHAPE, saved
    assert "the release's drafter_layers 2, target_layer_ids [1, 3]" in out, out
    assert "drafter 2 layers, 1 sliding (window 3)" in out and "block 8" in out, out


def test_explicit_settings_win_or_are_refused_naming_the_flag(setup, release, tmp_path, capsys):  # noqa: F811
    _, target_dir, data = setup
    base = dict(target=str(target_dir), data=str(data), run_dir=str(tmp_path / "r"), max_steps=1,
                init_from=str(release))
    # layer kinds, window and block size carry no weights: the user's win, the rest is the release's
    cfg = make_config({}, {**base, "block_size": 4, "drafter_layer_types": [FULL, FULL]})
    line = take_release_shape(cfg)
    assert _shape(cfg) == {**SHAPE, "block_size": 4, "drafter_layer_types": [FULL, FULL],
                           "drafter_sliding_window": None}
    assert line.endswith("the run's own: --drafter-layer-types full_attention,full_attention, --block-size 4"), line
    # the count and the taps are what the weights are made for: a different one is refused, naming the flag
    for flags, needle in [({"drafter_layers": 1}, "the release has num_layers 2, but --drafter-layers 1 asks for 1"),
                          ({"target_layer_ids": [1, 4]}, "target_layer_ids [1, 3], but --target-layer-ids 1,4"),
                          ({"drafter_layer_types": [FULL]}, "--drafter-layer-types full_attention names 1")]:
        with pytest.raises(ConfigError) as e:
            take_release_shape(make_config({}, {**base, **flags}))
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    cfg = make_config({}, {**base, "drafter_layers": 2, "target_layer_ids": [1, 3]})  # agreeing is fine
    take_release_shape(cfg)
    assert _shape(cfg) == SHAPE
    # end to end: one line on stderr, exit 2, before the target loads
    assert main(_args(setup, release, tmp_path / "run", "--drafter-layers", "1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--drafter-layers 1" in err[0] and "drop the setting" in err[0], err


def test_a_config_file_conflict_names_the_file_and_the_key(setup, release, tmp_path, capsys):  # noqa: F811
    _, target_dir, data = setup
    toml = tmp_path / "recipe.toml"
    toml.write_text("[model]\ndrafter_layers = 1\n")
    assert main(_args(setup, release, tmp_path / "run", "--config", str(toml))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"drafter_layers = 1 in {toml}" in err[0], err
    # a file's block size is the user's too: kept, and said
    toml.write_text("[train]\nblock_size = 4\n")
    cfg = make_config(load_toml(toml), dict(target=str(target_dir), data=str(data), run_dir=str(tmp_path / "r"),
                                            max_steps=1, init_from=str(release)), file=str(toml))
    line = take_release_shape(cfg)
    assert _shape(cfg) == {**SHAPE, "block_size": 4} and f"block_size = 4 in {toml}" in line, line
