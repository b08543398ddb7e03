"""Rotary position embedding as the target applies it, for the drafter's queries and keys (context and
block alike), in float32 whatever dtype the drafter runs in."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class RopeSettings(Protocol):
    """What the rotation needs of a drafter's config (a DrafterConfig has it)."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int


class Rotary(nn.Module):
    """RoPE as the target applies it: plain, or scaled (linear, dynamic NTK, YaRN), for arbitrary positions.

    The scaled frequencies and YaRN's attention factor come from transformers' own RoPE functions fed
    the drafter's ``rope_scaling``, so they are the reference's bit for bit (its ``Qwen3RotaryEmbedding``
    calls the same functions). Dynamic NTK stretches the base once positions pass
    ``max_position_embeddings``; its frequencies then depend on the longest position of the call.

    The frequencies are float32 whatever dtype the drafter is cast to: ``.to(bfloat16)`` would round
    them by up to 2^-9 relative, an angle error of about position x 2^-9 rad (radians wrong by position
    4000). cos/sin are computed in float32 and only then cast to the activations' dtype.
    """

    def __init__(self, cfg: RopeSettings):
        super().__init__()
        self.head_dim, self.theta, self.scaling = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling
        self.max_positions = cfg.max_position_embeddings
        self.dynamic = bool(self.scaling) and self.scaling["rope_type"] == "dynamic"
        inv_freq, self.attention_scaling = self._frequencies()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _frequencies(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        # Computed on the CPU, as transformers' Qwen3 rotary does, so every device gets the same bits.
        if self.scaling is None or (self.dynamic and (seq_len or 0) <= self.max_positions):
            exps = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            return 1.0 / (self.theta ** exps), 1.0
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = Qwen3Config(head_dim=self.head_dim, hidden_size=self.head_dim, num_attention_heads=1,
                         max_position_embeddings=self.max_positions,
                         rope_parameters={**self.scaling, "rope_theta": self.theta})
        with torch.device("cpu"):  # also inside a meta-device build (loading.check_shapes)
            inv_freq, factor = ROPE_INIT_FUNCTIONS[self.scaling["rope_type"]](hf, "cpu", seq_len=seq_len)
        return inv_freq.float(), float(factor)

    def _apply(self, fn, recurse: bool = True):
        # Every .to()/.cuda()/.half() ends here: follow the move, undo the cast.
        super()._apply(fn, recurse)
        self.inv_freq = self._frequencies()[0].to(self.inv_freq.device)
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, S, head_dim] for positions [B, S]. ``seq_len`` (dynamic NTK only): one more than
        the largest position of the pass, as transformers counts it; read from ``positions`` if not given."""
        inv_freq = self.inv_freq
        if self.dynamic:
            seq_len = seq_len if seq_len is not None else int(positions.max()) + 1
            if seq_len > self.max_positions:
                inv_freq = self._frequencies(seq_len)[0].to(inv_freq.device)
        freqs = positions[..., None].float() * inv_freq  # [B, S, head_dim/2], float32
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin
