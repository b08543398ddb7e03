"""Speculative sampling is lossless in distribution: at a temperature (with top-k) the first tokens of
many seeded speculative decodes are distributed as the target's own sampling, for a DFlash, a DFlash2 and
a DSpark drafter; the same test rejects a sampler that is biased in the classic way (at a rejection it draws
from the target's distribution instead of the residual). Plus the sampling pieces on small cases."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_model_helpers import make_target_dir, one_thread  # noqa: F401 (autouse fixture)

from dflash.cli import main
from dflash.eval import speculative
from dflash.eval.sampling import draw, rejection_sample, sampling_probs
from dflash.eval.speculative import Sampling, evaluate
from dflash.targets import load_target
from dflash.testing import (
    SAMPLING_PROMPT,
    SAMPLING_SAMPLES,
    SAMPLING_TEMPERATURE,
    SAMPLING_TOKENS,
    SAMPLING_TOP_K,
    chi_square,
    exact_continuations,
    sampling_drafter,
    speculative_counts,
)

VOCAB = 8
TEMPERATURE, TOP_K, SAMPLES = SAMPLING_TEMPERATURE, SAMPLING_TOP_K, SAMPLING_SAMPLES
PROMPT = SAMPLING_PROMPT


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(make_target_dir(tmp_path_factory.mktemp("sampling") / "t", layers=2, vocab=VOCAB),
                       layer_ids=[0, 1])


drafter = sampling_drafter
exact = exact_continuations


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark"])
def test_speculative_sampling_is_distributed_as_the_targets_own(target, kind):
    expected = exact(target)
    assert max(expected.values()) < 0.5 and len(expected) == TOP_K ** SAMPLING_TOKENS  # a spread, not one answer
    counts, accepted = speculative_counts(drafter(target, kind), target)
    assert any(accepted) and not all(accepted)  # drafts were kept and rejected: both paths ran
    stat, critical = chi_square(counts, expected, SAMPLES)
    assert stat < critical, (stat, critical)


def _biased(drafts, target_probs, draft_probs, draft_indices=None, generator=None):
    """The classic mistake: at the first rejection, draw from the target's distribution rather than the
    residual max(0, p - q) (which over-weighs the tokens the drafter also proposes)."""
    n = drafts.shape[0]
    p = target_probs[:n].gather(-1, drafts[:, None])[:, 0]
    dense = draft_probs if draft_indices is None else \
        torch.zeros_like(target_probs[:n]).scatter_add_(-1, draft_indices, draft_probs)
    q = dense.gather(-1, drafts[:, None])[:, 0]
    kept = int((torch.rand(n, generator=generator) * q < p).int().cumprod(0).sum())
    return kept, int(draw(target_probs[kept], generator))


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "dspark"])
def test_the_same_test_rejects_a_biased_sampler(target, kind, monkeypatch):
    monkeypatch.setattr(speculative, "rejection_sample", _biased)
    counts, _ = speculative_counts(drafter(target, kind), target)
    stat, critical = chi_square(counts, exact(target), SAMPLES)
    assert stat > critical, (stat, critical)


def test_sampling_probabilities_cut_as_the_reference_does():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0])
    p = sampling_probs(logits, 1.0)
    torch.testing.assert_close(p, torch.softmax(logits, -1))
    top2 = sampling_probs(logits, 1.0, top_k=2)  # tokens 4 and 0, renormalised
    e = math.exp(1.0)
    torch.testing.assert_close(top2, torch.tensor([1 / (1 + e), 0, 0, 0, e / (1 + e)]))
    # top-p keeps the likeliest tokens until their mass reaches p, the one that crosses included
    full = torch.softmax(logits, -1)
    nucleus = sampling_probs(logits, 1.0, top_p=0.7)
    kept = full[[4, 0]]
    assert full[4] < 0.7 <= full[4] + full[0]
    torch.testing.assert_close(nucleus[[4, 0]], kept / kept.sum())
    assert nucleus[[1, 2, 3]].sum() == 0
    torch.testing.assert_close(sampling_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))


def test_rejection_sampling_on_cases_worked_by_hand():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    # a draft the target gives probability 0 is always rejected, and the residual then excludes it
    for _ in range(20):
        kept, tok = rejection_sample(torch.tensor([2, 1]), p, torch.tensor([[0.0, 0.0, 1.0], [0, 1.0, 0]]), None, g)
        assert kept == 0 and tok in (0, 1)
    # q equal to p: always kept, then the bonus from the last row
    assert rejection_sample(torch.tensor([0, 1]), p, p[:2], None, g) == (2, 2)
    # DFlash2's q over candidates: [0.25 on token 1, 0.75 on token 0] at slot 1
    q, cands = torch.tensor([[0.75, 0.25]]), torch.tensor([[0, 1]])
    kept = [rejection_sample(torch.tensor([0]), p[1:], q, cands, g)[0] for _ in range(2000)]
    assert sum(kept) == 0  # the target gives token 0 no chance after this prefix
    wins = [rejection_sample(torch.tensor([1]), p[:2], q, cands, g) for _ in range(2000)]
    # token 1 drafted with q 0.25, target 0.5: always kept
    assert all(k == 1 for k, _ in wins)


def test_greedy_dflash2_decoding_is_lossless_and_sampled_eval_reports_its_settings(target):
    d = drafter(target, "dflash2")
    greedy = evaluate(d, target, [PROMPT, [4, 4, 2]], max_new_tokens=12, stop_token_ids=[])
    assert greedy.lossless is True and greedy.temperature == 0
    sampled = evaluate(d, target, [PROMPT], max_new_tokens=12, stop_token_ids=[],
                       sampling=Sampling(0.7, 0.9, 0, torch.Generator().manual_seed(1)))
    assert sampled.lossless is None and (sampled.temperature, sampled.top_p) == (0.7, 0.9)


@pytest.mark.parametrize(("flags", "says"), [
    (["--temperature", "-1"], "--temperature must be 0 (greedy) or more, got -1.0"),
    (["--temperature", "1", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--temperature", "1", "--top-k", "-2"], "--top-k must be 0 (no cut) or more, got -2"),
    (["--top-k", "5"], "--top-p and --top-k cut the distribution a temperature samples from"),
])
def test_bad_sampling_flags_are_one_line(capsys, flags, says):
    assert main(["eval", "--drafter", "nowhere", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_every_continuation_is_counted_once():
    """The exact distribution sums to one (the test's own yardstick)."""
    cells = list(itertools.product(range(2), repeat=2))
    stat, critical = chi_square(dict.fromkeys(cells, 25), dict.fromkeys(cells, 0.25), 100)
    assert stat == 0 and critical > 0
