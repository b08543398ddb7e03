"""The drafter as others read and write it: the target's RoPE scaling, the reference's current config,
an export loaded by the reference's own model.py, and runs that start from a released drafter.

The reference's PyPI package is also named ``dflash`` and cannot share this environment, so its
``model.py`` is loaded here by file path, from the source named by ``DFLASH_REFERENCE_MODEL_PY`` or
else from a fetched z-lab/dflash snapshot (``git show HEAD:dflash/model.py``); without either those
tests skip (the key layout is still checked without it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from test_model_helpers import make_target_dir, make_tokenizer, one_thread  # noqa: F401 (autouse fixture)
from test_train_pipeline import _write_data

from dflash.cli import main
from dflash.model.drafter import FULL, SLIDING, DFlashDrafter, DrafterConfig, Rotary
from dflash.model.export import DrafterLoadError, config_from_hf, hf_config
from dflash.model.loading import load_exported
from dflash.model.released import ReleaseMismatch, start_from_release
from dflash.model.write_export import export_drafter
from dflash.targets import load_target
from dflash.train.config.schema import make_config
from dflash.train.distributed import Dist
from dflash.train.run.build import build, run_target
from dflash.train.trainer import train

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
SNAPSHOT = Path("/work/.mirror/z-lab+dflash/repo")


def _reference_source(tmp: Path) -> Path | None:
    given = os.environ.get("DFLASH_REFERENCE_MODEL_PY")
    if given:
        return Path(given)
    if not SNAPSHOT.exists():
        return None
    out = subprocess.run(["git", "--git-dir", str(SNAPSHOT), "show", "HEAD:dflash/model.py"], capture_output=True,
                         text=True)
    if out.returncode:
        return None
    (tmp / "reference_model.py").write_text(out.stdout)
    return tmp / "reference_model.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference's model module (DFlashDraftModel), loaded by file path."""
    src = _reference_source(tmp_path_factory.mktemp("reference"))
    if src is None:
        pytest.skip("no reference model.py: set DFLASH_REFERENCE_MODEL_PY or fetch z-lab/dflash")
    spec = importlib.util.spec_from_file_location("zlab_dflash_model", src)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3 target whose RoPE is YaRN (as Qwen3.6's), its tokenizer, and data."""
    root = tmp_path_factory.mktemp("release")
    tok = make_tokenizer()
    target_dir = make_target_dir(root / "target", "qwen3", layers=6, vocab=len(tok) + 8, tokenizer=tok)
    cfg = json.loads((target_dir / "config.json").read_text())
    cfg["rope_parameters"] = {**YARN, "rope_theta": cfg.get("rope_theta", 10000.0)}
    (target_dir / "config.json").write_text(json.dumps(cfg))
    data = _write_data(root / "data.jsonl", rows=16)
    return root, target_dir, data


def _qwen3(rope: dict) -> object:
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                       rope_parameters={"rope_theta": 10000.0, **rope})


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 256}])
def test_rope_scaling_is_the_targets(rope):
    """cos/sin (YaRN's attention factor included) equal transformers' Qwen3 rotary for the target's
    config, past max_position_embeddings too (where dynamic NTK stretches)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    target = _qwen3(rope)
    cfg = DrafterConfig.for_target(target, num_layers=1, mask_token_id=3)
    assert cfg.rope_scaling["rope_type"] == rope["rope_type"]
    positions = torch.arange(0, 2500)[None]
    ours = Rotary(cfg)(positions, torch.float32)
    theirs = Qwen3RotaryEmbedding(target)(torch.zeros(1, dtype=torch.float32), positions)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a[:, 0], b, rtol=1e-5, atol=1e-5)
    plain = Rotary(replace(cfg, rope_scaling=None))(positions, torch.float32)
    assert not torch.allclose(plain[0], ours[0])  # the scaling changed something
    with pytest.raises(ValueError, match="'longrope' is not supported"):
        replace(cfg, rope_scaling={"rope_type": "longrope", "factor": 2.0})


def _sliding_drafter(target, window: int = 3, layer_types=(SLIDING, FULL)) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(target.config, num_layers=len(layer_types), block_size=4,
                                   target_layer_ids=target.layer_ids, mask_token_id=target.default_mask_token_id())
    return DFlashDrafter(replace(cfg, layer_types=list(layer_types), sliding_window=window))


def test_the_references_current_config_is_written_and_read(setup):
    _, target_dir, _ = setup
    target = load_target(target_dir, num_draft_layers=2)
    cfg = _sliding_drafter(target, layer_types=(FULL, SLIDING, SLIDING)).config
    d = hf_config(cfg, torch.bfloat16)
    assert d["layer_types"] == [FULL, SLIDING, SLIDING] and d["sliding_window"] == 3
    assert d["use_sliding_window"] is True and d["max_window_layers"] == 1
    assert d["rope_parameters"]["rope_type"] == "yarn" and d["rope_scaling"]["factor"] == 4.0
    assert d["block_size"] == d["dflash_config"]["block_size"] == 4
    assert config_from_hf(d) == cfg
    # newer releases: block_size only inside dflash_config; older Qwen3 form: no layer_types, the
    # window from use_sliding_window + max_window_layers; transformers 4.x: rope_scaling with "type"
    newer = {k: v for k, v in d.items() if k not in ("block_size", "layer_types", "rope_parameters")}
    newer["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    newer["rope_theta"] = cfg.rope_theta
    back = config_from_hf(newer)
    assert (back.block_size, back.layer_types, back.sliding_window) == (4, [FULL, SLIDING, SLIDING], 3)
    assert back.rope_scaling == YARN
    # vLLM's extensions: the window in dflash_config.swa_window_size, use_swa for every layer; a
    # causality the engines' default does not give is refused
    swa = {**full_config(cfg), "dflash_config": {**d["dflash_config"], "use_swa": True, "swa_window_size": 7}}
    assert (config_from_hf(swa).layer_types, config_from_hf(swa).sliding_window) == ([SLIDING] * 3, 7)
    for causal in ({"is_causal": True}, {"dflash_config": {**d["dflash_config"], "causal": False}}):
        with pytest.raises(DrafterLoadError, match="dflash trains sliding layers causal"):
            config_from_hf({**d, **causal})
    assert config_from_hf({**full_config(cfg), "is_causal": False}).layer_types == [FULL] * 3
    full = full_config(cfg)
    assert (full["sliding_window"], full["use_sliding_window"], full["max_window_layers"]) == (None, False, 3)
    assert "rope_scaling" not in full and full["rope_parameters"]["rope_type"] == "default"


def full_config(cfg: DrafterConfig) -> dict:
    """config.json of ``cfg`` with every layer full attention and plain RoPE."""
    return hf_config(replace(cfg, layer_types=None, sliding_window=None, rope_scaling=None), torch.float32)


def test_an_export_loads_in_the_references_model_py(setup, reference, tmp_path):
    """No missing or unexpected keys, the same window per layer, YaRN, and the same output: the
    reference is run in eager mode with the window as its attention mask (all layers slide, so one
    mask serves them all; its SDPA path would ignore the window)."""
    _, target_dir, _ = setup
    target = load_target(target_dir, num_draft_layers=2)
    ours = _sliding_drafter(target, window=3, layer_types=(SLIDING, SLIDING)).eval()
    export_drafter(ours, tmp_path / "export")
    model, info = reference.DFlashDraftModel.from_pretrained(tmp_path / "export", output_loading_info=True,
                                                             attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert [layer.self_attn.sliding_window for layer in model.layers] == [3, 3]
    assert model.rotary_emb.rope_type == "yarn"
    assert (model.block_size, model.mask_token_id, model.target_layer_ids) == (
        4, ours.config.mask_token_id, ours.config.target_layer_ids)

    torch.manual_seed(1)
    c, q = 9, 4
    hidden = torch.randn(1, c, 2 * ours.config.hidden_size)
    noise = torch.randn(1, q, ours.config.hidden_size)
    pos = torch.arange(c + q)[None]
    visible = (pos[0, None, :] <= pos[0, c:, None]) & (pos[0, None, :] > pos[0, c:, None] - 3)
    bias = torch.zeros(1, 1, q, c + q).masked_fill(~visible, float("-inf"))
    with torch.no_grad():
        theirs = model(position_ids=pos, noise_embedding=noise, target_hidden=hidden, attention_mask=bias)
        mine = ours(noise, hidden, pos[:, c:], pos[:, :c])
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_a_drafter_the_reference_saved_loads_with_its_windows(setup, reference, tmp_path):
    _, target_dir, _ = setup
    target = load_target(target_dir, num_draft_layers=2)
    ref_cfg = _qwen3_like(target, reference)
    reference.DFlashDraftModel(ref_cfg).save_pretrained(tmp_path / "theirs")
    loaded = load_exported(tmp_path / "theirs")
    assert loaded.config.layer_types == [SLIDING, FULL] and loaded.config.sliding_window == 5
    assert loaded.config.rope_scaling["rope_type"] == "yarn"
    assert [layer.self_attn.window for layer in loaded.layers] == [5, None]


def _qwen3_like(target, reference):
    """A reference drafter config for ``target``: 2 layers (sliding then full, window 5), its taps."""
    from transformers import Qwen3Config

    t = target.config
    cfg = Qwen3Config(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=2,
                      num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                      head_dim=t.head_dim, vocab_size=t.vocab_size, max_position_embeddings=t.max_position_embeddings,
                      layer_types=[SLIDING, FULL], sliding_window=5, use_sliding_window=True,
                      rope_parameters=dict(t.rope_parameters))
    cfg.architectures = ["DFlashDraftModel"]
    cfg.block_size, cfg.num_target_layers = 4, t.num_hidden_layers
    cfg.dflash_config = {"mask_token_id": target.default_mask_token_id(), "target_layer_ids": target.layer_ids}
    return cfg


def _train(setup, run: Path, **flags) -> int:
    _, target_dir, data = setup
    cfg = make_config({}, dict(target=str(target_dir), data=str(data), run_dir=str(run), batch_size=4,
                               num_anchors=8, block_size=4, max_steps=2, telemetry=False, eval_prompts=2,
                               eval_max_new_tokens=12, checkpoint_every=1e9, **flags))
    return train(cfg)


def test_init_from_an_export_trains_and_evaluates(setup, tmp_path, capsys):
    """A sliding-window export as the start: the run keeps its windows (or takes the given one), trains,
    evaluates losslessly, and its checkpoint carries layer types, window and YaRN on to the next export."""
    _, target_dir, _ = setup
    target = load_target(target_dir, layer_ids=[1, 3])
    export_drafter(_sliding_drafter(target, window=3), tmp_path / "release")
    assert _train(setup, tmp_path / "run", init_from=str(tmp_path / "release")) == 0
    out = capsys.readouterr().out
    assert "drafter initialised from" in out and "1 sliding (window 3)" in out, out
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert evals and all(e["lossless"] for e in evals), evals
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert (again["layer_types"], again["sliding_window"]) == ([SLIDING, FULL], 3)
    assert again["dflash_config"]["target_layer_ids"] == [1, 3] and again["rope_parameters"]["rope_type"] == "yarn"
    # the layer settings override the release's
    assert _train(setup, tmp_path / "run2", init_from=str(tmp_path / "release"),
                  drafter_layer_types=[SLIDING, SLIDING], drafter_sliding_window=6) == 0
    assert "2 sliding (window 6)" in capsys.readouterr().out


def test_init_from_a_drafter_the_reference_saved_trains(setup, reference, tmp_path, capsys):
    """Built with the release's weights (exactly), then trained and evaluated losslessly."""
    _, target_dir, data = setup
    target = load_target(target_dir, layer_ids=[1, 3])
    theirs = reference.DFlashDraftModel(_qwen3_like(target, reference))
    theirs.save_pretrained(tmp_path / "theirs")
    cfg = make_config({}, dict(target=str(target_dir), data=str(data), run_dir=str(tmp_path / "built"),
                               max_steps=1, telemetry=False, init_from=str(tmp_path / "theirs"), block_size=4))
    parts = build(cfg, Dist(), run_target(cfg), log=lambda line: None)
    assert cfg.model.target_layer_ids == [1, 3]  # tapped as the release was trained
    mine = parts.drafter.drafter.state_dict()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(mine[name], tensor), name
    assert _train(setup, tmp_path / "run", init_from=str(tmp_path / "theirs")) == 0
    assert "1 sliding (window 5)" in capsys.readouterr().out
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert evals and all(e["lossless"] for e in evals), evals


def test_a_release_for_another_target_is_refused_in_one_line(setup, tmp_path, capsys):
    _, target_dir, _ = setup
    target = load_target(target_dir, layer_ids=[1, 3])
    good = _sliding_drafter(target)
    cases = {"taps": replace(good.config, target_layer_ids=[1, 4]),
             "hidden": replace(good.config, hidden_size=32, head_dim=8),
             "vocab": replace(good.config, vocab_size=good.config.vocab_size + 1),
             "layers": replace(good.config, num_target_layers=8)}
    for name, cfg in cases.items():
        export_drafter(DFlashDrafter(cfg), tmp_path / name)
    for name, needle in [("taps", "target_layer_ids (taps) is [1, 4], the target's is [1, 3]; pass "
                                  "--target-layer-ids 1,4"),
                         ("hidden", "hidden_size is 32"), ("vocab", "vocab_size is"), ("layers", "layer count is 8")]:
        with pytest.raises(ReleaseMismatch) as e:
            start_from_release(tmp_path / name, target, block_size=4)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    # end to end: one line on stderr, exit 2, nothing trained
    assert _train(setup, tmp_path / "run", init_from=str(tmp_path / "hidden")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash train: error")]
    assert len(errors) == 1 and "made for another target: its hidden_size is 32" in errors[0], errors
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    assert _train(setup, tmp_path / "run3", init_from=str(tmp_path / "nowhere")) == 2
    assert "not a drafter in the reference format" in capsys.readouterr().err


def test_layer_flags_are_checked_before_anything_loads():
    from dflash.train.config import ConfigError

    cfg = make_config({}, {"drafter_layer_types": [SLIDING, FULL], "drafter_sliding_window": 2048, "max_steps": 1})
    assert (cfg.model.drafter_layer_types, cfg.model.drafter_sliding_window) == ([SLIDING, FULL], 2048)
    for flags, needle in [({"drafter_layer_types": ["sliding"]}, "is not a layer type"),
                          ({"drafter_layer_types": [SLIDING]}, "need a window"),
                          ({"drafter_layer_types": [FULL], "drafter_layers": 2}, "1 layer(s) for 2"),
                          ({"drafter_sliding_window": 0}, "at least 1"),
                          ({"drafter_sliding_window": 8}, "needs sliding layers"),
                          ({"init_from": "x", "init_from_target": True}, "keep one")]:
        with pytest.raises(ConfigError) as e:
            make_config({}, {**flags, "max_steps": 1})
        assert needle in str(e.value), (flags, str(e.value))
    assert asdict(DrafterConfig(hidden_size=8, intermediate_size=8, num_layers=1, num_attention_heads=1,
                                num_key_value_heads=1, head_dim=8, vocab_size=4, num_target_layers=2,
                                target_layer_ids=[0]))["layer_types"] == [FULL]
