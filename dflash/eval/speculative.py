"""Speculative decoding with a DFlash drafter, greedy, batch size 1 — and the numbers that judge it.

One round: the drafter fills the block [last token, MASK, ...] in one pass; the target verifies the whole
block in one forward; the longest prefix of drafts that equals the target's own argmax is kept, plus the
target's next token (the "bonus"). So every round yields accepted + 1 tokens, and the output is exactly
the target's greedy output — which ``evaluate`` checks against a plain greedy decode, token for token.

tau = mean tokens per round (accepted + 1). A drafter that is always wrong gives tau = 1.0 (no
speculation); a perfect one gives the block size.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from dflash.model.drafter import DFlashDrafter
from dflash.model.target import Target


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x
        return DynamicCache()


def _crop(cache, length: int) -> None:
    """Keep the first ``length`` positions. transformers 5 ``crop`` takes minus the number to drop
    (4.x also reads a negative argument that way)."""
    drop = cache.get_seq_length() - length
    if drop > 0:
        cache.crop(-drop)


def _forward(target: Target, ids: torch.Tensor, cache, start: int, hidden: bool, last_only: bool = False):
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    kwargs = {target.cache_kwarg: cache}
    if last_only:
        kwargs["logits_to_keep"] = 1
    return target.model(input_ids=ids, position_ids=positions, use_cache=True, output_hidden_states=hidden, **kwargs)


@torch.inference_mode()
def greedy_generate(
    target: Target, prompt_ids: list[int], max_new_tokens: int, stop_token_ids: list[int] | None = None
) -> list[int]:
    """The target's own greedy continuation (KV-cached, one token per forward): the lossless reference."""
    stops = set(stop_token_ids or [])
    cache = _new_cache(target.model)
    ids = torch.tensor([prompt_ids], device=target.device)
    out: list[int] = []
    pos = 0
    while len(out) < max_new_tokens:
        logits = _forward(target, ids, cache, pos, hidden=False, last_only=True).logits
        pos += ids.shape[1]
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if tok in stops:
            break
        ids = torch.tensor([[tok]], device=target.device)
    return out


@dataclass
class SpecOutput:
    """One speculative decode. Per round: ``accepted`` drafts matched (0..block-1), ``produced`` tokens
    appended (accepted + 1, fewer when a stop token or the token limit cut the round), ``drafted`` slots
    verified."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    produced: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    target_forwards: int = 0


def check_compatible(drafter: DFlashDrafter, target: Target) -> None:
    """Raise ValueError (one line) when the drafter was not trained for a target of this shape."""
    c = drafter.config
    problems = []
    if c.hidden_size != target.hidden_size:
        problems.append(f"hidden size {c.hidden_size} vs target {target.hidden_size}")
    if c.num_target_layers != target.num_layers:
        problems.append(f"{c.num_target_layers} target layers vs {target.num_layers}")
    if c.vocab_size != target.vocab_size:
        problems.append(f"vocab {c.vocab_size} vs target {target.vocab_size}")
    if problems:
        raise ValueError("drafter does not match the target: " + "; ".join(problems))


@torch.inference_mode()
def speculative_generate(
    drafter: DFlashDrafter,
    target: Target,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    block_size: int | None = None,
) -> SpecOutput:
    """Draft-then-verify greedy decoding; returns the same tokens as ``greedy_generate``.

    The drafter's context is incremental: its per-layer cache holds keys/values of the context feature
    for every verified position; each round appends the hidden states of the tokens just accepted.
    """
    stops = set(stop_token_ids or [])
    bs_max = block_size or drafter.config.block_size
    taps = drafter.config.target_layer_ids
    dev = target.device
    ddev = drafter.fc.weight.device  # may differ from the target's (a pipeline's drafter GPU)
    mask_id = drafter.config.mask_token_id

    cache = _new_cache(target.model)
    prompt = torch.tensor([prompt_ids], device=dev)
    out = _forward(target, prompt, cache, 0, hidden=True, last_only=True)
    res = SpecOutput(tokens=[int(out.logits[0, -1].argmax())], target_forwards=1)
    ctx = torch.cat([out.hidden_states[i + 1] for i in taps], dim=-1)  # context not yet seen by the drafter
    ctx_start = 0
    dcache = drafter.new_cache()

    while res.tokens[-1] not in stops and len(res.tokens) < max_new_tokens:
        cur = len(prompt_ids) + len(res.tokens) - 1  # position of the newest token (the anchor)
        bs = min(bs_max, max_new_tokens - len(res.tokens) + 1)
        block = torch.full((bs,), mask_id, dtype=torch.long, device=dev)
        block[0] = res.tokens[-1]
        positions = torch.arange(cur, cur + bs, device=ddev)[None]
        ctx_positions = torch.arange(ctx_start, cur, device=ddev)[None]
        h = drafter(target.embed_tokens(block)[None].to(ddev), ctx.to(ddev), positions, ctx_positions, cache=dcache)
        block[1:] = target.lm_head(h[0, 1:].to(dev, target.lm_head.weight.dtype)).argmax(-1)

        out = _forward(target, block[None], cache, cur, hidden=True)
        res.target_forwards += 1
        posterior = out.logits[0].argmax(-1)  # target's choice after each block token
        accepted = int((block[1:] == posterior[:-1]).int().cumprod(0).sum())
        new = block[1 : accepted + 1].tolist() + [int(posterior[accepted])]
        produced = 0
        for tok in new:
            res.tokens.append(tok)
            produced += 1
            if tok in stops or len(res.tokens) >= max_new_tokens:
                break
        res.accepted.append(accepted)
        res.produced.append(produced)
        res.drafted.append(bs - 1)

        _crop(cache, cur + accepted + 1)  # keep the anchor and the accepted drafts; drop the rest
        ctx = torch.cat([out.hidden_states[i + 1] for i in taps], dim=-1)[:, : accepted + 1]
        ctx_start = cur
    return res


@dataclass
class EvalResult:
    """What ``dflash eval`` reports; ``to_dict()`` is its --json output."""

    tau: float  # mean tokens per verify round (accepted + 1)
    rounds: int
    tokens_generated: int
    target_forwards: int  # speculative: prefill + one per round
    baseline_forwards: int  # plain greedy: prefill + one per further token
    forwards_saved: int
    acceptance_histogram: list[int]  # rounds with 0, 1, ..., block-1 drafts accepted
    per_position_acceptance: list[float]  # slot k (k = 1..block-1): fraction of rounds it was accepted
    lossless: bool | None  # speculative output == the target's greedy output everywhere (None: unchecked)
    mismatched_prompts: list[int]
    num_prompts: int
    block_size: int
    max_new_tokens: int
    per_prompt_tau: list[float]
    speculative_seconds: float
    greedy_seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate(
    drafter: DFlashDrafter,
    target: Target,
    prompts: list[list[int]],
    max_new_tokens: int = 128,
    stop_token_ids: list[int] | None = None,
    check_lossless: bool = True,
    block_size: int | None = None,
) -> EvalResult:
    """Speculative decode of every prompt (and, with ``check_lossless``, a plain greedy decode to
    compare against). Stops at the target's EOS ids unless ``stop_token_ids`` is given.

    The drafter stays where it is (device, dtype; its train/eval mode is restored afterwards), so a
    trainer can evaluate its live drafter between steps.
    """
    if not isinstance(drafter, DFlashDrafter) or not isinstance(target, Target):
        raise TypeError("call evaluate(drafter, target, prompts, ...)")
    if not prompts:
        raise ValueError("no prompts to evaluate")
    check_compatible(drafter, target)
    stops = target.stop_token_ids() if stop_token_ids is None else stop_token_ids
    bs = block_size or drafter.config.block_size
    was_training = drafter.training
    drafter.eval()
    hist = [0] * bs
    pos_acc, pos_n = [0] * (bs - 1), [0] * (bs - 1)
    produced = rounds = tokens = spec_fwd = base_fwd = 0
    mismatched: list[int] = []
    per_prompt: list[float] = []
    t_spec = t_greedy = 0.0
    try:
        for i, prompt in enumerate(prompts):
            t0 = time.perf_counter()
            res = speculative_generate(drafter, target, prompt, max_new_tokens, stops, bs)
            t_spec += time.perf_counter() - t0
            for a, d in zip(res.accepted, res.drafted, strict=True):
                hist[a] += 1
                for k in range(d):
                    pos_n[k] += 1
                    pos_acc[k] += int(k < a)
            rounds += len(res.produced)
            produced += sum(res.produced)
            tokens += len(res.tokens)
            spec_fwd += res.target_forwards
            base_fwd += len(res.tokens)
            per_prompt.append(sum(res.produced) / len(res.produced) if res.produced else 1.0)
            if check_lossless:
                t0 = time.perf_counter()
                ref = greedy_generate(target, prompt, max_new_tokens, stops)
                t_greedy += time.perf_counter() - t0
                if ref != res.tokens:
                    mismatched.append(i)
    finally:
        drafter.train(was_training)
    return EvalResult(
        tau=produced / rounds if rounds else 1.0,
        rounds=rounds,
        tokens_generated=tokens,
        target_forwards=spec_fwd,
        baseline_forwards=base_fwd,
        forwards_saved=base_fwd - spec_fwd,
        acceptance_histogram=hist,
        per_position_acceptance=[a / n if n else 0.0 for a, n in zip(pos_acc, pos_n, strict=True)],
        lossless=(not mismatched) if check_lossless else None,
        mismatched_prompts=mismatched,
        num_prompts=len(prompts),
        block_size=bs,
        max_new_tokens=max_new_tokens,
        per_prompt_tau=per_prompt,
        speculative_seconds=t_spec,
        greedy_seconds=t_greedy,
    )
