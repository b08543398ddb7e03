"""The configuration as typed sections: code reads ``cfg.optim.lr``; every field of a section class is
a flag, a TOML key in its section's table and a flat top-level key, with no list of names kept anywhere
else; saved configs read back in the nested form written now and the flat one of earlier releases."""

from __future__ import annotations

import argparse
import json
import types
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from dflash.train.config import ConfigError, OptimSettings, PipelineSettings, TelemetrySettings, TrainConfig
from dflash.train.config.schema import (
    SECTIONS,
    SETTINGS,
    add_flags,
    flag_values,
    load_toml,
    make_config,
    read_saved,
    updated,
)

SAVED = Path(__file__).parent / "saved"


def _section_classes() -> dict[str, type]:
    return typing.get_type_hints(TrainConfig)


def test_code_reads_each_setting_in_its_section():
    cfg = make_config({"optim": {"lr": 3e-3}, "max_steps": 2}, {"target_devices": "cpu,cpu", "metrics_port": 9400})
    assert isinstance(cfg.optim, OptimSettings) and isinstance(cfg.pipeline, PipelineSettings)
    assert isinstance(cfg.telemetry, TelemetrySettings)
    assert (cfg.optim.lr, cfg.pipeline.target_devices, cfg.telemetry.metrics_port) == (3e-3, ["cpu", "cpu"], 9400)
    assert (cfg.run.max_steps, cfg.run.epochs, cfg.pipeline.enabled, cfg.telemetry.enabled) == (2, None, True, True)


def test_flat_names_stay_unique_across_sections():
    """A flat name (flag, top-level key, pre-sections config.json key) must say which field it is, and
    inside a section's table a field's own name and its flat name must not clash with another's."""
    flat: list[str] = []
    for section, cls in _section_classes().items():
        names = [f.metadata["flat"] or f.name for f in fields(cls)]
        flat += names
        in_table = [f.name for f in fields(cls)] + [n for f, n in zip(fields(cls), names, strict=True) if n != f.name]
        assert len(in_table) == len(set(in_table)), section
        assert cls.__doc__ and "\n" not in cls.__doc__, f"{cls.__name__} needs a one-line docstring: its --help heading"
    assert len(flat) == len(set(flat)), sorted(n for n in flat if flat.count(n) > 1)
    assert list(SETTINGS) == flat and list(SECTIONS) == list(_section_classes())


def _other_value(s) -> object:
    """A value of the setting's type that is not its default."""
    choices = s.meta["choices"]
    if isinstance(choices, dict):
        return next(v for v in choices.values() if v != s.default)
    if choices:
        return next(c for c in choices if c != s.default)
    options = typing.get_args(s.hint) if isinstance(s.hint, types.UnionType) else (s.hint,)
    kind = next(h for h in options if h is not type(None))
    samples = {bool: not s.default, int: 7, float: 2.5, str: "elsewhere", list[str]: ["cuda:0", "cuda:1"],
               list[int]: [2, 4]}
    return samples[kind]


def _words(s, value) -> list[str]:
    flag = "--" + s.name.replace("_", "-")
    if isinstance(s.meta["choices"], dict):
        return [flag, next(w for w, v in s.meta["choices"].items() if v == value)]
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, ",".join(map(str, value)) if isinstance(value, list) else str(value)]


def test_every_section_field_is_a_flag_a_section_key_and_a_flat_key(tmp_path):
    """Walks the real section classes: each field reaches its place in TrainConfig from a flag (in its
    section's --help group), from ``[section] field = ...`` and from a flat ``name = ...``; and every
    flag maps back to a field. A field added to a section class is covered without touching this test."""
    p = argparse.ArgumentParser()
    add_flags(p)
    groups = {g.title: {a.dest for a in g._group_actions} for g in p._action_groups}
    flagged = {a.dest for a in p._actions if a.option_strings and a.dest != "help"}
    assert flagged <= set(SETTINGS)  # no flag without a field
    for section, cls in _section_classes().items():
        for f in fields(cls):
            s = next(s for s in SETTINGS.values() if s.section == section and s.attr == f.name)
            value = _other_value(s)
            toml = json.dumps(value).lower() if isinstance(value, bool) else json.dumps(value)
            for text in (f"[{section}]\n{f.name} = {toml}\n", f"{s.name} = {toml}\n"):
                (tmp_path / "c.toml").write_text(text)
                got = getattr(getattr(updated(TrainConfig(), **load_toml(tmp_path / "c.toml")), section), f.name)
                assert got == value, (text, got)
            if f.metadata["help"] is None:
                continue
            assert s.name in groups[f"{section}: {cls.__doc__}"], f"no flag for {section}.{f.name}"
            given = {k: v for k, v in flag_values(p.parse_args(_words(s, value))).items() if v is not None}
            assert getattr(getattr(updated(TrainConfig(), **given), section), f.name) == value, s.name
    args = p.parse_args(["--pipeline", "off", "--target-layer-ids", "1,3,5", "--no-telemetry", "--lr", "0.01",
                         "--report-to", "none", "--init-from-target", "--max-steps", "2", "--target-devices",
                         "cpu,cpu"])
    cfg = make_config({}, flag_values(args))
    assert (cfg.pipeline.enabled, cfg.model.target_layer_ids, cfg.telemetry.enabled, cfg.optim.lr) == (
        False, [1, 3, 5], False, 0.01)
    assert (cfg.telemetry.report_to, cfg.model.init_from_target, cfg.pipeline.target_devices) == (
        [], True, ["cpu", "cpu"])
    assert make_config({"gil_probe": False, "max_steps": 1}, flag_values(p.parse_args([]))).telemetry.gil_probe is False


@pytest.mark.parametrize("values, says", [
    ({"telemetry": {"metrics_port": "9400"}}, "metrics_port must be a whole number (or unset), got '9400'"),
    ({"pipeline": {"enabled": "yes"}}, "pipeline must be true or false, got 'yes'"),
    ({"train": {"health": {"stall_timeout": "30"}}}, "stall_timeout must be a number (or unset), got '30'"),
])
def test_a_section_table_is_type_checked_like_a_flat_key(values, says):
    with pytest.raises(ConfigError) as e:
        make_config({**values, "max_steps": 1}, {})
    assert str(e.value) == says


def test_a_setting_given_twice_in_one_file_is_refused(tmp_path):
    """Flat and in its table, or in [train.optim] and [optim]: one of them would silently lose."""
    for text in ('lr = 1e-3\n[optim]\nlr = 2e-3\n', '[train.optim]\nlr = 1e-3\n[optim]\nlr = 2e-3\n'):
        (tmp_path / "c.toml").write_text(text)
        with pytest.raises(ConfigError, match=r"^lr is set twice in .*c\.toml$"):
            load_toml(tmp_path / "c.toml")


def test_tables_beside_a_train_table_are_read(tmp_path):
    (tmp_path / "c.toml").write_text('[train]\nmax_steps = 3\n[optim]\nlr = 2e-3\n[train.data]\nbatch_size = 2\n')
    cfg = make_config(load_toml(tmp_path / "c.toml"), {})
    assert (cfg.run.max_steps, cfg.optim.lr, cfg.data.batch_size) == (3, 2e-3, 2)
    (tmp_path / "c.toml").write_text('[train]\nmax_steps = 3\n[optim]\nlearning_rate = 2e-3\n')
    with pytest.raises(ConfigError, match=r"unknown setting 'learning_rate' in \[optim\] of .*c\.toml"):
        load_toml(tmp_path / "c.toml")


def test_a_saved_config_reads_back_nested_and_in_the_flat_form_of_earlier_releases():
    """config.json and a checkpoint's "config" are nested by section now; runs saved before the
    sections hold every setting at the top level (tests/saved/ holds one, written by that release)."""
    old = json.loads((SAVED / "config-before-sections.json").read_text())
    assert "lr" in old and "optim" not in old
    cfg = read_saved(old)
    assert (cfg.optim.lr, cfg.pipeline.enabled, cfg.telemetry.enabled, cfg.model.target_layer_ids) == (
        3e-3, False, False, [1, 3, 5])
    assert (cfg.run.run_dir, cfg.data.batch_size, cfg.telemetry.report_to, cfg.health.stall_timeout) == (
        "runs/before-sections", 4, ["tensorboard"], 0.0)
    nested = cfg.to_dict()
    assert nested["optim"]["lr"] == 3e-3 and nested["pipeline"]["enabled"] is False and "lr" not in nested
    assert read_saved(json.loads(json.dumps(nested))) == cfg  # through JSON, as config.json holds it
    with pytest.raises(ConfigError, match=r"^batch_size must be a whole number, got '4'"):
        read_saved({**old, "batch_size": "4"})


def test_updated_copies_and_checks():
    base = TrainConfig()
    new = updated(base, max_steps=5, pipeline=False, lr=1)
    assert (new.run.max_steps, new.pipeline.enabled, new.optim.lr) == (5, False, 1.0)
    assert (base.run.max_steps, base.pipeline.enabled) == (None, True)
    with pytest.raises(ConfigError, match="unknown setting 'batchsize' in updated\\(\\); did you mean 'batch_size'"):
        updated(base, batchsize=8)
