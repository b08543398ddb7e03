"""Loading targets: tiny random Qwen3 and Llama models saved in the test, and the one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_model_helpers import make_target_dir, make_tokenizer, one_thread  # noqa: F401

from dflash.targets import Target, TargetError, load_target
from dflash.targets.hf import HFTarget


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {
        "qwen3": make_target_dir(root / "qwen3", "qwen3", layers=8, tokenizer=make_tokenizer()),
        "llama": make_target_dir(root / "llama", "llama", layers=4),
        "qwen3_nomask": make_target_dir(root / "q_nomask", "qwen3", layers=2, tokenizer=make_tokenizer(False)),
    }


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_loads_frozen_fp32_and_taps_hidden_states(dirs, arch):
    t = load_target(dirs[arch], num_draft_layers=3)
    assert isinstance(t, HFTarget) and isinstance(t, Target) and t.verifier is t
    assert t.device.type == "cpu" and t.dtype == torch.float32
    assert not t.model.training
    assert not any(p.requires_grad for p in t.model.parameters())
    assert t.layer_ids == {"qwen3": [1, 3, 5], "llama": [1]}[arch]  # 4 layers: 1..N-3 is just [1]
    assert t.hidden_size == 64 and t.num_layers == {"qwen3": 8, "llama": 4}[arch]
    ids = torch.randint(0, 300, (2, 11))
    hs = t.tap_states(ids)
    assert hs.shape == (2, 11, len(t.layer_ids) * 64)
    # Layer i's *output* (the reference's hidden_states[i + 1]), checked against forward hooks.
    outs = {}
    hooks = [t.model.model.layers[i].register_forward_hook(
        lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o)) for i in t.layer_ids]
    with torch.no_grad():
        t.model(ids)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(hs, torch.cat([outs[i] for i in t.layer_ids], -1))
    assert t.embed_tokens.weight.shape == (300, 64) and t.lm_head.weight.shape == (300, 64)


def test_explicit_layer_ids_and_padding_mask(dirs):
    t = load_target(dirs["qwen3"], layer_ids=[2, 6])
    assert t.layer_ids == [2, 6]
    ids = torch.randint(0, 300, (1, 6))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    attn = torch.tensor([[1] * 6 + [0] * 3])
    torch.testing.assert_close(t.tap_states(padded, attn)[:, :6], t.tap_states(ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(TargetError):
        load_target(dirs["qwen3"], layer_ids=[8])


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_right_padded_batches_need_no_mask(dirs, arch):
    """Training passes no mask (TargetStage): with right padding every real token's states equal those
    of the masked forward. Qwen3 (the built-in target's architecture) also takes the prepared-mask
    mapping that skips transformers' host read of the position ids; a model that does not keeps the
    plain path."""
    t = load_target(dirs[arch])
    if arch == "qwen3":
        assert t._causal_only == {"full_attention": None}
    ids = torch.randint(4, 300, (2, 9))
    attn = torch.ones(2, 9, dtype=torch.long)
    ids[1, 5:], attn[1, 5:] = 2, 0
    masked, free = t.tap_states(ids, attn), t.tap_states(ids)
    torch.testing.assert_close(free[0], masked[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(free[1, :5], masked[1, :5], rtol=1e-5, atol=1e-5)


def test_tokenizer_and_mask_token_choice(dirs):
    t = load_target(dirs["qwen3"])
    assert t.tokenizer is not None and t.tokenizer.mask_token == "<mask>"
    assert t.default_mask_token_id() == t.tokenizer.mask_token_id
    assert t.stop_token_ids() == [1]
    # No mask token: the first embedding row past the tokenizer (the reference's Qwen3 choice) ...
    t2 = load_target(dirs["qwen3_nomask"])
    n = len(t2.tokenizer)
    assert t2.default_mask_token_id() == n
    # ... unless that row is all zeros, which would blind the masked slots.
    with torch.no_grad():
        t2.embed_tokens.weight[n] = 0
    assert t2.default_mask_token_id() == n + 1
    # No tokenizer at all: the last embedding row.
    t3 = load_target(dirs["llama"])
    assert t3.tokenizer is None and t3.default_mask_token_id() == 299


def test_errors_are_one_line_and_name_the_path(dirs, tmp_path):
    cases = {}
    cases["missing"] = tmp_path / "nope"
    f = tmp_path / "file.txt"
    f.write_text("x")
    cases["file"] = f
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.md").write_text("x")
    cases["no config"] = empty
    noweights = tmp_path / "noweights"
    noweights.mkdir()
    (noweights / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    cases["no weights"] = noweights
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    (unknown / "model.safetensors").write_bytes(b"")
    cases["unknown"] = unknown
    encoder = tmp_path / "t5"
    encoder.mkdir()
    (encoder / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    (encoder / "model.safetensors").write_bytes(b"")
    cases["not causal"] = encoder
    expect = {"missing": "no such file", "file": "is a file", "no config": "no config.json (found notes.md, sub)",
              "no weights": "no weights", "unknown": "no_such_model", "not causal": "'t5'"}
    for name, path in cases.items():
        with pytest.raises(TargetError) as e:
            load_target(path)
        msg = str(e.value)
        assert "\n" not in msg and str(path) in msg and expect[name] in msg, (name, msg)
        assert isinstance(e.value, ValueError)


def test_builtin_tiny_target_when_present():
    tiny = pytest.importorskip("dflash.targets.tiny")
    try:
        path = tiny.tiny_target_dir()
    except FileNotFoundError:
        pytest.skip("the tiny target has not been built yet")
    t = load_target("tiny", num_draft_layers=3)
    assert t.path == path and t.tokenizer is not None
    mask = t.default_mask_token_id()
    assert t.tokenizer.convert_ids_to_tokens(mask) == t.tokenizer.mask_token


def test_missing_tiny_target_says_how_to_rebuild_instead_of_building(tmp_path, monkeypatch):
    """A tiny target whose weights are gone (a copy of the package directory without them) is one line
    naming the rebuild command, returned at once: nothing is built or written there."""
    tiny = pytest.importorskip("dflash.targets.tiny")
    shipped = tiny.TINY_DIR
    broken = tmp_path / "tiny"
    broken.mkdir()
    for f in shipped.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, broken / f.name)
    before = sorted(p.name for p in broken.iterdir())
    monkeypatch.setattr(tiny, "TINY_DIR", broken)
    with pytest.raises(TargetError) as e:
        load_target("tiny")
    msg = str(e.value)
    assert "\n" not in msg and "dflash target build-tiny" in msg and "model.safetensors" in msg, msg
    assert sorted(p.name for p in broken.iterdir()) == before  # no build started in there
    monkeypatch.setattr(tiny, "TINY_DIR", tmp_path / "absent")
    with pytest.raises(TargetError, match="build-tiny"):
        load_target("tiny")


def test_frozen_head_keeps_the_targets_dtype_and_shares_its_weights(dirs):
    """The trainer's embedding and LM head: the target's dtype (a float32 copy would be re-cast to bf16
    under autocast on every LM-head chunk), frozen, and the very same weights on the target's device."""
    t = load_target(dirs["qwen3"], dtype=torch.bfloat16, num_draft_layers=3)
    embed, head = t.frozen_head("cpu")
    assert embed.weight.dtype == head.weight.dtype == torch.bfloat16
    assert not embed.weight.requires_grad and not head.weight.requires_grad
    assert embed.weight.data_ptr() == t.embed_tokens.weight.data_ptr()
    assert head.weight.data_ptr() == t.lm_head.weight.data_ptr()
    h = torch.randn(3, t.hidden_size, dtype=torch.bfloat16)
    ids = torch.tensor([1, 5, 7])
    assert torch.equal(head(h), t.lm_head(h)) and torch.equal(embed(ids), t.embed_tokens(ids))
    with torch.autocast("cpu", torch.bfloat16):  # as the drafter stage runs it on CUDA
        assert head(h.float()).dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_final_state_through_the_head_is_the_targets_own_distribution(dirs, arch):
    """What --loss kl compares with in process: the final state appended after the taps, through the
    target's final norm (none: it is normed) and LM head, gives the model's own logits."""
    from dflash.targets.heads import NormedHead

    t = load_target(dirs[arch], num_draft_layers=3)
    ids = torch.randint(0, 300, (2, 9))
    both = t.tap_states(ids, final=True)
    taps = t.tap_states(ids)
    assert both.shape[-1] == taps.shape[-1] + t.hidden_size and torch.equal(both[..., :taps.shape[-1]], taps)
    _, head = t.frozen_head("cpu")
    logits = NormedHead(t.final_norm("cpu"), head)(both[..., taps.shape[-1]:])
    torch.testing.assert_close(logits, t.model(ids).logits, rtol=1e-5, atol=1e-5)
