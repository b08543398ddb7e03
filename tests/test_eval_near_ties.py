"""Lossless means lossless: a near-tie is forgiven only within the rounding bf16 was measured to show
between block verification and one-token decoding (TIE_ULPS, scripts/bench_tie_rounding.py), and is
counted apart from exact agreement in the result, the table and --json. A real bf16 target runs here."""

from __future__ import annotations

import pytest
import torch
from test_eval_speculative import new_drafter, prompts_for
from test_model_helpers import make_target_dir, one_thread  # noqa: F401

from dflash.eval import speculative
from dflash.eval.benchmarks import format_table
from dflash.eval.speculative import classify_divergence, evaluate, greedy_generate, lossless_label
from dflash.targets import load_target

EPS = torch.finfo(torch.bfloat16).eps


@pytest.fixture()
def bf16_pair(tmp_path):
    """A bf16 target and, at the first place greedy decoding emits token `low`, a token `high` whose LM
    head row is `low`'s scaled down so its logit there trails by ``3 eps |logit|``: beyond the measured
    bound (2), inside the 4 units the check used to forgive."""
    target = load_target(make_target_dir(tmp_path / "t", "qwen3", layers=4), dtype=torch.bfloat16,
                         num_draft_layers=2)
    prompt = prompts_for(1, 7, seed=5)[0]
    ref = greedy_generate(target, prompt, 20, stop_token_ids=[])
    low, high = ref[3], target.vocab_size - 2
    i = ref.index(low)
    ids = torch.tensor([prompt + ref[:i]])
    with torch.no_grad():
        logit = float(target.model(input_ids=ids, use_cache=False).logits[0, -1, low])
        assert logit > 1, "a positive greedy logit past 1, where the tolerance scales with it"
        target.lm_head.weight[high] = target.lm_head.weight[low] * (1 - 3 * EPS)
    return target, prompt, ref, i, low, high


def test_the_measured_bound_is_what_tie_tolerance_uses():
    assert speculative.TIE_ULPS == 2
    assert speculative.tie_tolerance(torch.bfloat16, 20.0) == pytest.approx(2 * EPS * 20)  # 0.31, was 0.62
    assert speculative.tie_tolerance(torch.bfloat16, 0.1) == pytest.approx(2 * EPS)  # |logit| < 1 counts as 1


def test_a_runner_up_beyond_the_measured_bound_is_not_a_near_tie(bf16_pair):
    target, prompt, ref, i, low, high = bf16_pair
    d = classify_divergence(target, 0, prompt, ref[:i] + [high], ref)
    scale = d.tolerance / (2 * EPS)
    assert d.greedy_token == low and d.speculative_token == high
    assert d.logit_gap > d.tolerance and not d.near_tie
    assert d.logit_gap <= 4 * EPS * scale  # the old 4-unit rule would have called this rounding


def test_evaluate_calls_that_verifier_not_lossless(bf16_pair, monkeypatch):
    """A verifier that prefers `high` wherever `low` wins picks a runner-up rounding cannot explain."""
    target, prompt, _, _, low, high = bf16_pair

    def prefer_high(logits):
        top = logits.argmax(-1)
        return torch.where(top == low, torch.full_like(top, high), top)

    monkeypatch.setattr(speculative, "_pick", prefer_high)
    r = evaluate(new_drafter(target).to(torch.bfloat16), target, [prompt], max_new_tokens=20, stop_token_ids=[])
    assert r.lossless is False and r.mismatched_prompts == [0] and r.near_ties == 0 and r.exact_prompts == 0
    assert lossless_label(r.lossless, r.near_ties) == "NO"


def test_near_ties_are_counted_apart_from_exact_agreement(tmp_path, monkeypatch):
    """An exact tie broken the other way is forgiven, but the result says so: not "yes"."""
    target = load_target(make_target_dir(tmp_path / "t", "qwen3", layers=4), num_draft_layers=2)
    prompts = prompts_for(2, 7, seed=5)
    ref = greedy_generate(target, prompts[0], 20, stop_token_ids=[])
    low = max(set(ref), key=ref.count)
    high = target.vocab_size - 2
    with torch.no_grad():
        target.lm_head.weight[high] = target.lm_head.weight[low]
    monkeypatch.setattr(speculative, "_pick", lambda logits: logits.shape[-1] - 1 - logits.flip(-1).argmax(-1))
    r = evaluate(new_drafter(target), target, prompts, max_new_tokens=20, stop_token_ids=[])
    assert r.lossless is True and r.near_ties >= 1 and r.exact_prompts == 2 - r.near_ties
    d = r.to_dict()
    assert d["near_ties"] == r.near_ties and d["exact_prompts"] == r.exact_prompts
    assert lossless_label(r.lossless, r.near_ties) == f"near-tie {r.near_ties}"
    table = format_table({"gsm8k": d}, {})
    assert f"near-tie {r.near_ties}" in table.splitlines()[1] and " yes" not in table.splitlines()[1]
    assert lossless_label(True, 0) == "yes" and lossless_label(None) == "-"
