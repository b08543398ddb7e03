"""The drafter module: reference parameter names, tap-layer rule, config, incremental decoding cache."""

from __future__ import annotations

import pytest
import torch
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash.model.drafter import (
    DFlashDrafter,
    DrafterConfig,
    default_gamma,
    default_target_layer_ids,
    mask_token_embedding_ok,
)


def small_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=50, num_target_layers=8, target_layer_ids=[1, 3, 5], mask_token_id=49)
    base.update(kw)
    return DrafterConfig(**base)


def test_parameter_names_are_the_reference_checkpoint_names():
    names = set(DFlashDrafter(small_config()).state_dict())
    per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight"]
    expected = {f"layers.{i}.{n}" for i in range(2) for n in per_layer} | {"fc.weight", "hidden_norm.weight",
                                                                            "norm.weight"}
    assert names == expected


def test_shapes():
    d = DFlashDrafter(small_config())
    assert d.fc.weight.shape == (32, 3 * 32)
    assert d.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 32)
    x = d(torch.randn(2, 5, 32), torch.randn(2, 7, 96), torch.arange(7, 12).expand(2, 5), torch.arange(7).expand(2, 7))
    assert x.shape == (2, 5, 32)


@pytest.mark.parametrize("n_target,n_draft,expected", [
    (36, 5, [1, 9, 17, 25, 33]),   # Qwen3-8B drafters
    (52, 5, [1, 13, 25, 37, 49]),  # the reference's test fixture
    (36, 1, [18]),                 # one tap: the middle layer
    (28, 3, [1, 13, 25]),
    (6, 5, [1, 2, 3]),             # shallow: repeated ids dropped
    (3, 2, [0, 1]),                # shallower than the rule allows: spread over 0..N-2
])
def test_default_target_layer_ids(n_target, n_draft, expected):
    assert default_target_layer_ids(n_target, n_draft) == expected


def test_gamma_defaults_and_interpolation():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert 5.0 < default_gamma(12) < 7.0 and default_gamma(4) >= 1.0
    assert small_config(block_size=10).gamma == 5.0
    assert small_config(gamma=3.5).gamma == 3.5


def test_config_validation():
    with pytest.raises(ValueError, match="outside the target"):
        small_config(target_layer_ids=[8])
    with pytest.raises(ValueError, match="mask_token_id"):
        small_config(mask_token_id=50)
    with pytest.raises(ValueError, match="block_size"):
        small_config(block_size=1)


def test_for_target_reads_qwen3_and_llama_configs():
    from transformers import LlamaConfig, Qwen3Config

    q = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=36,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    c = DrafterConfig.for_target(q, num_layers=5, mask_token_id=299)
    assert c.target_layer_ids == [1, 9, 17, 25, 33] and c.gamma == 7.0 and c.head_dim == 16
    assert c.rope_theta == q.rope_parameters["rope_theta"]
    ll = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, rope_theta=500000.0)
    c = DrafterConfig.for_target(ll, num_layers=1, block_size=8, mask_token_id=0, target_layer_ids=[2])
    assert (c.head_dim, c.rope_theta, c.gamma, c.target_layer_ids) == (16, 500000.0, 4.0, [2])
    assert DrafterConfig.from_dict({**c.__dict__, "some_future_field": 1}) == c


def test_incremental_context_cache_equals_full_context():
    """Decoding feeds the context in pieces through the cache; the block must see the same thing."""
    torch.manual_seed(0)
    d = DFlashDrafter(small_config(num_layers=3)).double()
    ctx = torch.randn(1, 20, 96, dtype=torch.float64)
    block = torch.randn(1, 6, 32, dtype=torch.float64)
    pos = torch.arange(20, 26)[None]
    full = d(block, ctx, pos, torch.arange(20)[None])
    cache = d.new_cache()
    d(torch.randn(1, 6, 32, dtype=torch.float64), ctx[:, :12], torch.arange(12, 18)[None], torch.arange(12)[None],
      cache=cache)  # an earlier round's block: must leave no trace
    inc = d(block, ctx[:, 12:], pos, torch.arange(12, 20)[None], cache=cache)
    torch.testing.assert_close(inc, full, rtol=1e-10, atol=1e-12)
    assert cache[0][0].k.shape[2] == 20  # only context keys are cached


def test_zero_mask_embedding_is_rejected():
    w = torch.randn(10, 8)
    w[3] = 0
    assert mask_token_embedding_ok(w, 2) and not mask_token_embedding_ok(w, 3)


def test_init_from_target_starts_from_the_targets_top_layer_and_its_input(tmp_path):
    """With a tap just below the copied layer, the context feature starts as exactly the input that
    layer normalises in the target, so the injected keys/values begin as the target's own."""
    from test_model_helpers import make_target_dir

    from dflash.model.drafter import init_from_target
    from dflash.targets import load_target

    t = load_target(str(make_target_dir(tmp_path / "t", layers=4)), layer_ids=[1, 2])
    d = DFlashDrafter(DrafterConfig.for_target(t.config, num_layers=1, block_size=4, target_layer_ids=[1, 2],
                                               mask_token_id=3))
    copied = init_from_target(d, t.model)
    top = t.model.model.layers[-1]
    assert "fc.weight" in copied and "layers.0.mlp.down_proj.weight" in copied
    for name, p in top.state_dict().items():
        assert torch.equal(d.layers[0].state_dict()[name], p), name
    assert torch.equal(d.norm.weight, t.model.model.norm.weight)

    ids = torch.randint(5, 200, (2, 9))
    out = t.model(input_ids=ids, output_hidden_states=True)
    ctx = d.context_feature(t.taps(out.hidden_states))
    # hidden_states[3] is the output of layer 2, the input of the top layer (layer 3)
    torch.testing.assert_close(ctx, top.input_layernorm(out.hidden_states[3]))


def test_rope_frequencies_stay_float32_through_every_cast():
    """Casting the drafter (bf16 for serving, fp16, double) must not round the RoPE frequencies; the
    cos/sin it computes are the float32 ones, cast only at the end."""
    fresh = DFlashDrafter(small_config(rope_theta=1e6))
    want = fresh.rotary.inv_freq.clone()
    positions = torch.tensor([[0, 1, 4000, 40000]])
    cos32, sin32 = fresh.rotary(positions, torch.float32)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(),
                 lambda m: m.to("cpu", torch.bfloat16).float()):
        d = cast(DFlashDrafter(small_config(rope_theta=1e6)))
        assert d.rotary.inv_freq.dtype == torch.float32 and torch.equal(d.rotary.inv_freq, want)
        cos, sin = d.rotary(positions, torch.bfloat16)
        assert torch.equal(cos, cos32.to(torch.bfloat16)) and torch.equal(sin, sin32.to(torch.bfloat16))
    assert DFlashDrafter(small_config()).to("meta").rotary.inv_freq.device.type == "meta"  # moves still follow
