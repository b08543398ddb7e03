"""Export in the reference (z-lab) format, import back, checkpoints, and the `dflash export` command."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict

import pytest
import torch
from safetensors import safe_open
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash.cli import main
from dflash.model.blocks import forward_blocks
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.export import DrafterLoadError, checkpoint_dict, config_from_hf
from dflash.model.loading import load_drafter, load_exported
from dflash.model.write_export import export_drafter

H, V = 32, 60


def make_drafter(seed: int = 0, **kw) -> DFlashDrafter:
    torch.manual_seed(seed)
    base = dict(hidden_size=H, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=V, num_target_layers=12, target_layer_ids=[1, 5, 9], mask_token_id=V - 1,
                block_size=8, rope_theta=250000.0, rms_norm_eps=1e-5)
    base.update(kw)
    d = DFlashDrafter(DrafterConfig(**base))
    with torch.no_grad():  # non-trivial norm weights, so a dropped or swapped norm would show
        for name, p in d.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return d


def block_outputs(d: DFlashDrafter) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    embed = torch.nn.Embedding.from_pretrained(torch.randn(V, H, generator=g))
    ids = torch.randint(0, V - 1, (2, 30), generator=g)
    hidden = torch.randn(2, 30, 3 * H, generator=g)
    head = torch.nn.Linear(H, V, bias=False)
    head.weight.data = torch.randn(V, H, generator=g)
    with torch.no_grad():  # logits through a fixed "target" head
        h = forward_blocks(d, embed, ids, hidden, torch.tensor([[0, 7, 20], [3, 4, 22]]), attn_backend="sdpa")
        return head(h.float())


def test_round_trip_gives_identical_logits(tmp_path):
    d = make_drafter()
    export_drafter(d, tmp_path / "x")
    d2 = load_exported(tmp_path / "x")
    assert d2.config == d.config
    assert torch.equal(block_outputs(d2), block_outputs(d))


def test_files_use_the_reference_names_and_config_fields(tmp_path):
    d = make_drafter()
    out = export_drafter(d, tmp_path / "x", dtype=torch.bfloat16)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert keys == set(d.state_dict())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_proj.weight",
            "layers.0.self_attn.k_norm.weight", "layers.1.mlp.gate_proj.weight",
            "layers.0.input_layernorm.weight"} <= keys
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 12 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": [1, 5, 9], "block_size": 8}
    assert cfg["dtype"] == "bfloat16"
    d2 = load_exported(out)
    assert d2.fc.weight.dtype == torch.bfloat16 and d2.config == d.config


def test_transformers_reads_the_config_and_its_qwen3_pieces_compute_what_ours_do(tmp_path):
    """An engine builds Qwen3 layers from config.json: its RoPE, RMSNorm and MLP must equal ours."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

    d = make_drafter()
    out = export_drafter(d, tmp_path / "x")
    cfg = Qwen3Config.from_pretrained(out)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.num_key_value_heads) == (H, 2, 8, 2)
    assert cfg.dflash_config["target_layer_ids"] == [1, 5, 9]

    pos = torch.arange(40)[None]
    cos, sin = Qwen3RotaryEmbedding(cfg)(torch.zeros(1, 40, H), pos)
    our_cos, our_sin = d.rotary(pos, torch.float32)
    torch.testing.assert_close(our_cos[:, 0], cos)
    torch.testing.assert_close(our_sin[:, 0], sin)

    x = torch.randn(3, 5, H)
    mlp = Qwen3MLP(cfg)
    mlp.load_state_dict(d.layers[1].mlp.state_dict())
    torch.testing.assert_close(mlp(x), d.layers[1].mlp(x))
    norm = Qwen3RMSNorm(H, eps=cfg.rms_norm_eps)
    norm.load_state_dict(d.layers[0].input_layernorm.state_dict())
    torch.testing.assert_close(norm(x), d.layers[0].input_layernorm(x))
    qn = Qwen3RMSNorm(8, eps=cfg.rms_norm_eps)
    qn.load_state_dict(d.layers[0].self_attn.q_norm.state_dict())
    torch.testing.assert_close(qn(x.view(3, 5, 4, 8)), d.layers[0].self_attn.q_norm(x.view(3, 5, 4, 8)))


def test_reads_reference_style_configs_with_top_level_fields():
    d = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 100, "block_size": 10, "num_target_layers": 36,
         "target_layer_ids": [18], "mask_token_id": 99, "rope_theta": 1e6}
    c = config_from_hf(d)
    assert (c.head_dim, c.block_size, c.gamma, c.target_layer_ids, c.mask_token_id) == (16, 10, 5.0, [18], 99)
    with pytest.raises(DrafterLoadError):
        config_from_hf({**d, "target_layer_ids": None})


def test_load_drafter_from_checkpoint_file_run_dir_and_export(tmp_path):
    d_old, d_new = make_drafter(1), make_drafter(2)
    run = tmp_path / "run"
    run.mkdir()
    torch.save({**checkpoint_dict(d_new), "step": 20, "optimizer": {}}, run / "checkpoint-20.pt")
    torch.save({**checkpoint_dict(d_old), "step": 3}, run / "checkpoint-3.pt")
    os.utime(run / "checkpoint-20.pt", (time.time() - 100, time.time() - 100))  # older mtime, higher step
    assert torch.equal(block_outputs(load_drafter(run)), block_outputs(d_new))
    assert torch.equal(block_outputs(load_drafter(run / "checkpoint-3.pt")), block_outputs(d_old))
    torch.save({"drafter_config": asdict(d_old.config), "drafter": d_old.state_dict()}, run / "latest.pt")
    assert torch.equal(block_outputs(load_drafter(run)), block_outputs(d_old))
    export_drafter(d_new, tmp_path / "exp")
    assert torch.equal(block_outputs(load_drafter(tmp_path / "exp")), block_outputs(d_new))
    # The trainer's layout: RUN/checkpoints/step-<n>.pt, highest step wins.
    (tmp_path / "run2" / "checkpoints").mkdir(parents=True)
    torch.save(checkpoint_dict(d_old), tmp_path / "run2" / "checkpoints" / "step-00000100.pt")
    torch.save(checkpoint_dict(d_new), tmp_path / "run2" / "checkpoints" / "step-00000009.pt")
    assert torch.equal(block_outputs(load_drafter(tmp_path / "run2")), block_outputs(d_old))


def test_load_drafter_errors_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    torch.save({"model": {}}, tmp_path / "other.pt")
    export_drafter(make_drafter(num_layers=1), tmp_path / "short")
    cfg = json.loads((tmp_path / "short" / "config.json").read_text())
    cfg["num_hidden_layers"], cfg["layer_types"] = 2, ["full_attention"] * 2  # weights for one layer, config for two
    (tmp_path / "short" / "config.json").write_text(json.dumps(cfg))
    for path, needle in [(tmp_path / "missing", "no such file"), (tmp_path / "empty", "neither an export"),
                         (tmp_path / "bad.pt", "not a readable checkpoint"),
                         (tmp_path / "other.pt", "not a dflash checkpoint"),
                         (tmp_path / "short", "do not match")]:
        with pytest.raises(DrafterLoadError) as e:
            load_drafter(path)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_export_command(tmp_path, capsys):
    d = make_drafter()
    torch.save(checkpoint_dict(d), tmp_path / "ckpt.pt")
    assert main(["export", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "out"), "--dtype", "keep"]) == 0
    assert "exported" in capsys.readouterr().out
    assert torch.equal(block_outputs(load_exported(tmp_path / "out")), block_outputs(d))
    assert main(["export", str(tmp_path / "nothing.pt"), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash export: error:") and err.count("\n") == 1


def far_block_outputs(d: DFlashDrafter, start: int) -> torch.Tensor:
    """Drafter hidden states for one block at positions start.., reading context spread over 0..start-1
    (RoPE is relative: what a rounded frequency spoils is attention across thousands of positions)."""
    g = torch.Generator().manual_seed(4)
    noise = torch.randn(1, 8, H, generator=g)
    hidden = torch.randn(1, 64, 3 * H, generator=g)
    positions = torch.arange(start, start + 8)[None]
    ctx_positions = torch.linspace(0, start - 1, 64).long()[None]
    with torch.no_grad():
        return d(noise, hidden, positions, ctx_positions).float()


@pytest.mark.parametrize("run_dtype", [torch.float32, torch.bfloat16])
def test_bf16_export_evaluated_as_dflash_eval_does_matches_fp32_far_into_the_sequence(tmp_path, run_dtype):
    """A bf16 export, loaded as `dflash eval` loads it (then cast to the target's dtype), computes what
    the fp32 drafter computes within bf16 tolerance at position ~4000: the RoPE frequencies must not be
    rounded to bf16 (that alone turns angles there by radians)."""
    d = make_drafter(head_dim=16)
    with torch.no_grad():  # sharp attention whose output outweighs the residual, so positions matter
        for name, p in d.named_parameters():
            p.mul_(3.0 if "q_norm" in name or "k_norm" in name else 10.0 if "v_proj" in name or "o_proj" in name
                   else 1.0)
    export_drafter(d, tmp_path / "x", dtype=torch.bfloat16)
    loaded = load_drafter(tmp_path / "x").to(device="cpu", dtype=run_dtype)  # as commands/eval.py does
    assert loaded.fc.weight.dtype == run_dtype and loaded.rotary.inv_freq.dtype == torch.float32
    for start in (8, 3990, 4000):
        ref = far_block_outputs(d, start)
        err = (far_block_outputs(loaded, start) - ref).norm() / ref.norm()
        assert err < 0.1, (start, float(err))  # rounded frequencies: 0.6-0.8 at 3990-4000


def test_export_of_a_run_dir_names_its_checkpoint_and_never_overwrites_silently(tmp_path, capsys):
    from dflash.checkpoint_files import FORMAT, save_checkpoint

    run = tmp_path / "run"
    for step in (3, 7):  # written as the trainer writes them: manifest, format tag
        save_checkpoint(run, step, {"format": FORMAT, **checkpoint_dict(make_drafter(num_layers=1))}, keep=3)
    out = tmp_path / "out"
    assert main(["export", str(run), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"from {run}/checkpoints/step-00000007.pt to {out}" in said, said
    weights = (out / "model.safetensors").read_bytes()
    assert main(["export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (f"dflash export: error: --out {out} already holds config.json, model.safetensors; give --force "
                   "to replace the export there, or another --out\n")
    assert (out / "model.safetensors").read_bytes() == weights
    assert main(["export", str(run), "--out", str(out), "--force"]) == 0
    assert main(["export", str(run), "--out", str(out / "config.json")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_exported_files_share_permissions_and_the_message_counts_right(tmp_path, capsys):
    """safetensors writes 0600; config.json follows the umask: the pair must be equally readable."""
    torch.save(checkpoint_dict(make_drafter(num_layers=1)), tmp_path / "ckpt.pt")
    assert main(["export", str(tmp_path / "ckpt.pt"), "--out", str(tmp_path / "out")]) == 0
    assert "(1 layer, full attention, block" in capsys.readouterr().out
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "out").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes
