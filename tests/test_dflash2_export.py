"""DFlash2 drafters on disk: the reference's names and config keys, round trips through an export and a
checkpoint, the reference's own model.py reading our export (when its DFlash2 version is at hand:
DFLASH_REFERENCE_MODEL_PY), and runs that train, export and start again from a DFlash2 release."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from test_drafter_release import _train, reference, setup  # noqa: F401 (fixtures)
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash.cli import main
from dflash.model.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.model.export import checkpoint_dict
from dflash.model.loading import load_drafter, load_exported
from dflash.model.released import ReleaseMismatch, start_from_release
from dflash.model.write_export import export_drafter
from dflash.targets import load_target

SMALL = dict(selector_top_k=4, selector_rank=8, conv_group_size=16)


def scrambled(target, seed: int = 0, **kw) -> DFlash2Drafter:
    cfg = DFlash2Config.for_target(target.config, num_layers=2, block_size=4, target_layer_ids=target.layer_ids,
                                   mask_token_id=target.default_mask_token_id())
    torch.manual_seed(seed)
    d = DFlash2Drafter(DFlash2Config(**{**cfg.__dict__, "conv_kernel_size": 2, **SMALL, **kw}))
    with torch.no_grad():  # off the identity start, so a dropped piece would show
        for name, p in d.named_parameters():
            if "conv" in name or "codebook" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return d.eval()


@pytest.fixture(scope="module")
def target(setup):  # noqa: F811
    return load_target(setup[1], layer_ids=[1, 3])


def test_the_files_use_the_references_names_and_config_keys(target, tmp_path):
    d = scrambled(target)
    export_drafter(d, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - not a dict
    h, v, groups = d.config.hidden_size, d.config.vocab_size, d.config.hidden_size // 16
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert shapes[f"layers.{i}.{conv}.base_kernel"] == (2, 2, h)
            assert shapes[f"layers.{i}.{conv}.kernel_projection.weight"] == (2 * 2 * groups, h)
    assert shapes["candidate_selector.predecessor_codebook"] == (v, 8)  # no .weight: the reference maps them
    assert shapes["candidate_selector.successor_codebook"] == (v, 8)
    assert shapes["candidate_selector.hidden_projection.weight"] == (8, h)
    assert not any(k.endswith("codebook.weight") for k in shapes)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert cfg["layer_types"] == ["full_attention"] * 2 and cfg["sliding_window"] is None
    assert cfg["dflash_config"] == {
        "mask_token_id": d.config.mask_token_id, "target_layer_ids": [1, 3], "block_size": 4,
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4,
        "input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def test_an_export_and_a_checkpoint_read_back_the_same_drafter(target, tmp_path):
    d = scrambled(target)
    export_drafter(d, tmp_path / "export")
    torch.save(checkpoint_dict(d), tmp_path / "step.pt")
    g = torch.Generator().manual_seed(1)
    noise, hidden = torch.randn(1, 4, d.config.hidden_size, generator=g), torch.randn(1, 7, 2 * d.config.hidden_size,
                                                                                      generator=g)
    with torch.no_grad():
        want = d(noise, hidden, torch.arange(7, 11)[None], torch.arange(7)[None])
        for back in (load_exported(tmp_path / "export"), load_drafter(tmp_path / "step.pt")):
            assert isinstance(back, DFlash2Drafter) and back.config == d.config
            torch.testing.assert_close(back.eval()(noise, hidden, torch.arange(7, 11)[None], torch.arange(7)[None]),
                                       want, rtol=0, atol=0)


def test_the_references_dflash2_reads_our_export(target, reference, tmp_path):  # noqa: F811
    if not hasattr(reference, "DFlash2DraftModel"):
        pytest.skip("the reference model.py at hand predates DFlash2 (set DFLASH_REFERENCE_MODEL_PY)")
    d = scrambled(target, conv_kernel_size=3)
    export_drafter(d, tmp_path)
    model, info = reference.DFlash2DraftModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    g = torch.Generator().manual_seed(2)
    c, q = 9, 4
    noise, hidden = torch.randn(1, q, d.config.hidden_size, generator=g), torch.randn(1, c, 2 * d.config.hidden_size,
                                                                                      generator=g)
    with torch.no_grad():
        mine = d(noise, hidden, torch.arange(c, c + q)[None], torch.arange(c)[None])
        theirs = model(position_ids=torch.arange(c + q)[None], noise_embedding=noise, target_hidden=hidden)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
        head = target.lm_head
        ours_p = d.propose(mine[:, 1:], torch.tensor([5]), head).tokens
        assert ours_p.tolist() == model.propose(mine[:, 1:], torch.tensor([5]), head, 0.0)[0].tolist()


def test_a_dflash2_run_trains_evaluates_losslessly_exports_and_starts_again_from_its_release(setup, tmp_path,  # noqa: F811
                                                                                             capsys):
    assert _train(setup, tmp_path / "run", drafter_type="dflash2", **SMALL) == 0
    out = capsys.readouterr().out
    assert "DFlash2: conv kernel 2 group 16, selector rank 8 top-4" in out and "sel recall" in out, out
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert evals and all(e["lossless"] for e in evals), evals
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "release")]) == 0
    assert json.loads((tmp_path / "release" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    # the release says what it is: no --drafter-type needed
    assert _train(setup, tmp_path / "again", init_from=str(tmp_path / "release")) == 0
    out = capsys.readouterr().out
    assert "drafter initialised from" in out and "selector rank 8 top-4" in out, out


def test_a_release_is_refused_in_one_line_when_it_cannot_be_what_the_run_asks(setup, target, tmp_path):  # noqa: F811
    from dflash.model.drafter import DFlashDrafter, DrafterConfig

    plain = DrafterConfig.for_target(target.config, num_layers=1, block_size=4, target_layer_ids=target.layer_ids,
                                     mask_token_id=target.default_mask_token_id())
    export_drafter(DFlashDrafter(plain), tmp_path / "dflash")
    with pytest.raises(ReleaseMismatch, match="a DFlash drafter, not a DFlash2 one: drop --drafter-type dflash2"):
        start_from_release(tmp_path / "dflash", target, block_size=4, drafter_type="dflash2")
    capped = scrambled(target)
    capped.config.final_logit_softcapping = 30.0  # made for a target that soft-caps its logits
    export_drafter(capped, tmp_path / "capped")
    with pytest.raises(ReleaseMismatch) as e:
        start_from_release(tmp_path / "capped", target, block_size=4)
    assert "its final_logit_softcapping is 30.0, the target applies None" in str(e.value)


@pytest.mark.parametrize(("flags", "says"), [
    (["--selector-rank", "0"], "selector_rank must be at least 1, got 0"),
    (["--selector-top-k", "5000"], "selector_top_k 5000 is more candidates than the vocabulary has"),
    (["--conv-group-size", "7"], "conv_group_size 7 does not divide the hidden size 64"),
    (["--conv-kernel-size", "9"], "conv_kernel_size 9 is longer than the block (4 tokens)"),
])
def test_bad_selector_settings_are_one_line_each(setup, tmp_path, capsys, flags, says):  # noqa: F811
    _, target_dir, data = setup
    rc = main(["train", "--target", str(target_dir), "--data", str(data), "--run-dir", str(tmp_path / "run"),
               "--max-steps", "1", "--block-size", "4", "--no-telemetry", "--drafter-type", "dflash2", *flags])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("dflash train: error")]
    assert rc == 2 and len(errors) == 1 and says in errors[0], err  # the rest is transformers' loading bar
