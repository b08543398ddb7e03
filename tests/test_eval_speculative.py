"""Speculative decoding must be lossless: token for token the target's own greedy output, whether the
drafter is untrained (tau ~ 1) or trained so that many drafts are accepted (real modules throughout);
every round drafts a full block and is counted as the reference benchmark counts it; a divergence that
rounding decided (a near-tie) is told apart from a real one."""

from __future__ import annotations

import pytest
import torch
from test_model_helpers import make_target_dir, one_thread  # noqa: F401

from dflash.eval import speculative
from dflash.eval.speculative import classify_divergence, evaluate, greedy_generate, speculative_generate
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.objectives import build
from dflash.targets import load_target
from dflash.train.config import ObjectiveSettings

BLOCK = 8


def prompts_for(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (length,), generator=g).tolist() for _ in range(n)]


def new_drafter(target, layers: int = 2, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.config, num_layers=layers, block_size=BLOCK,
                                   target_layer_ids=target.layer_ids, mask_token_id=target.default_mask_token_id())
    return DFlashDrafter(cfg)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_targets")
    return {arch: load_target(make_target_dir(root / arch, arch, layers=4), num_draft_layers=2)
            for arch in ("qwen3", "llama")}


@pytest.fixture(scope="module")
def trained(targets):
    """A drafter trained briefly on the Qwen3 target's own greedy continuations (the DFlash recipe:
    train on target-written responses), so that real decoding accepts many drafts."""
    target = targets["qwen3"]
    prompts = prompts_for(8, 6, seed=1)
    seqs = [p + greedy_generate(target, p, 42, stop_token_ids=[]) for p in prompts]
    ids = torch.tensor(seqs)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:, 6:] = True
    hidden = target.tap_states(ids)
    drafter = new_drafter(target)
    opt = torch.optim.AdamW(drafter.parameters(), lr=5e-3)
    g = torch.Generator().manual_seed(0)
    objective = build(ObjectiveSettings(), drafter.config.gamma)
    for _ in range(60):
        out = objective.on_batch(drafter, target.embed_tokens, target.lm_head, ids, hidden, loss_mask,
                                 num_anchors=8, generator=g)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    drafter.eval()
    return drafter, prompts, out


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_untrained_drafter_is_lossless_with_tau_about_one(targets, arch):
    target = targets[arch]
    drafter = new_drafter(target)
    prompts = prompts_for(3, 7, seed=2)
    r = evaluate(drafter, target, prompts, max_new_tokens=24, stop_token_ids=[])
    assert r.lossless is True and r.mismatched_prompts == []
    assert r.tokens_generated == 3 * 24
    assert 1.0 <= r.tau < 1.5
    assert sum(r.acceptance_histogram) == r.rounds and len(r.acceptance_histogram) == BLOCK
    assert r.target_forwards == 3 + r.rounds  # one prefill per prompt, one verify per round
    assert r.baseline_forwards == r.tokens_generated
    assert r.forwards_saved == r.baseline_forwards - r.target_forwards
    assert len(r.per_position_acceptance) == BLOCK - 1


def test_trained_drafter_accepts_many_drafts_and_stays_lossless(targets, trained):
    target = targets["qwen3"]
    drafter, prompts, last = trained
    assert last.accuracy > 0.5 and last.sim_tau > 2.0
    r = evaluate(drafter, target, prompts[:6], max_new_tokens=40, stop_token_ids=[])
    assert r.lossless is True
    assert r.tau > 2.0, r
    assert r.forwards_saved > 0
    acc = r.per_position_acceptance
    assert acc[0] >= acc[-1] and acc[0] > 0.5  # earlier slots are accepted at least as often
    # tau is consistent with the histogram when no round is cut short
    assert r.tokens_generated == 6 * 40


def test_output_equals_greedy_token_for_token_across_limits_and_blocks(targets, trained):
    target = targets["qwen3"]
    drafter, prompts, _ = trained
    prompt = prompts[2]
    ref = greedy_generate(target, prompt, 30, stop_token_ids=[])
    for n in (1, 2, 8, 9, 30):  # limits that cut rounds short at different slots
        for bs in (2, 5, BLOCK):
            out = speculative_generate(drafter, target, prompt, n, stop_token_ids=[], block_size=bs)
            assert out.tokens == ref[:n], (n, bs)
            assert sum(out.produced) == n - 1 and out.target_forwards == 1 + len(out.accepted)
            assert all(0 <= a < bs for a in out.accepted)
            assert len(out.produced) == len(out.accepted) and out.acceptance_lengths == [a + 1 for a in out.accepted]


def reference_rounds(accepted: list[int], max_new_tokens: int) -> int:
    """Rounds the reference benchmark's loop runs: while the newest token (the first one came from the
    prefill) is inside the budget, i.e. until more than max_new_tokens tokens exist."""
    have, rounds = 1, 0
    while have <= max_new_tokens:
        have += accepted[rounds] + 1
        rounds += 1
    return rounds


def test_budget_ending_mid_block_still_drafts_and_counts_full_blocks(targets, trained):
    """The rounds of a decode whose budget ends inside a block are those of a longer decode, cut: the
    last block is drafted and verified whole (a shorter block changes the drafter's guesses) and counted
    whole, as the reference's acceptance lengths are; only the output is cut."""
    target = targets["qwen3"]
    drafter, prompts, _ = trained
    cut_inside = 0
    for prompt in prompts[:4]:
        full = speculative_generate(drafter, target, prompt, 60, stop_token_ids=[])
        ref = greedy_generate(target, prompt, 60, stop_token_ids=[])
        assert full.tokens == ref
        ends, have = [], 1  # number of tokens after each round
        for a in full.accepted:
            have += a + 1
            ends.append(have)
        # budgets one short of a round's end (cutting its last accepted draft or its bonus), and exact ends
        budgets = [e - 2 for e, a in zip(ends, full.accepted, strict=True) if a >= 2 and 2 < e - 2 < 50]
        budgets += [e for e in ends if 2 < e < 50][:2]
        for n in budgets:
            out = speculative_generate(drafter, target, prompt, n, stop_token_ids=[])
            r = reference_rounds(full.accepted, n)
            assert out.accepted == full.accepted[:r], (n, out.accepted, full.accepted)
            assert out.tokens == ref[:n]
            assert sum(out.produced) == n - 1 and out.produced[-1] < full.accepted[r - 1] + 1
        cut_inside += sum(1 for e, a in zip(ends, full.accepted, strict=True) if a >= 2 and 2 < e - 2 < 50)
    assert cut_inside >= 3  # the trained drafter gives rounds long enough to end a budget inside them


def test_stop_token_inside_a_round_counts_the_round_whole(targets, trained):
    target = targets["qwen3"]
    drafter, prompts, _ = trained
    full = speculative_generate(drafter, target, prompts[1], 40, stop_token_ids=[])
    start = 1
    for a in full.accepted:  # a round whose accepted drafts include a token seen nowhere before
        new = full.tokens[start: start + a + 1]
        fresh = [t for t in new[:-1] if t not in full.tokens[:start]]
        if a >= 2 and fresh:
            break
        start += a + 1
    else:
        pytest.skip("no round with a fresh token among its accepted drafts")
    stop = fresh[0]
    out = speculative_generate(drafter, target, prompts[1], 40, stop_token_ids=[stop])
    rounds = len(out.accepted)
    assert out.tokens == full.tokens[: full.tokens.index(stop) + 1]
    assert out.accepted == full.accepted[:rounds] and out.produced[-1] < out.accepted[-1] + 1


def test_stop_tokens_end_both_decodes_at_the_same_place(targets, trained):
    target = targets["qwen3"]
    drafter, prompts, _ = trained
    prompt = prompts[0]
    ref = greedy_generate(target, prompt, 40, stop_token_ids=[])
    stop = ref[12]  # a token greedy decoding produces: both must stop at its first occurrence
    first = ref.index(stop)
    assert greedy_generate(target, prompt, 40, [stop]) == ref[: first + 1]
    assert speculative_generate(drafter, target, prompt, 40, [stop]).tokens == ref[: first + 1]


def test_evaluate_rejects_a_drafter_for_another_target(targets):
    drafter = new_drafter(targets["qwen3"])
    drafter.config.num_target_layers = 12
    with pytest.raises(ValueError, match="does not match the target"):
        evaluate(drafter, targets["qwen3"], [[5, 6, 7]], max_new_tokens=4)


def tie_last(logits: torch.Tensor) -> torch.Tensor:
    """argmax that breaks exact ties towards the highest id (torch's argmax takes the lowest): what
    rounding noise does to a near-tie between verification and one-token decoding."""
    return logits.shape[-1] - 1 - logits.flip(-1).argmax(-1)


def runner_up(logits: torch.Tensor) -> torch.Tensor:
    """A broken verification: the target's second choice."""
    return logits.topk(2, dim=-1).indices[..., 1]


@pytest.fixture()
def tied_target(tmp_path):
    """A real target whose LM head has two equal rows: token `low` (one greedy decoding produces) and a
    higher id `high`, so wherever `low` wins, `high` ties with it exactly."""
    target = load_target(make_target_dir(tmp_path / "t", "qwen3", layers=4), num_draft_layers=2)
    prompt = prompts_for(1, 7, seed=5)[0]
    ref = greedy_generate(target, prompt, 20, stop_token_ids=[])
    low = max(set(ref), key=ref.count)
    high = target.vocab_size - 2
    with torch.no_grad():
        target.lm_head.weight[high] = target.lm_head.weight[low]
    return target, prompt, low, high


def test_a_tie_broken_the_other_way_is_a_near_tie_not_a_loss(tied_target, monkeypatch):
    target, prompt, low, high = tied_target
    drafter = new_drafter(target)
    assert evaluate(drafter, target, [prompt], max_new_tokens=20, stop_token_ids=[]).divergences == []
    monkeypatch.setattr(speculative, "_pick", tie_last)
    r = evaluate(drafter, target, [prompt], max_new_tokens=20, stop_token_ids=[])
    assert r.lossless is True and r.mismatched_prompts == [] and r.near_tie_prompts == [0]
    (d,) = r.divergences
    assert (d["speculative_token"], d["greedy_token"]) == (high, low)
    assert d["near_tie"] and d["logit_gap"] <= d["tolerance"]


def test_a_broken_verify_is_a_real_divergence(tied_target, monkeypatch):
    target, prompt, _, _ = tied_target
    monkeypatch.setattr(speculative, "_pick", runner_up)
    r = evaluate(new_drafter(target), target, [prompt, prompt[:4]], max_new_tokens=12, stop_token_ids=[])
    assert r.lossless is False and r.mismatched_prompts == [0, 1] and r.near_tie_prompts == []
    assert all(d["logit_gap"] > d["tolerance"] for d in r.divergences)


def test_classify_divergence_judges_the_first_difference(tied_target):
    target, prompt, low, high = tied_target
    ref = greedy_generate(target, prompt, 20, stop_token_ids=[])
    i = ref.index(low)
    assert classify_divergence(target, 0, prompt, ref, ref) is None
    tie = classify_divergence(target, 0, prompt, ref[:i] + [high, 5, 6], ref)
    assert tie.position == i and tie.near_tie
    other = next(t for t in range(target.vocab_size) if t not in (low, high))
    loss = classify_divergence(target, 0, prompt, ref[:i] + [other], ref)
    assert loss.position == i and not loss.near_tie and loss.logit_gap > loss.tolerance
    shorter = classify_divergence(target, 0, prompt, ref[:i], ref)  # one decode ended early: always real
    assert shorter.position == i and not shorter.near_tie and shorter.speculative_token is None
    # the tolerance is a few units in the last place of the logits' dtype
    assert speculative.tie_tolerance(torch.bfloat16, 20.0) > 100 * speculative.tie_tolerance(torch.float32, 20.0)
