"""Drafters on disk: the reference (z-lab) export format, and our training checkpoints.

Export directory (what SGLang/vLLM and z-lab's ``DFlashDraftModel.from_pretrained`` read):

    config.json        a Qwen3 config (the drafter's own layers) plus ``architectures:
                       ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and
                       ``dflash_config: {mask_token_id, target_layer_ids, block_size}``; the layers'
                       ``layer_types`` with ``sliding_window`` / ``use_sliding_window`` /
                       ``max_window_layers``, and the target's RoPE scaling (``rope_parameters``, and
                       ``rope_scaling`` for transformers 4.x readers); training-only settings (gamma)
                       go under ``dflash_trainer``, which other readers ignore.
    model.safetensors  the drafter's state_dict as is: ``layers.N.self_attn.q_proj.weight``, ...,
                       ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` (no embedding, no LM
                       head: those are the target's).

A DFlash2 drafter (dflash2.py) is the same plus ``architectures: ["DFlash2DraftModel"]``, a top-level
``is_causal`` (what the layers' attention is when every layer is of one kind; left out for a mix, which
only the readers' default expresses), ``dflash_config`` keys ``conv_kernel_size``, ``conv_group_size``,
``selector_rank``, ``selector_top_k``, ``input_embedding_scale``, ``output_multiplier``,
``final_logit_softcapping``, and the weights ``layers.N.{attention,mlp}_conv.base_kernel`` /
``.kernel_projection.weight`` and ``candidate_selector.{predecessor,successor}_codebook`` (no
``.weight``: the reference's loader maps them) / ``.hidden_projection.weight``.

Reading a drafter back from any of these (and from a speculators checkpoint) is loading.py's.

Training checkpoints (written by dflash/checkpoint_files.py) are ``torch.save``d dicts holding
``drafter_config`` (``dataclasses.asdict`` of the config, with its ``drafter_type``) and ``drafter``
(the state_dict).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from dflash.model.dflash2 import DFlash2Config
from dflash.model.drafter import FULL, SLIDING, DFlashDrafter, DrafterConfig, default_gamma, rope_scaling_of

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class DrafterLoadError(ValueError):
    """A drafter path that is neither a checkpoint nor an export; the message is one line."""


def hf_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    """The reference's config.json for a drafter (Qwen3 fields + DFlash fields).

    ``block_size`` is written at the top level (the reference's model.py reads it there) and inside
    ``dflash_config`` (where newer releases put it). ``max_window_layers`` counts the leading
    full-attention layers, so a reader that derives layer types from it (Qwen3's rule: layers from
    that index on slide) gets the usual full-then-sliding pattern right; ``layer_types`` says it exactly.
    """
    sliding = SLIDING in cfg.layer_types
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default", **(cfg.rope_scaling or {})}
    out = {
        "architectures": [DFLASH],
        "model_type": "qwen3",
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": cfg.initializer_range,
        "intermediate_size": cfg.intermediate_size,
        "layer_types": list(cfg.layer_types),
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": cfg.layer_types.index(SLIDING) if sliding else cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,  # transformers 4.x readers
        "sliding_window": cfg.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                          "block_size": cfg.block_size},
        "dflash_trainer": {"gamma": cfg.gamma},
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)  # transformers 4.x readers
    if isinstance(cfg, DFlash2Config):
        out["architectures"] = [DFLASH2]
        kinds = set(cfg.layer_types)
        if len(kinds) == 1:  # one kind of layer: say it (sliding layers are causal, full ones not)
            out["is_causal"] = kinds == {SLIDING}
        out["dflash_config"].update({name: getattr(cfg, name) for name in DFLASH2_KEYS})
    return out


DFLASH, DFLASH2 = "DFlashDraftModel", "DFlash2DraftModel"
#: DFlash2's ``dflash_config`` keys beyond DFlash's, each a DFlash2Config field of the same name, with
#: its type; the first four are required (the readers have no default for them)
DFLASH2_KEYS = {"conv_kernel_size": int, "conv_group_size": int, "selector_rank": int, "selector_top_k": int,
                "input_embedding_scale": float, "output_multiplier": float, "final_logit_softcapping": float}


def layer_types_from_hf(d: dict, num_layers: int) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) as a reference-format config.json states them, read as vLLM does.

    ``layer_types`` when present; else Qwen3's older rule, where ``use_sliding_window`` with a
    ``sliding_window`` makes the layers from ``max_window_layers`` on slide; else all full attention.
    ``dflash_config.swa_window_size`` names the window before ``sliding_window``, and
    ``dflash_config.use_swa`` makes every layer slide when none does. A config that sets the layers'
    causality (``is_causal``, ``dflash_config.causal``) against the engines' default (sliding layers
    causal, full ones bidirectional: the only attention dflash trains) is refused.
    """
    dc = d.get("dflash_config") or {}
    window = dc.get("swa_window_size", d.get("sliding_window"))
    window = int(window) if window else None
    types = d.get("layer_types")
    if types is not None and not isinstance(types, list):
        raise DrafterLoadError("config.json: layer_types is not a list")
    if types is not None:
        types = [str(t) for t in types]
    elif d.get("use_sliding_window") and window:
        first = int(d.get("max_window_layers", 28))  # Qwen3Config's default
        types = [FULL if i < first else SLIDING for i in range(num_layers)]
    else:
        types = [FULL] * num_layers
    if dc.get("use_swa") and SLIDING not in types:
        types = [SLIDING] * num_layers
    causal = d.get("is_causal", dc.get("causal"))
    if causal is not None and any((t == SLIDING) != bool(causal) for t in types):
        raise DrafterLoadError(f"config.json makes every layer {'causal' if causal else 'bidirectional'} "
                               "(is_causal / dflash_config.causal): dflash trains sliding layers causal and full "
                               "layers bidirectional only")
    return types, window


def config_from_hf(d: dict) -> DrafterConfig:
    """DrafterConfig from a reference-format config.json (ours or z-lab's released drafters).

    DFlash fields are read from ``dflash_config`` first, then the top level, as the reference does;
    ``block_size`` too (newer releases keep it only inside ``dflash_config``).
    """
    dc = d.get("dflash_config") or {}

    def pick(name, default=None):
        return dc.get(name, d.get(name, default))

    block = int(pick("block_size", 16))
    heads = int(d["num_attention_heads"])
    layer_ids = pick("target_layer_ids")
    if layer_ids is None:
        raise DrafterLoadError("config.json has no dflash_config.target_layer_ids")
    num_layers = int(d["num_hidden_layers"])
    layer_types, window = layer_types_from_hf(d, num_layers)
    rope = d.get("rope_parameters") or {}
    arch = (d.get("architectures") or [DFLASH])[0]
    extra = {}
    if arch == DFLASH2:
        missing = [k for k in list(DFLASH2_KEYS)[:4] if pick(k) is None]
        if missing:
            raise KeyError(f"a {DFLASH2} config needs dflash_config.{missing[0]}")
        extra = {k: cast(pick(k)) for k, cast in DFLASH2_KEYS.items() if pick(k) is not None}
    return (DFlash2Config if arch == DFLASH2 else DrafterConfig)(
        **extra,
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        vocab_size=int(d["vocab_size"]),
        num_target_layers=int(pick("num_target_layers", max(layer_ids) + 1)),
        target_layer_ids=list(layer_ids),
        mask_token_id=int(pick("mask_token_id", 0)),
        block_size=block,
        gamma=float((d.get("dflash_trainer") or {}).get("gamma") or default_gamma(block)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or d.get("rope_theta") or 10000.0),
        max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
        attention_bias=bool(d.get("attention_bias", False)),
        initializer_range=float(d.get("initializer_range", 0.02)),
        layer_types=layer_types,
        sliding_window=window if SLIDING in layer_types else None,
        rope_scaling=rope_scaling_of(d),
    )


#: a drafter's config.json is a few KB; a far larger one is not a drafter's, and is not decoded
MAX_CONFIG_BYTES = 1 << 20


def read_config_json(path: Path) -> dict:
    """The config.json of a drafter directory as a dict, bounded in size before it is decoded."""
    f = Path(path) / CONFIG_NAME
    try:
        size = f.stat().st_size
        if size <= MAX_CONFIG_BYTES:
            d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise DrafterLoadError(f"{path}: unreadable {CONFIG_NAME} ({e})") from e
    if size > MAX_CONFIG_BYTES:
        raise DrafterLoadError(f"{path}: {CONFIG_NAME} is {size:,} bytes, far more than a drafter's config")
    if not isinstance(d, dict):
        raise DrafterLoadError(f"{path}: {CONFIG_NAME} is not a JSON object")
    return d


def checkpoint_dict(drafter: DFlashDrafter) -> dict:
    """The two entries a training checkpoint must hold for ``load_drafter`` to read it (the
    checkpointer writes them through this, so the two cannot drift apart)."""
    return {"drafter_config": {**asdict(drafter.config), "drafter_type": drafter.config.drafter_type},
            "drafter": drafter.state_dict()}
