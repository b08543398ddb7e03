"""Frozen modules that apply a target's embedding and LM head the way the target applies them, where it
does more than look up a row or multiply by the head (Gemma scales its embeddings and soft-caps its
logits). Each exposes the wrapped ``weight``, for callers that cast their input to its dtype."""

from __future__ import annotations

import torch
from torch import nn


class _Wrapped(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight


class ScaledEmbedding(_Wrapped):
    """An embedding whose output is multiplied by a constant in the weight's dtype, as Gemma's is."""

    def __init__(self, embed: nn.Embedding, scale: float):
        super().__init__(embed)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids) * torch.tensor(self.scale, dtype=self.inner.weight.dtype)


class SoftCappedHead(_Wrapped):
    """``cap * tanh(head(h) / cap)``: Gemma's final logit soft-cap."""

    def __init__(self, head: nn.Linear, cap: float):
        super().__init__(head)
        self.cap = cap

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(h) / self.cap) * self.cap


def capped(head: nn.Linear, config) -> nn.Module:
    """The head followed by the final logit soft-cap where the target's config has one."""
    cap = getattr(config, "final_logit_softcapping", None)
    return SoftCappedHead(head, float(cap)) if cap else head


class NormedHead(_Wrapped):
    """``head(norm(h))``: the target's logits from its final state taken before the final norm (what a
    cache holds); with ``nn.Identity`` for the norm, from a state already normed."""

    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__(head)
        self.norm = norm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.inner(self.norm(h))


def embedding_scale(embed: nn.Module) -> float:
    """The constant a target's frozen embedding multiplies its rows by (1.0: a plain lookup)."""
    if isinstance(embed, ScaledEmbedding):  # ours: a cache's target, built from the config
        return float(embed.scale)
    # transformers' own module (an in-process target's): Gemma's scaled word embedding applies its
    # ``embed_scale`` buffer in its forward, and keeps the float it was given (``scalar_embed_scale``)
    # beside it; the float is the one to record, as ours does: a buffer cast to bf16 with the model
    # reads sqrt(2560) as 50.5, and a release check would then refuse the same scale
    return float(getattr(embed, "scalar_embed_scale", None) or getattr(embed, "embed_scale", 1.0))


def applied(embed: nn.Module, head: nn.Module) -> tuple[float, float | None]:
    """(embedding scale, logit soft-cap or None) that a target's frozen embedding and head apply: what a
    DFlash2 export records for the engines (``input_embedding_scale``, ``final_logit_softcapping``)."""
    return embedding_scale(embed), (head.cap if isinstance(head, SoftCappedHead) else None)
