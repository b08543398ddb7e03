"""The DFlash drafter: a few Qwen3-style decoder layers that fill a whole block of masked slots at once.

Read top to bottom: config, the pieces (RMSNorm, attention, MLP, layer; RoPE in rope.py), then the model.

What makes it a *DFlash* drafter rather than a small language model:

* It has no embedding and no LM head of its own. Its input is the target's (frozen) embedding of a block
  ``[anchor token, MASK, MASK, ...]`` and its output goes through the target's (frozen) LM head.
* It conditions on the target: the target's hidden states at a few tap layers are concatenated and
  projected by ``fc`` + RMSNorm (``hidden_norm``) to one *context feature* per context position. In every
  layer that feature is projected by the layer's own ``k_proj``/``v_proj`` into extra keys and values that
  the block's queries attend to, next to the block's own keys and values. The context feature never
  flows through the layers itself; it only ever appears as keys/values.
* Inside a block attention is bidirectional, so all masked slots are predicted in one pass.
* A layer is ``full_attention`` or ``sliding_attention`` (``DrafterConfig.layer_types``). A sliding layer
  sees what the serving engines compute for it (vLLM and SGLang run it as a causal window of
  ``sliding_window`` positions, its own included): a query at position p sees the keys at positions
  p-W+1 .. p, context and block alike (picture in masks.py). Full layers are unchanged.

Parameter names match the public reference (z-lab/dflash ``DFlashDraftModel``) one to one, so
``state_dict()`` *is* the exported ``model.safetensors`` (see export.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.masks import flex_or_sdpa
from dflash.model.rope import Rotary, apply_rope

# Loss-decay gamma per block size, as the DFlash paper trains them; other sizes interpolate.
_GAMMA_BY_BLOCK = {8: 4.0, 10: 5.0, 16: 7.0}
#: an attribute set (True) on a linear layer whose weight is a vocabulary-indexed table, not a hidden map:
#: Muon leaves it to AdamW (dflash/objectives/optim.py)
NOT_FOR_MUON = "not_for_muon"


def default_gamma(block_size: int) -> float:
    """gamma for ``exp(-(k-1)/gamma)``: the paper's 4/5/7 for blocks of 8/10/16, linear in between/beyond."""
    if block_size in _GAMMA_BY_BLOCK:
        return _GAMMA_BY_BLOCK[block_size]
    points = sorted(_GAMMA_BY_BLOCK.items())
    (x0, y0), (x1, y1) = (points[0], points[1]) if block_size < points[1][0] else (points[-2], points[-1])
    return max(1.0, y0 + (block_size - x0) * (y1 - y0) / (x1 - x0))


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """The reference's tap layers: ``num_taps`` evenly spaced from layer 1 to layer N-3 (rounded).

    One tap takes the middle layer. Layer ids follow the Hugging Face ``hidden_states`` convention used
    by the reference and the serving engines: id ``i`` is the *output* of decoder layer ``i``
    (``hidden_states[i + 1]``). Two departures, both only for targets far shallower than any real one
    (the reference would produce repeated or invalid ids there): targets with fewer than 4 layers are
    spread over layers 0..N-2, and repeated ids are dropped.
    """
    if num_target_layers < 1 or num_taps < 1:
        raise ValueError(f"need at least one target layer and one tap (got {num_target_layers}, {num_taps})")
    if num_taps == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        start, end = 0, max(0, num_target_layers - 2)
    span = end - start
    ids = [int(round(start + i * span / (num_taps - 1))) for i in range(num_taps)]
    return sorted(set(ids))


def _cfg(config, name: str, default=None):
    """Read a field from a transformers config object or a plain dict."""
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")  # the scalings the drafter trains, evaluates, exports


def rope_scaling_of(config) -> dict | None:
    """The target's RoPE scaling (``rope_parameters`` in transformers 5, ``rope_scaling`` in 4.x) without
    its base, or None for plain RoPE: the drafter rotates its queries and keys as the target does."""
    params = _cfg(config, "rope_parameters") or _cfg(config, "rope_scaling")
    if not isinstance(params, dict):
        return None
    params = {k: v for k, v in params.items() if k != "rope_theta"}
    kind = params.pop("type", None) or params.get("rope_type") or "default"
    if kind == "default":
        return None
    return {**params, "rope_type": kind}


def _per_layer(config, name: str, default=None):
    """A field the target may set per layer (transformers' heterogeneous configs: Gemma 4's full-attention
    layers have another head_dim than its sliding ones, and reading it globally raises): the value most
    of its layers have (a tie: the first layer's), so the drafter's layers are shaped like most of the
    target's."""
    if not isinstance(config, dict):  # a transformers config object
        if name not in (getattr(config, "per_layer_attributes", None) or ()):
            return _cfg(config, name, default)
        values = [getattr(layer, name, None) for layer in config.per_layer_config]
    else:  # a saved config.json: per_layer_config maps layer index -> that layer's overrides
        by_layer = {int(k): v for k, v in (_cfg(config, "per_layer_config") or {}).items()}
        if not any(name in v for v in by_layer.values()):
            return _cfg(config, name, default)
        values = [by_layer.get(i, {}).get(name, _cfg(config, name))
                  for i in range(int(_cfg(config, "num_hidden_layers")))]
    values = [v for v in values if v is not None]
    return max(values, key=values.count) if values else default


def rope_theta_of(config) -> float:
    """RoPE base of a transformers config: ``rope_parameters`` (transformers 5) or ``rope_theta`` (4.x)."""
    params = _cfg(config, "rope_parameters") or _cfg(config, "rope_scaling") or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or _cfg(config, "rope_theta") or 10000.0)


@dataclass
class DrafterConfig:
    """Everything needed to build a drafter; stored in checkpoints as ``dataclasses.asdict``.

    ``hidden_size`` equals the target's: the drafter reads the target's embeddings and feeds the target's
    LM head. ``target_layer_ids`` are the target layers tapped for the context feature.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = 0
    block_size: int = 16
    gamma: float | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    initializer_range: float = 0.02
    # None: every layer full attention; else one of LAYER_TYPES per layer
    layer_types: list[str] | None = None
    sliding_window: int | None = None  # W of the sliding layers: the positions a query sees, its own included
    # None: plain RoPE; else transformers' rope parameters, e.g. {"rope_type": "yarn", ...}
    rope_scaling: dict | None = None

    #: which drafter this config builds (``build_drafter``); a checkpoint stores it beside the fields
    drafter_type: ClassVar[str] = "dflash"

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.layer_types = list(self.layer_types) if self.layer_types else [FULL] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} drafter layers")
        bad_type = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad_type:
            raise ValueError(f"layer type {bad_type[0]!r} is not one of {', '.join(LAYER_TYPES)}")
        if SLIDING in self.layer_types and (self.sliding_window is None or int(self.sliding_window) < 1):
            raise ValueError(
                f"sliding_attention layers need a sliding_window of at least 1 (got {self.sliding_window})")
        if self.sliding_window is not None:
            self.sliding_window = int(self.sliding_window)
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"RoPE scaling {kind!r} is not supported by the drafter "
                                 f"(supported: {', '.join(ROPE_TYPES)})")
            rest = {k: v for k, v in self.rope_scaling.items() if k != "type"}  # transformers 4.x's key
            self.rope_scaling = None if kind == "default" else {**rest, "rope_type": kind}
        if self.gamma is None:
            self.gamma = default_gamma(self.block_size)
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (anchor + one masked slot), got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside the target's {self.num_target_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary (0..{self.vocab_size - 1})")

    @classmethod
    def for_target(
        cls,
        target_config,
        num_layers: int = 1,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        *,
        mask_token_id: int,
        gamma: float | None = None,
        intermediate_size: int | None = None,
    ) -> DrafterConfig:
        """A drafter shaped like the target's layers (as the reference's drafters are).

        Without ``target_layer_ids`` the taps follow the reference's rule with one tap per drafter layer
        (the released drafters tie the two); pass ``Target.layer_ids`` to keep target and drafter in step.
        """
        n_target = int(_cfg(target_config, "num_hidden_layers"))
        hidden = int(_cfg(target_config, "hidden_size"))
        heads = int(_per_layer(target_config, "num_attention_heads"))
        head_dim = _per_layer(target_config, "head_dim") or hidden // heads
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size or _per_layer(target_config, "intermediate_size") or 4 * hidden),
            num_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(_per_layer(target_config, "num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=int(_cfg(target_config, "vocab_size")),
            num_target_layers=n_target,
            target_layer_ids=list(target_layer_ids or default_target_layer_ids(n_target, num_layers)),
            mask_token_id=int(mask_token_id),
            block_size=block_size,
            gamma=gamma,
            rms_norm_eps=float(_cfg(target_config, "rms_norm_eps") or 1e-6),
            rope_theta=rope_theta_of(target_config),
            max_position_embeddings=int(_cfg(target_config, "max_position_embeddings") or 40960),
            rope_scaling=rope_scaling_of(target_config),
        )

    @property
    def plan_block_size(self) -> int:
        """The block size a training plan is built with (blocks.plan_blocks): its slot k is labelled
        x[a + k], k = 1..plan_block_size - 1. A DFlash block's slot k drafts x[a + k] (the anchor's slot
        drafts nothing): the block itself. A DSpark block drafts from the anchor's slot too (dspark.py)."""
        return self.block_size

    @property
    def drafts_per_block(self) -> int:
        """Tokens one block drafts: the slots after the anchor."""
        return self.block_size - 1

    def describe_layers(self) -> str:
        """The layers in a few words: "5 layers, full attention" or "4 layers, 3 sliding (window 2048)"."""
        n_sliding = self.layer_types.count(SLIDING)
        what = f"{n_sliding} sliding (window {self.sliding_window})" if n_sliding else "full attention"
        rope = f", RoPE {self.rope_scaling['rope_type']}" if self.rope_scaling else ""
        return f"{self.num_layers} layer{'s' if self.num_layers != 1 else ''}, {what}{rope}"

    def window_of(self, layer: int) -> int | None:
        """The sliding window of drafter layer ``layer``, None for a full-attention layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        """Inverse of ``dataclasses.asdict``; unknown keys (from newer versions) are ignored."""
        known = {f.name for f in fields(cls)}  # not __dataclass_fields__, which holds drafter_type too
        return cls(**{k: v for k, v in d.items() if k in known})


# --------------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


class _RMSNormFn(torch.autograd.Function):
    """The same forward, keeping only the input and one float32 scale per row for backward (which
    recomputes the rest). Autograd's own graph of these ops keeps a float32 copy of a bf16 input and the
    normalised values as well: ~16% of a drafter layer's activations per query token under autocast."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        rounded = normed.to(x.dtype)
        grad_weight = None
        if ctx.needs_input_grad[1]:  # weight * rounded runs in their promoted dtype, as autograd's would
            product = grad * rounded.to(torch.result_type(weight, rounded))
            grad_weight = product.reshape(-1, weight.shape[-1]).sum(0).to(weight.dtype)
        g = (grad * weight).to(x.dtype).float()  # through the cast to the input dtype, as autograd's would
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Attention of q [B, Hq, Q, D] over k, v [B, Hkv, K, D].

    ``mask`` is None (everything visible), a boolean tensor broadcastable to [B, 1, Q, K] (True =
    visible; runs ``scaled_dot_product_attention``), or a FlexAttention ``BlockMask`` (runs
    ``flex_attention``: compiled on CUDA, with an SDPA fallback if that fails; uncompiled on CPU).
    """
    if mask is not None and not isinstance(mask, torch.Tensor):
        return flex_or_sdpa(q, k, v, mask, compiled=q.is_cuda)
    if q.shape[1] != k.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def window_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int) -> torch.Tensor:
    """Bool [B, 1, Q, K] (True = visible): a sliding layer's query at position p sees keys at p-W+1 .. p.

    The form for incremental decoding, where keys are the cached context then the block: what a
    serving engine's causal sliding window computes. Training's packed blocks use masks.py instead.
    """
    q, k = q_positions[:, None, :, None], k_positions[:, None, None, :]
    return (k <= q) & (k > q - window)


@dataclass
class LayerCache:
    """One layer's context keys/values kept between decoding rounds, and the positions they hold."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor  # [B, C]

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        self.k, self.v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.positions = torch.cat([self.positions, positions], dim=1)

    def drop_before(self, position: int) -> None:
        """Forget the keys before ``position`` (positions are ascending: a prefix goes)."""
        n = int((self.positions[0] < position).sum())
        if n:
            self.k, self.v, self.positions = self.k[:, :, n:], self.v[:, :, n:], self.positions[:, n:]


@dataclass
class Positions:
    """Where a pass's queries and context sit, and their RoPE cos/sin, shared by every layer."""

    q: torch.Tensor  # [B, Q] the block tokens' positions
    ctx: torch.Tensor  # [B, C] the (new) context's positions
    rope_q: tuple[torch.Tensor, torch.Tensor]
    rope_ctx: tuple[torch.Tensor, torch.Tensor]
    block_len: int | None = None  # queries come in blocks of this many (None: the whole pass is one block)


class Attention(nn.Module):
    """Block self-attention whose keys/values are [context feature ; block], as in the reference.

    ``window`` (a sliding layer's W, None for full attention) limits what a query sees when no mask is
    given (decoding) and what the layer's cache keeps.
    """

    def __init__(self, cfg: DrafterConfig, window: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = window
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, ctx, pos: Positions, mask, cache: list | None = None) -> torch.Tensor:
        """x: block states [B, Q, H]; ctx: context feature [B, C, H] (C may be 0).

        With ``cache`` (a one-element list holding this layer's LayerCache, or None), the new context's
        keys/values are appended to it and the block attends to all cached context: the incremental form
        used while decoding. The block's own keys/values are never cached; a sliding layer's cache
        drops the keys no later query can see (queries only move forward).
        """
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *pos.rope_q)
        k_blk, v_blk = self._kv(x, *pos.rope_q)
        k_ctx, v_ctx = self._kv(ctx, *pos.rope_ctx)
        ctx_positions = pos.ctx
        if cache is not None:
            if cache[0] is None:
                cache[0] = LayerCache(k_ctx, v_ctx, ctx_positions)
            else:
                cache[0].append(k_ctx, v_ctx, ctx_positions)
            if self.window is not None:
                cache[0].drop_before(int(pos.q[0].min()) - self.window + 1)
            k_ctx, v_ctx, ctx_positions = cache[0].k, cache[0].v, cache[0].positions
        if mask is None and self.window is not None:
            mask = window_mask(pos.q, torch.cat([ctx_positions, pos.q], dim=1), self.window)
        k, v = torch.cat([k_ctx, k_blk], dim=2), torch.cat([v_ctx, v_blk], dim=2)
        # Under autocast the norms/RoPE promote q and k to float32 while v stays bf16; attention
        # kernels (flex in particular, which autocast does not cover) need one dtype.
        q, k = q.to(v.dtype), k.to(v.dtype)
        out = attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP, each added to the residual. A DFlash2 drafter (dflash2.py) sets
    ``attention_conv`` and ``mlp_conv``: a convolution over the block's tokens on both sides of each
    sublayer (``before`` its input, ``after`` its output); a DFlash drafter has none."""

    def __init__(self, cfg: DrafterConfig, index: int):
        super().__init__()
        self.layer_type = cfg.layer_types[index]
        self.self_attn = Attention(cfg, cfg.window_of(index))
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention_conv: nn.Module | None = None
        self.mlp_conv: nn.Module | None = None

    def forward(self, x, ctx, pos: Positions, mask, cache=None) -> torch.Tensor:
        if isinstance(mask, dict):
            mask = mask[self.layer_type]
        x = x + _around(self.attention_conv, lambda h: self.self_attn(h, ctx, pos, mask, cache),
                        self.input_layernorm(x), pos.block_len)
        return x + _around(self.mlp_conv, self.mlp, self.post_attention_layernorm(x), pos.block_len)


def _around(conv: nn.Module | None, sublayer, h: torch.Tensor, block_len: int | None) -> torch.Tensor:
    """``sublayer(h)``, between the two sides of ``conv`` when the layer has one."""
    if conv is None:
        return sublayer(h)
    h, after = conv.before(h, block_len)
    return conv.after(sublayer(h), after, block_len)


# --------------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    """DFlash drafter. ``forward`` maps block embeddings + target context to final hidden states."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_layers)])
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.apply(self._init)

    def _init(self, m: nn.Module) -> None:
        # As the reference (transformers' Qwen3 init): normal(0, 0.02) linears, unit norms.
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=self.config.initializer_range)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def context_feature(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[B, C, len(taps) * H] concatenated tap states -> [B, C, H] context feature.

        Under autocast the states go into `fc` as the target gave them (bf16 on a GPU): casting them
        to the fp32 weight's dtype first would make a copy twice their size that autocast at once
        casts back, keeping a second bf16 copy for backward."""
        if not torch.is_autocast_enabled(target_hidden.device.type):
            target_hidden = target_hidden.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        noise_embeds: torch.Tensor,
        target_hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx_positions: torch.Tensor,
        mask=None,
        cache: list | None = None,
        seq_len: int | None = None,
        block_len: int | None = None,
    ) -> torch.Tensor:
        """Final hidden states [B, Q, H] for the block tokens (apply the target's LM head for logits).

        noise_embeds:  [B, Q, H]  target embeddings of the block tokens ([anchor, MASK, ...] per block;
                                  training packs many blocks side by side)
        target_hidden: [B, C, L*H] tap-layer hidden states of the context positions
        positions:     [B, Q]     absolute positions of the block tokens (anchor position + slot)
        ctx_positions: [B, C]     absolute positions of the context
        mask:          None (full layers: every query sees every key; sliding layers: the window over
                       the positions), bool [B, 1, Q, C+Q] (True = visible; keys are context first, then
                       block tokens), or a FlexAttention BlockMask of that layout; or a dict of such
                       masks by layer type (training's packed blocks: masks.py builds one per type)
        cache:         list from ``new_cache()`` for incremental decoding; the given context is appended
        seq_len:       dynamic NTK RoPE only: one more than the largest position (read from the positions,
                       a host read, if not given)
        block_len:     the queries are packed blocks of this many tokens (training); None: they are one
                       block (decoding). Only DFlash2's convolutions read it: they never cross a block
        """
        x = noise_embeds.to(self.fc.weight.dtype)
        ctx = self.context_feature(target_hidden)
        if self.rotary.dynamic and seq_len is None:  # one length for queries and context alike
            seq_len = int(torch.cat([positions, ctx_positions], dim=1).max()) + 1
        pos = Positions(positions, ctx_positions, self.rotary(positions, x.dtype, seq_len),
                        self.rotary(ctx_positions, x.dtype, seq_len), block_len)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, pos, mask, None if cache is None else cache[i])
        return self.norm(x)

    def new_cache(self) -> list:
        """Per-layer context key/value cache for decoding (block keys/values are never kept; a sliding
        layer keeps only the last W-1 context positions, all a later block can see)."""
        return [[None] for _ in self.layers]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def mask_token_embedding_ok(embed_weight: torch.Tensor, token_id: int) -> bool:
    """A zero embedding row makes every masked slot's first-layer query zero (uniform attention, equal
    outputs for all slots): a one-layer drafter could then only predict one token per block."""
    row = embed_weight[token_id].float()
    return bool(row.norm() > 1e-6 * math.sqrt(row.numel()))


def init_from_target(drafter: DFlashDrafter, target_model: nn.Module) -> list[str]:
    """Start the drafter's layers as copies of the target's top decoder layers (and its final norm).

    The drafter's layers have the target's shapes and Qwen3 parameter names, and the target's LM head
    reads its output, so the top of the target is a far better starting point than noise: the
    drafter begins by computing roughly what the target's last layers compute and only has to learn
    to use the injected context and the masked block. Returns the names copied.
    """
    decoder = target_model.get_decoder() if hasattr(target_model, "get_decoder") else target_model.base_model
    src_layers = list(decoder.layers)[-len(drafter.layers):]
    copied = []
    with torch.no_grad():
        for i, (dst, src) in enumerate(zip(drafter.layers, src_layers, strict=True)):
            src_state = src.state_dict()
            for name, p in dst.state_dict().items():
                if name in src_state and src_state[name].shape == p.shape:
                    p.copy_(src_state[name].to(p.dtype))
                    copied.append(f"layers.{i}.{name}")
        if decoder.norm.weight.shape == drafter.norm.weight.shape:
            drafter.norm.weight.copy_(decoder.norm.weight.to(drafter.norm.weight.dtype))
            copied.append("norm.weight")
        # If one tap is the layer just below the copied ones, start the context feature as exactly what
        # the first copied layer read in the target (that tap, under that layer's input norm): the
        # injected keys and values then begin as the target's own.
        below = len(decoder.layers) - len(drafter.layers) - 1
        taps = list(drafter.config.target_layer_ids)
        if below in taps:
            h = drafter.config.hidden_size
            k = taps.index(below)
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, k * h:(k + 1) * h] = torch.eye(h, dtype=drafter.fc.weight.dtype)
            drafter.hidden_norm.weight.copy_(src_layers[0].input_layernorm.weight.to(drafter.hidden_norm.weight.dtype))
            copied += ["fc.weight", "hidden_norm.weight"]
    return copied
