"""Speculative decoding with a DFlash or DFlash2 drafter, batch size 1 — and the numbers that judge it.

One round: the drafter fills the full block [last token, MASK, ...] in one pass (a DFlash2 drafter then
walks its candidate selector from the last token); the target verifies the whole block in one forward;
the longest prefix of drafts that equals the target's own argmax is kept, plus the target's next token
(the "bonus"). So every round yields accepted + 1 tokens, and the output (cut at the token budget and
the first stop token) is exactly the target's greedy output — which ``evaluate`` checks against a plain
greedy decode, token for token, telling a real divergence from a near-tie that rounding decided.

At a temperature the drafts are sampled and kept by rejection sampling (sampling.py), so the output is
distributed as the target's own sampling at that temperature, top-p and top-k (tested statistically:
tests/test_eval_sampling.py); ``evaluate`` then reports tau without a token-for-token check.

tau = mean tokens per round (accepted + 1), every round counted whole, the last one too: the
reference benchmark's "acceptance length". A drafter that is always wrong gives tau = 1.0 (no
speculation); a perfect one gives the block size.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from dflash.eval.sampling import check_sampling, draw, rejection_sample, sampling_probs
from dflash.eval.verifier import CachedVerifier, new_cache
from dflash.model.dflash2 import DFlash2Drafter
from dflash.model.drafter import DFlashDrafter
from dflash.model.dspark import DSparkDrafter
from dflash.targets.base import hidden_states_index
from dflash.targets.hf import HFTarget


def _forward(target: HFTarget, ids: torch.Tensor, cache, start: int):
    positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    return target.model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                        **{target.cache_kwarg: cache})


@torch.inference_mode()
def greedy_generate(
    target: HFTarget, prompt_ids: list[int], max_new_tokens: int, stop_token_ids: list[int] | None = None
) -> list[int]:
    """The target's own greedy continuation (KV-cached, one token per forward): the lossless reference.
    Its argmax is its own, not the speculative loop's `_pick`, so a broken verifier cannot agree with it."""
    return _plain_generate(target, prompt_ids, max_new_tokens, lambda logits: int(logits.argmax()), stop_token_ids)


def _pick(logits: torch.Tensor) -> torch.Tensor:
    """The target's greedy choice in the speculative loop (one seam, so tests can break verification)."""
    return logits.argmax(-1)


@dataclass
class Sampling:
    """How tokens are chosen: greedy at temperature 0, else drawn from the target's distribution at
    ``temperature`` cut to ``top_k`` and ``top_p`` (sampling.py), with ``generator`` (None: torch's)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return sampling_probs(logits, self.temperature, self.top_p, self.top_k)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The token(s) for ``logits`` [..., V]."""
        return _pick(logits) if self.greedy else draw(self.probs(logits), self.generator)


@torch.inference_mode()
def sample_generate(target: HFTarget, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling,
                    stop_token_ids: list[int] | None = None) -> list[int]:
    """The target's own sampled continuation, one token per forward: what speculative sampling must
    be distributed as."""
    return _plain_generate(target, prompt_ids, max_new_tokens, lambda logits: int(sampling.choose(logits)),
                           stop_token_ids)


def _plain_generate(target: HFTarget, prompt_ids: list[int], max_new_tokens: int,
                    choose: Callable[[torch.Tensor], int], stop_token_ids: list[int] | None) -> list[int]:
    """Plain decoding, KV-cached: one target forward per token, ``choose`` picking it from the logits."""
    stops = set(stop_token_ids or [])
    cache = new_cache(target.model)
    ids = torch.tensor([prompt_ids], device=target.device)
    out: list[int] = []
    pos = 0
    while len(out) < max_new_tokens:
        logits = _forward(target, ids, cache, pos).logits
        pos += ids.shape[1]
        tok = choose(logits[0, -1])
        out.append(tok)
        if tok in stops:
            break
        ids = torch.tensor([[tok]], device=target.device)
    return out


def drafts_per_block(drafter: DFlashDrafter, block_size: int) -> int:
    """Tokens a block of ``block_size`` slots drafts: the slots after the anchor, or every slot for a
    drafter that drafts from the anchor's slot too (DSpark)."""
    return block_size if isinstance(drafter, DSparkDrafter) else block_size - 1


def scheduled_length(confidence: torch.Tensor, threshold: float) -> int:
    """Drafts a round verifies under confidence scheduling: the longest prefix whose running product of
    the confidence head's probabilities (``confidence`` [L], logits) stays at or above ``threshold``:
    the head's estimate that the draft survives that far. 0 verifies the anchor alone (the round yields
    the target's own next token)."""
    survive = torch.sigmoid(confidence.float()).cumprod(0)
    return int((survive >= threshold).int().cumprod(0).sum())


def _draft(drafter: DFlashDrafter, h: torch.Tensor, anchor: int, head, sampling: Sampling, dev: torch.device,
           threshold: float | None = None):
    """The block's drafts [L] from the drafter's states h [L, H] at its drafting slots, and what rejection
    sampling needs of them: (drafts, their probabilities or None when greedy, the candidates DFlash2
    chose among or None). With ``threshold`` (DSpark) the drafts are cut where the confidence head's
    running product falls below it (``scheduled_length``): whether a draft is verified depends on the
    drafts alone, never on the target, so rejection sampling stays exact."""
    logits = head(h.to(dev, head.weight.dtype))
    if isinstance(drafter, DSparkDrafter):  # the Markov head walked left to right from the anchor
        drawn: list[torch.Tensor] = []

        def choose(step: torch.Tensor) -> torch.Tensor:
            if sampling.greedy:
                return step.argmax(-1)
            drawn.append(sampling.probs(step))  # q of this slot given the drafts before it
            return draw(drawn[-1], sampling.generator)

        d = drafter.walk(h[None], logits[None].to(h.device), torch.tensor([anchor], device=h.device), choose)
        n = d.tokens.shape[1] if threshold is None else scheduled_length(d.confidence[0], threshold)
        q = torch.cat(drawn)[:n].to(dev) if drawn else None
        return d.tokens[0, :n].to(dev), q, None
    if isinstance(drafter, DFlash2Drafter):
        anchor_ids = torch.tensor([anchor], device=h.device)
        p = drafter.candidate_selector.walk(h[None], logits[None].to(h.device), anchor_ids, sampling.temperature,
                                            sampling.generator)
        return (p.tokens[0].to(dev), None if p.probs is None else p.probs[0].to(dev), p.candidates[0].to(dev))
    if sampling.greedy:
        return logits.argmax(-1), None, None
    q = sampling.probs(logits)
    return draw(q, sampling.generator), q, None


@dataclass
class SpecOutput:
    """One speculative decode. Per round: ``accepted`` drafts matched the target (0..block-1) in the full
    block that was verified; ``produced`` tokens of the round that are in ``tokens`` after the output was
    cut at the token budget and the first stop token (accepted + 1, fewer in the last round, 0 for a round
    that only ran past the budget)."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    produced: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)  # drafts each round verified (fewer when scheduled)
    target_forwards: int = 0

    @property
    def acceptance_lengths(self) -> list[int]:
        """Tokens each verify round yielded (accepted + 1), uncut: the reference benchmark's figures."""
        return [a + 1 for a in self.accepted]


def check_compatible(drafter: DFlashDrafter, target: HFTarget) -> None:
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


def _cut(tokens: list[int], max_new_tokens: int, stops: set[int]) -> list[int]:
    """The output as a user gets it: at most ``max_new_tokens``, ending at the first stop token."""
    out = tokens[:max_new_tokens]
    first_stop = next((i for i, t in enumerate(out) if t in stops), None)
    return out if first_stop is None else out[: first_stop + 1]


@torch.inference_mode()
def speculative_generate(
    drafter: DFlashDrafter,
    target: HFTarget,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    block_size: int | None = None,
    rollback: str | None = None,
    sampling: Sampling | None = None,
    confidence_threshold: float | None = None,
) -> SpecOutput:
    """Draft-then-verify decoding; greedy (``sampling`` None or at temperature 0) it returns the same
    tokens as ``greedy_generate``, sampled they are distributed as ``sample_generate``'s.

    Every round drafts and verifies a *full* block, as training shows the drafter (attention inside a
    block is bidirectional, so a shorter block would change every guess).
    Rounds go on while the newest token lies inside the budget and no stop token has appeared (checked
    after each round, so at least one round runs); the output is cut at the budget and the first stop
    token afterwards. This is the reference benchmark's loop, so ``acceptance_lengths`` are its numbers.

    The drafter's context is incremental: its per-layer cache holds keys/values of the context feature
    for every verified position (a sliding-window layer only the last W-1, all a later block can see);
    each round appends the hidden states of the tokens just accepted. The target's cache keeps only
    accepted tokens, whatever its layers (``CachedVerifier``; ``rollback`` picks how, by default the
    cheapest exact way for this target).

    ``confidence_threshold`` (a DSpark drafter's confidence head): each round verifies only the drafts
    the head expects to survive at that probability (``scheduled_length``), a shorter target forward
    for a round that would likely have been cut anyway.
    """
    if confidence_threshold is not None and not isinstance(drafter, DSparkDrafter):
        raise ValueError("--confidence-threshold schedules verification by a DSpark drafter's confidence head; "
                         "this drafter has none")
    if confidence_threshold is not None and not 0 <= confidence_threshold <= 1:
        raise ValueError(f"--confidence-threshold is a probability in [0, 1], got {confidence_threshold}")
    stops = set(stop_token_ids or [])
    sampling = sampling or Sampling()
    bs = block_size or drafter.config.block_size
    n_drafts = drafts_per_block(drafter, bs)
    taps = drafter.config.target_layer_ids
    dev = target.device
    ddev = drafter.fc.weight.device  # may differ from the target's (a pipeline's drafter GPU)
    mask_id = drafter.config.mask_token_id

    embed, head = target.frozen_head(dev)  # applied as the target applies them (Gemma: scaled, soft-capped)
    verifier = CachedVerifier(target.verifier, rollback)
    out = verifier.prefill(prompt_ids)
    seq = [int(sampling.choose(out.logits[-1]))]  # committed tokens, possibly past the budget
    res = SpecOutput(tokens=[])
    ctx = torch.cat([out.hidden_states[hidden_states_index(i)] for i in taps], -1)  # context the drafter has not seen
    ctx_start = 0
    dcache = drafter.new_cache()
    scanned = 0  # seq[:scanned] holds no stop token

    while True:
        cur = len(prompt_ids) + len(seq) - 1  # position of the newest token (the anchor)
        block = torch.full((bs,), mask_id, dtype=torch.long, device=dev)
        block[0] = seq[-1]
        positions = torch.arange(cur, cur + bs, device=ddev)[None]
        ctx_positions = torch.arange(ctx_start, cur, device=ddev)[None]
        h = drafter(embed(block)[None].to(ddev), ctx.to(ddev), positions, ctx_positions, cache=dcache)
        drafts, q, candidates = _draft(drafter, h[0, bs - n_drafts:], seq[-1], head, sampling, dev,
                                       confidence_threshold)
        res.verified.append(drafts.shape[0])

        out = verifier.verify(torch.cat([block[:1], drafts]))  # the anchor, then the drafts
        if sampling.greedy:
            posterior = _pick(out.logits)  # target's choice after each block token
            accepted = int((drafts == posterior[:-1]).int().cumprod(0).sum())
            after = int(posterior[accepted])
        else:
            accepted, after = rejection_sample(drafts, sampling.probs(out.logits), q, candidates, sampling.generator)
        seq += drafts[:accepted].tolist() + [after]
        res.accepted.append(accepted)

        verifier.commit(accepted + 1)  # keep the anchor and the accepted drafts; drop the rest
        ctx = torch.cat([out.hidden_states[hidden_states_index(i)] for i in taps], -1)[:, : accepted + 1]
        ctx_start = cur
        if len(seq) > max_new_tokens or not stops.isdisjoint(seq[scanned:]):
            break
        scanned = len(seq)

    res.target_forwards = verifier.forwards
    res.tokens = _cut(seq, max_new_tokens, stops)
    start = 1  # seq[0] came from the prefill; round r added seq[start : start + accepted_r + 1]
    for a in res.accepted:
        res.produced.append(max(0, min(a + 1, len(res.tokens) - start)))
        start += a + 1
    return res


# A greedy choice between two tokens closer than this many units of the logits' dtype (eps x their
# magnitude, at least 1) is decided by rounding, not by the model. Measured, not guessed
# (scripts/bench_tie_rounding.py; docs/benchmarks.md "Near-ties"): the target's bf16 logits for the same
# positions computed by block verification (16 queries per forward) and by one-token decoding, on the
# CPU, one torch thread. Between a position's two highest logits (the pair a greedy choice is between)
# the gap moved by at most 1.75 such units over 256 positions of each model (0.25 at logit ~20 on a
# Qwen3-0.6B-shaped random model, 28 layers, which flipped 4 of 192 argmaxes; 1.61 on the built-in tiny
# target cast to bf16). A flip needs a gap under that shift, so the bound is 1.75 rounded up to the next
# whole unit. The 4 used before would forgive a runner-up 0.6 behind at logit 20, which no rounding seen
# here explains. (Single logits far from the top move more in these units, up to ~40 near |logit| 1: the
# error follows the hidden state through the head, not the logit's size; they decide no greedy choice.)
TIE_ULPS = 2


@dataclass
class Divergence:
    """Where a speculative decode first left the target's greedy decode, and whether that was a near-tie."""

    prompt: int
    position: int  # index into the generated tokens
    speculative_token: int | None  # None: that decode had already ended
    greedy_token: int | None
    logit_gap: float | None  # |logit(greedy) - logit(speculative)| in a fresh full-prefix target forward
    tolerance: float | None
    near_tie: bool


def tie_tolerance(dtype: torch.dtype, scale: float) -> float:
    """Largest logit gap that ``dtype`` rounding between block verification and one-token decoding can
    flip, for logits of magnitude ``scale`` (TIE_ULPS: measured)."""
    return TIE_ULPS * torch.finfo(dtype).eps * max(1.0, scale)


@torch.inference_mode()
def classify_divergence(target: HFTarget, index: int, prompt_ids: list[int], speculative: list[int],
                        greedy: list[int]) -> Divergence | None:
    """None when the two decodes are equal; else their first difference, judged on the target's logits
    there: a near-tie (the two tokens' logits within ``tie_tolerance``) is rounding, anything else a
    real loss."""
    pos = next((i for i, (a, b) in enumerate(zip(speculative, greedy, strict=False)) if a != b), None)
    if pos is None:
        if len(speculative) == len(greedy):
            return None
        pos = min(len(speculative), len(greedy))  # one stopped, the other went on: a real difference
        return Divergence(index, pos, speculative[pos] if pos < len(speculative) else None,
                          greedy[pos] if pos < len(greedy) else None, None, None, False)
    s, g = speculative[pos], greedy[pos]
    ids = torch.tensor([prompt_ids + greedy[:pos]], device=target.device)
    logits = target.model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
    gap = float((logits[g] - logits[s]).abs())
    tol = tie_tolerance(target.dtype, float(torch.maximum(logits[g].abs(), logits[s].abs())))
    return Divergence(index, pos, s, g, gap, tol, gap <= tol)


@dataclass
class EvalResult:
    """What ``dflash eval`` reports; ``to_dict()`` is its --json output."""

    tau: float  # mean tokens per verify round (accepted + 1) over all rounds of all prompts
    acceptance_length: float  # mean over prompts of per_prompt_tau: the reference benchmark's average
    rounds: int
    tokens_generated: int
    target_forwards: int  # speculative: prefill + one per round (+ the verifier's reruns, see verifier.py)
    baseline_forwards: int  # plain greedy: prefill + one per further token
    forwards_saved: int
    acceptance_histogram: list[int]  # rounds with 0, 1, ..., block-1 drafts accepted
    per_position_acceptance: list[float]  # slot k (k = 1..block-1): fraction of rounds it was accepted
    lossless: bool | None  # no real divergence from the target's greedy output (None: unchecked)
    mismatched_prompts: list[int]  # prompts that diverged for real
    near_tie_prompts: list[int]  # prompts that diverged only where two logits were within rounding
    exact_prompts: int  # prompts whose speculative output equals the target's greedy one token for token
    near_ties: int  # prompts that left it at a near-tie: within rounding, but not exact agreement
    divergences: list[dict]  # one Divergence per prompt in the two lists above
    num_prompts: int
    block_size: int
    max_new_tokens: int
    per_prompt_tau: list[float]
    speculative_seconds: float
    greedy_seconds: float
    temperature: float = 0.0  # 0: greedy; else sampled at this temperature, top_p and top_k (0: no cut)
    top_p: float = 1.0
    top_k: int = 0
    confidence_threshold: float | None = None  # DSpark: verification scheduled by the confidence head
    mean_verified: float | None = None  # drafts a round verified, on average (the block's, unscheduled)
    # wall time of plain greedy decoding over speculative decoding's (< 1: a slow-down); None when
    # the plain decode did not run (no lossless check)
    speedup: float | None = None
    # a round's wall time in plain decoding steps (one target forward of one token, as greedy
    # decoding timed it): speculation is faster only where tau exceeds it
    round_cost: float | None = None

    def __post_init__(self) -> None:
        if self.greedy_seconds > 0 and self.speculative_seconds > 0 and self.rounds and self.baseline_forwards:
            self.speedup = self.greedy_seconds / self.speculative_seconds
            step = self.greedy_seconds / self.baseline_forwards
            self.round_cost = self.speculative_seconds / self.rounds / step

    def to_dict(self) -> dict:
        return asdict(self)


def lossless_label(lossless: bool | None, near_ties: int = 0) -> str:
    """The lossless column: "yes" only for token-for-token agreement on every prompt, the near-ties
    counted apart ("near-tie 2": no real loss, but two prompts left greedy where rounding decided),
    "NO" for a real divergence, "-" unchecked."""
    if lossless is None:
        return "-"
    if not lossless:
        return "NO"
    return f"near-tie {near_ties}" if near_ties else "yes"


@dataclass
class PromptRun:
    """One prompt decoded: the speculative decode, its wall time, and (with the lossless check) the plain
    greedy decode's wall time and where the two first differ (None: nowhere, or unchecked)."""

    spec: SpecOutput
    seconds: float
    greedy_seconds: float = 0.0
    divergence: Divergence | None = None


def decode_prompt(drafter: DFlashDrafter, target: HFTarget, index: int, prompt: list[int], max_new_tokens: int,
                  stops: list[int], block_size: int, sampling: Sampling, check_lossless: bool,
                  confidence_threshold: float | None = None) -> PromptRun:
    """Decode one prompt speculatively and, with ``check_lossless``, plainly too, to compare the two
    (``confidence_threshold``: a DSpark drafter's scheduled verification, see speculative_generate)."""
    t0 = time.perf_counter()
    res = speculative_generate(drafter, target, prompt, max_new_tokens, stops, block_size, sampling=sampling,
                               confidence_threshold=confidence_threshold)
    run = PromptRun(res, time.perf_counter() - t0)
    if check_lossless:
        t0 = time.perf_counter()
        ref = greedy_generate(target, prompt, max_new_tokens, stops)
        run.greedy_seconds = time.perf_counter() - t0
        run.divergence = classify_divergence(target, index, prompt, res.tokens, ref)
    return run


def summarize(runs: list[PromptRun], block_size: int, n_drafts: int, max_new_tokens: int, sampling: Sampling,
              checked: bool, confidence_threshold: float | None = None) -> EvalResult:
    """The numbers of a set of decoded prompts (``checked``: each was compared with plain greedy;
    ``n_drafts``: the drafts a block holds, block - 1, or the block for a drafter that drafts from its
    anchor slot)."""
    hist = [0] * (n_drafts + 1)
    accepted = [a for r in runs for a in r.spec.accepted]
    for a in accepted:
        hist[a] += 1
    rounds = len(accepted)
    tokens = sum(len(r.spec.tokens) for r in runs)
    spec_fwd = sum(r.spec.target_forwards for r in runs)
    divergences = [r.divergence for r in runs if r.divergence is not None]
    mismatched = [d.prompt for d in divergences if not d.near_tie]
    per_prompt = [sum(r.spec.acceptance_lengths) / len(r.spec.accepted) for r in runs]
    return EvalResult(
        tau=(sum(accepted) + rounds) / rounds,
        acceptance_length=sum(per_prompt) / len(per_prompt),
        rounds=rounds,
        tokens_generated=tokens,
        target_forwards=spec_fwd,
        baseline_forwards=tokens,
        forwards_saved=tokens - spec_fwd,
        acceptance_histogram=hist,
        per_position_acceptance=[sum(a > k for a in accepted) / rounds for k in range(n_drafts)],
        lossless=(not mismatched) if checked else None,
        mismatched_prompts=mismatched,
        near_tie_prompts=[d.prompt for d in divergences if d.near_tie],
        exact_prompts=len(runs) - len(divergences) if checked else 0,
        near_ties=sum(d.near_tie for d in divergences),
        divergences=[asdict(d) for d in divergences],
        num_prompts=len(runs),
        block_size=block_size,
        max_new_tokens=max_new_tokens,
        per_prompt_tau=per_prompt,
        speculative_seconds=sum(r.seconds for r in runs),
        greedy_seconds=sum(r.greedy_seconds for r in runs),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        confidence_threshold=confidence_threshold,
        mean_verified=sum(v for r in runs for v in r.spec.verified) / rounds,
    )


def evaluate(
    drafter: DFlashDrafter,
    target: HFTarget,
    prompts: list[list[int]],
    max_new_tokens: int = 128,
    stop_token_ids: list[int] | None = None,
    check_lossless: bool = True,
    block_size: int | None = None,
    on_prompt: Callable[[int, int], None] | None = None,
    sampling: Sampling | None = None,
    confidence_threshold: float | None = None,
) -> EvalResult:
    """Speculative decode of every prompt (and, with ``check_lossless``, a plain greedy decode to
    compare against). Stops at the target's EOS ids unless ``stop_token_ids`` is given.

    With ``sampling`` at a temperature the decodes are sampled; a sampled output has no single right
    answer to compare with, so ``lossless`` is None (rejection sampling is what makes them lossless,
    shown in distribution by tests/test_eval_sampling.py).

    The drafter stays where it is (device, dtype; its train/eval mode is restored afterwards), so a
    trainer can evaluate its live drafter between steps. ``on_prompt(done, total)`` is called after
    each prompt, so a caller can show how far a long evaluation is.
    """
    if not prompts:
        raise ValueError("no prompts to evaluate")
    sampling, check_lossless, stops, bs = eval_settings(drafter, target, sampling, check_lossless, stop_token_ids,
                                                        block_size)
    runs = []
    with eval_mode(drafter):
        for i, prompt in enumerate(prompts):
            runs.append(decode_prompt(drafter, target, i, prompt, max_new_tokens, stops, bs, sampling, check_lossless,
                                     confidence_threshold))
            if on_prompt is not None:
                on_prompt(i + 1, len(prompts))
    return summarize(runs, bs, drafts_per_block(drafter, bs), max_new_tokens, sampling, check_lossless,
                     confidence_threshold)


def eval_settings(drafter: DFlashDrafter, target: HFTarget, sampling: Sampling | None, check_lossless: bool,
                  stop_token_ids: list[int] | None, block_size: int | None) -> tuple:
    """(sampling, whether to check losslessness, stop ids, block) for an evaluation, the pair checked
    to belong together: the check only runs greedy, the stops are the target's unless given."""
    if not isinstance(drafter, DFlashDrafter) or not isinstance(target, HFTarget):
        raise TypeError("call evaluate(drafter, target, prompts, ...)")
    check_compatible(drafter, target)
    sampling = sampling or Sampling()
    stops = target.stop_token_ids() if stop_token_ids is None else stop_token_ids
    return sampling, check_lossless and sampling.greedy, stops, block_size or drafter.config.block_size


@contextmanager
def eval_mode(drafter: DFlashDrafter):
    """The drafter in eval mode for the block, its train/eval mode given back afterwards."""
    was_training = drafter.training
    drafter.eval()
    try:
        yield drafter
    finally:
        drafter.train(was_training)
