"""An export resolved the way vLLM's and SGLang's loaders resolve it (read from their code, which cannot
run here: rules in dflash/eval/engine_contracts.py), held against what the drafter trained on: every rule
gets a constructed drift that must be caught, and our own exports of each kind must pass."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_export import make_drafter
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash.cli import main
from dflash.eval.engine_contracts import check_config, serve_commands, sglang_contract, vllm_contract
from dflash.model.dflash2 import DFlash2Config
from dflash.model.drafter import FULL, SLIDING
from dflash.model.export import checkpoint_dict, hf_config

BASE = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=60, num_target_layers=12, target_layer_ids=[1, 5, 9], mask_token_id=59,
            block_size=8)


def kinds():
    """(trained config, its export's config.json) for each export kind: DFlash, sliding-window, DFlash2."""
    plain = make_drafter().config
    window = make_drafter(layer_types=[FULL, SLIDING], sliding_window=4).config
    two = DFlash2Config(**BASE, conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4,
                        input_embedding_scale=2.0, final_logit_softcapping=30.0)
    return {name: (cfg, hf_config(cfg, torch.bfloat16)) for name, cfg in
            [("dflash", plain), ("sliding", window), ("dflash2", two)]}


@pytest.mark.parametrize("kind", ["dflash", "sliding", "dflash2"])
def test_our_exports_read_as_trained_by_both_engines(kind):
    cfg, d = kinds()[kind]
    assert check_config(d, cfg) == []
    assert vllm_contract(d, cfg.block_size - 1).target_layer_ids == cfg.target_layer_ids
    # the engine-side numbers themselves, not only their agreement: vLLM's aux ids count one more
    assert d["dflash_config"]["target_layer_ids"] == [1, 5, 9] and sglang_contract(d).block_size == cfg.block_size


def lines(d, cfg, engines=("vllm", "sglang")):
    return [str(x) for x in check_config(d, cfg, engines)]


def drift(kind, edit):
    cfg, d = kinds()[kind]
    d = copy.deepcopy(d)
    edit(d, d["dflash_config"])
    return d, cfg


def test_vllm_aux_layers_off_by_one():
    """A converter that writes the tap ids as vLLM's aux ids (no +1) shifts every tap by one layer."""
    d, cfg = drift("dflash", lambda d, dc: d.update(eagle_aux_hidden_state_layer_ids=[1, 5, 9]))
    assert lines(d, cfg) == ["vllm: tap layers (target_layer_ids) is [0, 4, 8] as served, [1, 5, 9] as trained"]
    d["eagle_aux_hidden_state_layer_ids"] = [2, 6, 10]  # written right: the layer's input, one more
    assert lines(d, cfg) == []


def test_vllm_top_level_taps_and_none():
    d, cfg = drift("dflash", lambda d, dc: (dc.pop("target_layer_ids"), d.update(target_layer_ids=[1, 5, 9])))
    assert lines(d, cfg) == []  # the top-level list, +1 like dflash_config's
    del d["target_layer_ids"]
    assert lines(d, cfg, ("vllm",)) == [
        "vllm: tap layers (target_layer_ids) is not stated (the engine's default) as served, [1, 5, 9] as trained"]
    # SGLang without taps builds them from num_target_layers and the drafter's depth (2 layers: [1, 9])
    assert lines(d, cfg, ("sglang",)) == [
        "sglang: tap layers (target_layer_ids) is [1, 9] as served, [1, 5, 9] as trained"]


def test_block_size_per_engine():
    cfg, d = kinds()["dflash"]
    # vLLM takes the block from the command line: 15 draft tokens on a block-8 drafter is a block of 16
    assert vllm_contract(d, 15).block_size == 16
    assert serve_commands("out", cfg, "t")["vllm"].endswith('"num_speculative_tokens": 7}\'')
    assert serve_commands("out", cfg, "t")["sglang"].endswith("--speculative-num-draft-tokens 8")
    d2, _ = drift("dflash", lambda d, dc: dc.update(block_size=16))  # dflash_config wins over the top level
    assert lines(d2, cfg) == ["sglang: block size is 16 as served, 8 as trained"]
    d3, _ = drift("dflash", lambda d, dc: (dc.pop("block_size"), d.pop("block_size")))
    assert lines(d3, cfg) == ["sglang: block size is not stated (the engine's default) as served, 8 as trained"]


def test_causality_overrides():
    d, cfg = drift("dflash", lambda d, dc: d.update(is_causal=True))
    assert lines(d, cfg) == ['vllm: layer attention (layers [0, 1]) is ["full, causal", "full, causal"] as served, '
                             '["full, bidirectional", "full, bidirectional"] as trained']
    d, cfg = drift("sliding", lambda d, dc: dc.update(causal=False))
    assert lines(d, cfg) == ['vllm: layer attention (layers [1]) is ["sliding 4, bidirectional"] as served, '
                             '["sliding 4, causal"] as trained']


def test_windows_and_layer_types():
    d, cfg = drift("sliding", lambda d, dc: dc.update(swa_window_size=128))  # vLLM only reads it first
    assert lines(d, cfg) == ['vllm: layer attention (layers [1]) is ["sliding 128, causal"] as served, '
                             '["sliding 4, causal"] as trained']
    d, cfg = drift("sliding", lambda d, dc: d.pop("layer_types"))  # vLLM: no layer_types, no use_swa: all full
    assert [x.split(" is ")[0] for x in lines(d, cfg)] == ["vllm: layer attention (layers [1])",
                                                          "sglang: layer attention (layers [1])"]
    d, cfg = drift("dflash", lambda d, dc: dc.update(use_swa=True, swa_window_size=16))  # every layer slides
    assert lines(d, cfg) == ['vllm: layer attention (layers [0, 1]) is ["sliding 16, bidirectional", "sliding 16, '
                             'bidirectional"] as served, ["full, bidirectional", "full, bidirectional"] as trained']
    d, cfg = drift("sliding", lambda d, dc: d.update(sliding_window=None))
    assert [x.split(" (")[0] for x in lines(d, cfg)] == ["vllm: loading is refused", "sglang: loading is refused"]
    cfg, d = kinds()["sliding"]  # mixed layers: fine, but vLLM's V1 runner refuses them
    assert vllm_contract(d, 7).needs and serve_commands("o", cfg, "t", d)["vllm"].startswith(
        "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve")


def test_mask_token():
    d, cfg = drift("dflash", lambda d, dc: dc.pop("mask_token_id"))
    assert lines(d, cfg) == [
        "vllm: mask token is not stated (the engine's default) as served, 59 as trained",
        "sglang: mask token is the token named '<|MASK|>' as served, 59 as trained"]
    d["mask_token_id"] = 59  # the top level is read second by both
    assert lines(d, cfg) == []


def test_dflash2_keys():
    d, cfg = drift("dflash2", lambda d, dc: dc.update(input_embedding_scale=1.0))
    assert lines(d, cfg) == ["vllm: dflash_config.input_embedding_scale is 1.0 as served, 2.0 as trained"]
    d, cfg = drift("dflash2", lambda d, dc: d.update(conv_kernel_size=dc.pop("conv_kernel_size")))  # moved up
    got = lines(d, cfg)
    assert got[0].startswith("vllm: loading is refused (KeyError: dflash_config['conv_kernel_size']")
    assert got[1].startswith("sglang: loading is refused (ValueError: DFLASH needs conv_kernel_size and "
                             "conv_group_size together")
    d, cfg = drift("dflash2", lambda d, dc: dc.update(final_logit_softcapping=0.0))
    assert lines(d, cfg) == ["vllm: dflash_config.final_logit_softcapping is None as served, 30.0 as trained",
                             "sglang: dflash_config.final_logit_softcapping is None as served, 30.0 as trained"]
    d, cfg = drift("dflash2", lambda d, dc: d.update(architectures=["DFlashDraftModel"]))
    assert lines(d, cfg, ("sglang",)) == ["sglang: architectures is DFlashDraftModel as served, DFlash2DraftModel "
                                          "as trained"]


def test_vllm_switches():
    d, cfg = drift("dflash", lambda d, dc: d.update(is_neox_style=False))
    assert lines(d, cfg) == ["vllm: is_neox_style is False as served, True as trained"]


def test_export_command_checks_and_prints_serve_commands(tmp_path, capsys):
    torch.save(checkpoint_dict(make_drafter(layer_types=[FULL, SLIDING], sliding_window=4)), tmp_path / "c.pt")
    out = tmp_path / "out"
    assert main(["export", str(tmp_path / "c.pt"), "--out", str(out), "--target", "Qwen/Qwen3-8B"]) == 0
    text = capsys.readouterr().out
    assert "engine check: vllm and sglang read it as trained" in text
    assert ("serve with vllm: VLLM_USE_V2_MODEL_RUNNER=1 vllm serve Qwen/Qwen3-8B --speculative-config "
            f"'{{\"method\": \"dflash\", \"model\": \"{out}\", \"num_speculative_tokens\": 7}}'") in text
    assert (f"serve with sglang: python -m sglang.launch_server --model-path Qwen/Qwen3-8B --speculative-algorithm "
            f"DFLASH --speculative-draft-model-path {out} --speculative-num-draft-tokens 8") in text

    d = json.loads((out / "config.json").read_text())
    d["eagle_aux_hidden_state_layer_ids"] = [1, 5, 9]  # a converter's off-by-one, after the fact
    (out / "config.json").write_text(json.dumps(d))
    assert main(["export", "--check", "vllm", str(out), "--trained", str(tmp_path / "c.pt")]) == 1
    err = capsys.readouterr().err
    assert err == ("dflash export: MISMATCH vllm: tap layers (target_layer_ids) is [0, 4, 8] as served, [1, 5, 9] "
                   "as trained\n")
    assert main(["export", "--check", "sglang", str(out)]) == 0  # SGLang reads dflash_config's taps
    assert main(["export", "--check", "all", str(tmp_path)]) == 2
    assert "holds no config.json" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "c.pt")]) == 2
    assert "give --out DIR" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# DSpark's heads (vLLM's qwen3_dspark.py, SGLang's models/dspark.py; rules in engine_contracts.py)
# --------------------------------------------------------------------------------------------------
def dspark(fmt):
    from dflash.model.dspark import DSparkConfig
    from dflash.model.dspark_formats import config_json

    cfg = DSparkConfig(**{**BASE, "block_size": 7}, markov_rank=16)
    return cfg, config_json(cfg, fmt, torch.bfloat16)


def test_dspark_exports_read_as_trained_and_speculators_refused_by_sglang():
    """The default (DeepSpec) format loads in both; SpecForge's keeps the settings inside dflash_config,
    where SGLang reads them and vLLM does not; speculators' SGLang refuses by its convention."""
    from dflash.eval.engine_contracts import check_dspark

    cfg, d = dspark("deepspec")
    assert check_dspark(d, cfg) == []
    cfg, d = dspark("specforge")
    assert check_dspark(d, cfg, ("sglang",)) == []
    assert [str(x) for x in check_dspark(d, cfg, ("vllm",))] == [
        "vllm: loading is refused (AttributeError: the config has no markov_rank (vLLM reads it from the top level)) "
        "as served, a drafter that loads as trained"]
    cfg, d = dspark("speculators")
    assert check_dspark(d, cfg, ("vllm",)) == []
    got = [str(x) for x in check_dspark(d, cfg, ("sglang",))]
    assert len(got) == 1 and got[0].startswith("sglang: loading is refused (ValueError: a speculators-convention "
                                               "DSpark checkpoint"), got


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.pop("markov_rank"), ["vllm: loading is refused (AttributeError: the config has no markov_rank",
                                      "sglang: loading is refused (ValueError: DSpark requires markov_rank > 0"]),
    (lambda d: d.update(draft_vocab_size=32), ["vllm: draft_vocab_size is 32 as served, 60 as trained"]),
    (lambda d: d.pop("enable_confidence_head"),
     ["vllm: enable_confidence_head is False as served, True as trained"]),
    (lambda d: d.pop("confidence_head_with_markov"),
     ["vllm: loading is refused (ValueError: confidence_head.proj.weight is [1, hidden + markov_rank]"]),
    (lambda d: d.update(dspark_draft_topk=8), ["vllm: dspark_draft_topk is 8 as served, None as trained"]),
    (lambda d: d.update(markov_rank=0), ["vllm: markov_rank is 0 as served, 16 as trained",
                                         "sglang: loading is refused (ValueError: DSpark requires markov_rank > 0"]),
    (lambda d: d.update(markov_head_type="bigram"),
     ["sglang: loading is refused (ValueError: unsupported DSpark markov_head_type 'bigram')"]),
    (lambda d: d.update(enable_confidence_head=False),
     ["vllm: enable_confidence_head is False as served, True as trained",
      "sglang: enable_confidence_head is False as served, True as trained"]),
], ids=["no-rank", "vocab", "no-confidence-flag", "no-markov-input", "topk", "rank-0", "head-type",
        "confidence-off"])
def test_each_dspark_drift_is_one_line(edit, says):
    from dflash.eval.engine_contracts import check_dspark

    cfg, d = dspark("deepspec")
    edit(d)
    got = [str(x) for x in check_dspark(d, cfg)]
    assert len(got) == len(says) and all(g.startswith(s) for g, s in zip(got, says, strict=True)), got


def test_export_check_of_a_dspark_export(tmp_path, capsys):
    cfg, d = dspark("deepspec")
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert main(["export", "--check", "all", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "engine check: vllm reads the DSpark drafter as trained" in out and "sglang reads" in out
    d["dspark_draft_topk"] = 8
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert main(["export", "--check", "vllm", str(tmp_path)]) == 1
    assert capsys.readouterr().err == ("dflash export: MISMATCH vllm: dspark_draft_topk is 8 as served, None as "
                                       "trained\n")


# --------------------------------------------------------------------------------------------------
# DSpark's backbone (vLLM's DSpark model reads it as its DFlash model does; SGLang's DSpark parser puts
# its dspark_ keys and the top-level mask first): rules in engine_contracts.py
# --------------------------------------------------------------------------------------------------
LOADS = {"deepspec": ("vllm", "sglang"), "speculators": ("vllm",), "specforge": ("sglang",)}


@pytest.mark.parametrize("fmt", sorted(LOADS))
def test_dspark_backbone_of_each_format_read_as_trained(fmt):
    from dflash.eval.engine_contracts import check_dspark, sglang_dspark_backbone, vllm_dspark_backbone

    cfg, d = dspark(fmt)
    assert check_dspark(d, cfg, LOADS[fmt]) == []
    # the engines' own numbers, not only their agreement with ours
    if "vllm" in LOADS[fmt]:
        v = vllm_dspark_backbone(d)
        assert (v.target_layer_ids, v.mask_token, len(v.layers)) == ([1, 5, 9], 59, 2)
    if "sglang" in LOADS[fmt]:
        s = sglang_dspark_backbone(d)
        assert (s.target_layer_ids, s.block_size, s.mask_token) == ([1, 5, 9], 7, 59)


@pytest.mark.parametrize("fmt, edit, says", [
    ("deepspec", lambda d: d.update(dspark_target_layer_ids=[2, 6, 10]),
     ["sglang: tap layers (target_layer_ids) is [2, 6, 10] as served, [1, 5, 9] as trained"]),
    ("deepspec", lambda d: d.update(eagle_aux_hidden_state_layer_ids=[1, 5, 9]),
     ["vllm: tap layers (target_layer_ids) is [0, 4, 8] as served, [1, 5, 9] as trained"]),
    ("deepspec", lambda d: d["dflash_config"].update(target_layer_ids=[2, 6, 10]),
     ["vllm: tap layers (target_layer_ids) is [2, 6, 10] as served, [1, 5, 9] as trained",
      "sglang: tap layers (target_layer_ids) is [2, 6, 10] as served, [1, 5, 9] as trained"]),
    ("deepspec", lambda d: (d.pop("block_size"), d["dflash_config"].pop("block_size")),
     ["sglang: block size is not stated (the engine's default) as served, 7 as trained"]),
    ("deepspec", lambda d: d.update(dspark_block_size=8), ["sglang: block size is 8 as served, 7 as trained"]),
    ("deepspec", lambda d: d.update(mask_token_id=58), ["sglang: mask token is 58 as served, 59 as trained"]),
    ("deepspec", lambda d: d.update(dspark_noise_token_id=3), ["sglang: mask token is 3 as served, 59 as trained"]),
    ("deepspec", lambda d: (d.pop("mask_token_id"), d["dflash_config"].pop("mask_token_id")),
     ["vllm: mask token is not stated (the engine's default) as served, 59 as trained",
      "sglang: loading is refused (ValueError: DSpark requires mask_token_id"]),
    ("deepspec", lambda d: d.update(is_causal=True),
     ['vllm: layer attention (layers [0, 1]) is ["full, causal", "full, causal"] as served']),
    ("deepspec", lambda d: d["dflash_config"].update(use_swa=True, swa_window_size=16),
     ['vllm: layer attention (layers [0, 1]) is ["sliding 16, bidirectional", "sliding 16, bidirectional"]']),
    ("deepspec", lambda d: d.update(num_hidden_layers=3, layer_types=["full_attention"] * 3),
     ["vllm: num_hidden_layers is 3 as served, 2 as trained", "sglang: num_hidden_layers is 3 as served, 2"]),
    ("speculators", lambda d: d.update(aux_hidden_state_layer_ids=[1, 5, 9]),
     ["vllm: tap layers (target_layer_ids) is [0, 4, 8] as served, [1, 5, 9] as trained"]),
    ("specforge", lambda d: d["dflash_config"].update(target_layer_ids=[2, 6, 10]),
     ["sglang: tap layers (target_layer_ids) is [2, 6, 10] as served, [1, 5, 9] as trained"]),
    ("specforge", lambda d: d["dflash_config"].pop("block_size"),
     []),  # the top-level block_size is read second
], ids=["sglang-dspark-taps", "vllm-aux-off-by-one", "taps-shifted", "no-block", "dspark-block", "top-mask-first",
        "noise-token", "no-mask", "causal", "use-swa", "depth", "speculators-aux", "specforge-taps",
        "specforge-top-block"])
def test_each_dspark_backbone_drift_is_one_line(fmt, edit, says):
    from dflash.eval.engine_contracts import check_dspark

    cfg, d = dspark(fmt)
    edit(d)
    got = [str(x) for x in check_dspark(d, cfg, LOADS[fmt])]
    assert len(got) == len(says) and all(g.startswith(s) for g, s in zip(got, says, strict=True)), got
