"""The DFlash2 drafter: the DFlash drafter plus a dynamic convolution around each sublayer and a candidate
selector that re-ranks the LM head's top-k tokens along the block.

Read top to bottom: the config (DFlash's fields and seven more), the convolution, the selector, the model.

* **Grouped dynamic causal convolution** (``attention_conv``, ``mlp_conv`` of every decoder layer). Both
  sides of a sublayer are convolved over the block's tokens: ``before`` its (normed) input and ``after``
  its output. Output channel c of token t is ``sum_o (base[o, c] + d[t, o, g(c)]) * x[t - o, c]`` for
  taps o = 0..K-1, where ``base`` is a learnt per-channel kernel and ``d`` a per-token kernel predicted
  from the token itself (``kernel_projection`` of the sublayer's input, one coefficient per tap and
  channel group of ``conv_group_size`` channels; one projection gives both sides' kernels). It is causal
  and never crosses a block boundary: token t of a block sees the block's tokens t-K+1..t, and zeros
  before the block's first token, exactly as the serving engines run it on each request's block. The
  context (the target's hidden states) is never convolved: it enters only as keys and values.
* **Candidate selector** (``candidate_selector``). The target's LM head gives each slot's unary logits;
  the selector keeps the top ``selector_top_k`` and scores candidate c after predecessor p as
  ``unary[c] + <predecessor_codebook[p] * hidden_projection(h), successor_codebook[c]>``, walked left to
  right from the verified anchor token: greedy takes the best candidate, sampling draws one from the
  softmax of the scores at the temperature. So slot k's draft depends on slot k-1's (DFlash's slots are
  independent).

Parameter names and shapes are the public reference's (z-lab/dflash ``DFlash2DraftModel``) after its
loader's renaming: the codebooks are plain tensors, stored without a ``.weight`` suffix, so
``state_dict()`` is the exported ``model.safetensors`` (export.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.dspark import DSparkConfig, DSparkDrafter

#: the published DFlash2 drafters' settings (the reference's Qwen3.6/3.8 configs)
DEFAULT_KERNEL, DEFAULT_GROUP, DEFAULT_RANK, DEFAULT_TOP_K = 2, 16, 256, 16


def settings_problem(kernel: int, group: int, rank: int, top_k: int, *, block_size: int | None = None,
                     hidden_size: int | None = None, vocab_size: int | None = None) -> str | None:
    """The first thing wrong with these DFlash2 settings, in one line, or None. Sizes not yet known
    (the target's, before it loads) are left unchecked."""
    if kernel < 1:
        return f"conv_kernel_size must be at least 1, got {kernel}"
    if block_size is not None and kernel > block_size:
        return f"conv_kernel_size {kernel} is longer than the block ({block_size} tokens): the convolution " \
               "never reaches past a block, so use a kernel of at most the block size"
    if group < 1:
        return f"conv_group_size must be at least 1, got {group}"
    if hidden_size is not None and hidden_size % group:
        return f"conv_group_size {group} does not divide the hidden size {hidden_size}: pick a divisor " \
               f"(e.g. {max(d for d in range(1, min(group, hidden_size) + 1) if hidden_size % d == 0)})"
    if rank < 1:
        return f"selector_rank must be at least 1, got {rank}"
    if top_k < 1:
        return f"selector_top_k must be at least 1, got {top_k}"
    if vocab_size is not None and top_k > vocab_size:
        return f"selector_top_k {top_k} is more candidates than the vocabulary has ({vocab_size})"
    return None


@dataclass
class DFlash2Config(DrafterConfig):
    """A DFlash drafter's config and DFlash2's settings.

    ``input_embedding_scale``, ``output_multiplier`` and ``final_logit_softcapping`` say how the
    target applies its embedding and LM head (Gemma scales one and soft-caps the other). The trainer
    and ``dflash eval`` apply them through the target's own frozen head (targets/heads.py); the config
    records them so that an engine reading the export applies the same, and a release made for a target
    that applies them otherwise is refused.
    """

    conv_kernel_size: int = DEFAULT_KERNEL
    conv_group_size: int = DEFAULT_GROUP
    selector_rank: int = DEFAULT_RANK
    selector_top_k: int = DEFAULT_TOP_K
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    drafter_type: ClassVar[str] = "dflash2"

    def __post_init__(self) -> None:
        super().__post_init__()
        problem = settings_problem(self.conv_kernel_size, self.conv_group_size, self.selector_rank,
                                   self.selector_top_k, block_size=self.block_size, hidden_size=self.hidden_size,
                                   vocab_size=self.vocab_size)
        if problem:
            raise ValueError(problem)

    def describe_layers(self) -> str:
        return (f"{super().describe_layers()}; DFlash2: conv kernel {self.conv_kernel_size} group "
                f"{self.conv_group_size}, selector rank {self.selector_rank} top-{self.selector_top_k}")


def config_from_dict(d: dict) -> DrafterConfig:
    """The config a checkpoint's ``drafter_config`` holds: a DFlash2Config or DSparkConfig when its
    ``drafter_type`` says so (checkpoint_dict writes it), else a DrafterConfig (every checkpoint before
    DFlash2)."""
    kinds = {c.drafter_type: c for c in (DrafterConfig, DFlash2Config, DSparkConfig)}
    return kinds.get(d.get("drafter_type"), DrafterConfig).from_dict(d)


def build_drafter(config: DrafterConfig) -> DFlashDrafter:
    """The drafter a config describes."""
    if isinstance(config, DSparkConfig):
        return DSparkDrafter(config)
    return DFlash2Drafter(config) if isinstance(config, DFlash2Config) else DFlashDrafter(config)


# --------------------------------------------------------------------------------------------------
# The convolution
# --------------------------------------------------------------------------------------------------


class GroupedDynamicCausalConv(nn.Module):
    """Both sides of one sublayer's convolution (see the module docstring)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        # Starts as the identity, as the peers initialise it: tap 0 of the base kernel passes every
        # channel through, the other taps and the predicted kernels are zero. A new DFlash2 drafter
        # therefore computes exactly what a DFlash drafter with the same other weights computes.
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)  # [side (before, after), tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def before(self, h: torch.Tensor, block_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The input side convolved, and the output side's per-token kernels (both predicted from ``h``)."""
        kernels = self.kernel_projection(h).unflatten(-1, (2, self.kernel_size, self.groups))
        return self._convolve(h, kernels[..., 0, :, :], 0, block_len), kernels[..., 1, :, :]

    def after(self, h: torch.Tensor, kernels: torch.Tensor, block_len: int | None) -> torch.Tensor:
        return self._convolve(h, kernels, 1, block_len)

    def _convolve(self, h: torch.Tensor, kernels: torch.Tensor, side: int, block_len: int | None) -> torch.Tensor:
        """h [B, Q, H] in blocks of ``block_len`` tokens (None: one block); kernels [B, Q, K, groups]."""
        b, q, hidden = h.shape
        n = block_len or q
        x = h.view(b, q // n, n, self.groups, self.group_size)
        dynamic = kernels.reshape(b, q // n, n, self.kernel_size, self.groups, 1)
        base = self.base_kernel[side].view(self.kernel_size, self.groups, self.group_size).to(h.dtype)
        out = (base[0] + dynamic[..., 0, :, :]) * x
        for tap in range(1, min(self.kernel_size, n)):
            earlier = F.pad(x[:, :, : n - tap], (0, 0, 0, 0, tap, 0))  # token t sees t - tap, zeros before the block
            out = out + (base[tap] + dynamic[..., tap, :, :]) * earlier
        return out.view(b, q, hidden)


# --------------------------------------------------------------------------------------------------
# The selector
# --------------------------------------------------------------------------------------------------


@dataclass
class Proposal:
    """A block's drafts from the selector walk: tokens [B, L], the candidates [B, L, K] each slot chose
    among, and (sampling only) the probabilities [B, L, K] it drew them with."""

    tokens: torch.Tensor
    candidates: torch.Tensor
    probs: torch.Tensor | None = None


class CandidateSelector(nn.Module):
    def __init__(self, cfg: DFlash2Config):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)
        # As the peers initialise it: a zero successor codebook makes every transition score zero, so a
        # new selector ranks by the unary logits alone and its greedy walk is plain top-1 (DFlash's
        # draft). The successor codebook learns first (its gradient is predecessor * projection, not
        # zero); the other two factors get a gradient once it has moved.
        nn.init.normal_(self.predecessor_codebook, std=cfg.initializer_range)
        nn.init.zeros_(self.successor_codebook)
        nn.init.normal_(self.hidden_projection.weight, std=cfg.initializer_range)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(unary logits, token ids) of the top-k, each [..., K]."""
        return torch.topk(logits, self.top_k, dim=-1)

    def scores(self, projected: torch.Tensor, predecessors: torch.Tensor, unary: torch.Tensor,
               candidates: torch.Tensor) -> torch.Tensor:
        """[..., K] scores of ``candidates`` after ``predecessors`` [...] for slots whose projected states
        are ``projected`` [..., rank] (``hidden_projection(h)``)."""
        context = self.predecessor_codebook[predecessors] * projected
        successors = self.successor_codebook[candidates].to(context.dtype)  # [..., K, rank]
        transition = torch.matmul(successors, context.unsqueeze(-1)).squeeze(-1)  # no [..., K, rank] product
        return unary + transition.to(unary.dtype)

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, temperature: float = 0.0,
             generator: torch.Generator | None = None) -> Proposal:
        """Drafts for slots 1.. of a block: ``hidden`` [B, L, H] their states, ``logits`` [B, L, V] their
        unary logits, ``anchor`` [B] the verified token before slot 1. Left to right, each slot's
        predecessor is the token chosen for the slot before; greedy at temperature 0, else sampled."""
        unary, candidates = self.candidates(logits.float())
        projected = self.hidden_projection(hidden)
        previous, tokens, probs = anchor, [], []
        for i in range(hidden.shape[1]):
            s = self.scores(projected[:, i], previous, unary[:, i], candidates[:, i]).float()
            if temperature > 0:
                q = torch.softmax(s / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[:, 0]
                probs.append(q)
            else:
                index = s.argmax(-1)
            previous = candidates[:, i].gather(-1, index[:, None])[:, 0]
            tokens.append(previous)
        return Proposal(torch.stack(tokens, 1), candidates, torch.stack(probs, 1) if probs else None)


# --------------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------------


class DFlash2Drafter(DFlashDrafter):
    """A DFlash drafter whose layers convolve around both sublayers, with a candidate selector; the
    forward is DFlashDrafter's (its layers call the convolutions)."""

    config: DFlash2Config
    #: the objective terms it trains beside the token loss (dflash/objectives/selector.py), by weight
    objective_terms = {"selector": 1.0}

    def __init__(self, config: DFlash2Config):
        super().__init__(config)  # its init pass runs before the convolutions and the selector exist
        h = config.hidden_size
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicCausalConv(h, config.conv_kernel_size, config.conv_group_size)
            layer.mlp_conv = GroupedDynamicCausalConv(h, config.conv_kernel_size, config.conv_group_size)
        self.candidate_selector = CandidateSelector(config)

    def propose(self, hidden: torch.Tensor, anchor: torch.Tensor, lm_head: nn.Module, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        """The selector walk over ``lm_head(hidden)`` (the target's head, applied as the target applies
        it); see CandidateSelector.walk."""
        logits = lm_head(hidden.to(lm_head.weight.dtype))
        return self.candidate_selector.walk(hidden.to(self.fc.weight.dtype), logits, anchor, temperature, generator)
