"""Sampling at a temperature, and the rejection step that keeps speculative sampling lossless.

The distributions are the reference's (z-lab/dflash ``dflash_generate``): logits divided by the
temperature, cut to the ``top_k`` largest (0: no cut), then to the smallest set of the most likely
tokens whose probability reaches ``top_p``, renormalised. The target's tokens are drawn from that
distribution p; a draft token from the drafter's own q (DFlash: the same cut of its logits; DFlash2:
the selector's probabilities over its candidates).

Rejection sampling (Leviathan et al., Chen et al.): draft token d at slot i is kept with probability
``min(1, p_i(d) / q_i(d))``; at the first rejection the token is drawn from the residual
``max(0, p_i - q_i)`` renormalised, and when every draft is kept the bonus token is drawn from the
target's next distribution. Each emitted token is then distributed exactly as p given the tokens before
it, whatever q is, as long as the draft at slot i was drawn from q_i given the drafts before it.
"""

from __future__ import annotations

import torch


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """One line (ValueError) for settings no distribution comes from."""
    if temperature < 0:
        raise ValueError(f"--temperature must be 0 (greedy) or more, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"--top-k must be 0 (no cut) or more, got {top_k}")


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """float32 probabilities over the vocabulary, [..., V], for ``temperature`` > 0."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        top = torch.topk(scores, top_k, dim=-1)  # exactly k, ties or not
        scores = torch.full_like(scores, float("-inf")).scatter(-1, top.indices, top.values)
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # the mass of the more likely tokens
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < top_p)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``probs`` [..., V]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def rejection_sample(drafts: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     draft_indices: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> tuple[int, int]:
    """(drafts kept, the token after them) for one verified block.

    drafts [L]; target_probs [L + 1, V]: p after the anchor and after each draft; draft_probs: q of
    each slot, [L, V] over the vocabulary, or [L, K] over ``draft_indices`` [L, K] (DFlash2's candidates).
    Reads the device (the count decides what is emitted).
    """
    n = drafts.shape[0]
    p = target_probs[:n].gather(-1, drafts[:, None])[:, 0]
    dense = draft_probs if draft_indices is None else \
        torch.zeros_like(target_probs[:n]).scatter_add_(-1, draft_indices, draft_probs.to(target_probs.dtype))
    q = dense.gather(-1, drafts[:, None])[:, 0]
    u = torch.rand(n, generator=generator, device=drafts.device)
    kept = int((u * q < p).int().cumprod(0).sum())  # u < p / q: kept with probability min(1, p / q)
    if kept == n:
        return kept, int(draw(target_probs[n], generator))
    residual = (target_probs[kept] - dense[kept]).clamp_min(0)
    total = residual.sum()
    # q equal to p there leaves nothing: a rejection then has probability 0, so any choice is exact
    residual = residual / total if float(total) > 0 else target_probs[kept]
    return kept, int(draw(residual, generator))
