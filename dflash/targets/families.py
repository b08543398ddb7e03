"""Tiny random-weight targets of every model family dflash supports, built from transformers' own
config classes: the test matrix (tests/test_families.py) and scripts/bench_rollback.py use them.

Each family is one entry: its transformers config class and the few settings that make it tiny while
keeping what makes the family different — Gated DeltaNet layers beside full attention (Qwen3.5,
Qwen3-Next), sliding windows short enough to be passed in a test (gpt-oss, Gemma 4), per-layer head
sizes, layers sharing another layer's keys/values and the embedding scale / logit soft-cap (Gemma 4),
multi-head latent attention (DeepSeek-V3, the architecture of Kimi K2.5), mixtures of experts
(Qwen3.5-MoE, Qwen3-Next, gpt-oss, DeepSeek-V3,
GLM-4-MoE). Nothing here is downloaded: a config class builds a model with random weights.
"""

from __future__ import annotations

import math
from pathlib import Path

# The shapes every tiny family shares (at hidden 64; `family_config` scales them); a family's own entry
# adds or overrides. `layer_pattern` repeats over the layers as their `layer_types`.
_COMMON = dict(intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=4096)
# Gated DeltaNet: three linear-attention layers then one full-attention layer, as Qwen3.5's 3:1 pattern.
_HYBRID = dict(layer_pattern=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
               linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# A window shorter than one test decode, so every decode runs past it (the case a rollback must get right).
SLIDING_WINDOW = 6

# family -> (transformers config class name, overrides of _COMMON)
FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3": ("Qwen3Config", {}),
    "llama": ("LlamaConfig", {}),
    "qwen3_5": ("Qwen3_5TextConfig", _HYBRID),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {**_HYBRID, **_MOE, "shared_expert_intermediate_size": 32}),
    "qwen3_next": ("Qwen3NextConfig", {**_HYBRID, **_MOE, "shared_expert_intermediate_size": 32}),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=SLIDING_WINDOW,
                                     layer_pattern=["sliding_attention", "full_attention"])),
    # Sliding layers have head_dim 16, the full-attention ones 32 (a per-layer attribute); the last two
    # layers reuse the keys/values of the last earlier layer of their kind (KV sharing, as Gemma 4's small
    # models); the embedding is scaled by sqrt(hidden) and the logits soft-capped, as Gemma does.
    "gemma4": ("Gemma4TextConfig", dict(sliding_window=SLIDING_WINDOW, global_head_dim=32, num_kv_shared_layers=2,
                                        layer_pattern=["sliding_attention", "full_attention"],
                                        final_logit_softcapping=30.0, hidden_size_per_layer_input=8,
                                        vocab_size_per_layer_input=None)),
    # MLA expands its latent to every head: as in the real model, as many key/value heads as heads.
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                                             n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                                             n_group=1,
                                             topk_group=1, kv_lora_rank=16, q_lora_rank=32,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                             head_dim=None)),
    "glm4_moe": ("Glm4MoeConfig", dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                       moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                                       topk_group=1, head_dim=None)),
}


def family_config(family: str, vocab_size: int, eos_token_id: int = 1, pad_token_id: int = 2, layers: int = 4,
                  scale: int = 1, sliding_window: int = SLIDING_WINDOW):
    """The transformers config of a tiny ``family`` target: ``layers`` layers, widths times ``scale``
    (hidden 64 x scale; heads and head sizes stay, so more heads), ``sliding_window`` for windowed layers."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES)})")
    cls_name, overrides = FAMILIES[family]
    kwargs = {**_COMMON, **overrides, "vocab_size": vocab_size, "eos_token_id": eos_token_id,
              "bos_token_id": None, "pad_token_id": pad_token_id, "tie_word_embeddings": False,
              "num_hidden_layers": layers, "hidden_size": 64 * scale}
    for key in ("intermediate_size", "num_attention_heads", "num_key_value_heads", "linear_num_key_heads",
                "linear_num_value_heads", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if kwargs.get(key):
            kwargs[key] *= scale
    if "sliding_window" in kwargs:
        kwargs["sliding_window"] = sliding_window
    pattern = kwargs.pop("layer_pattern", None)
    if pattern:
        kwargs["layer_types"] = [pattern[i % len(pattern)] for i in range(layers - 1)] + [pattern[-1]]
    if kwargs.get("vocab_size_per_layer_input", 0) is None:
        kwargs["vocab_size_per_layer_input"] = vocab_size
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return getattr(transformers, cls_name)(**kwargs)


def family_model(family: str, vocab_size: int, seed: int = 0, logit_scale: float = 8.0, **config):
    """A random-weight ``family`` model (``config``: see ``family_config``), in eval mode.

    The LM head is scaled by ``logit_scale``: a random init gives near-uniform logits, where float
    rounding between a block-of-queries forward and a one-token forward could flip a greedy choice.
    Gated DeltaNet's random decay rates (A_log) forget the recurrent state within a token or two; a slow
    decay makes every earlier token count, as in a trained model, so a wrong state shows.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, vocab_size, **config))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.fill_(math.log(0.05))
    return model.eval().requires_grad_(False)


def build_family_target(path: str | Path, family: str, tokenizer, seed: int = 0) -> Path:
    """``save_pretrained`` a random tiny ``family`` target (``family_model``) and ``tokenizer`` into ``path``."""
    model = family_model(family, len(tokenizer) + 8, seed, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
