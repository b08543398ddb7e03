"""The DFlash2 selector's loss on small cases worked by hand: teacher-forced predecessors, the K-way
cross-entropy over the unary top-k where the gold token is a candidate, the position decay, the ramp,
chunking, and the term in the objective (its recall and accuracy carried to the step's metrics). Its
unary scores from the candidates' K columns of the head, the candidates from the token term's chunks,
equal the full head's (value and gradients, fp32), under either position weighting; and it still learns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_dflash2_model import BASE, dflash2
from test_model_blocks import B, H, V, batch
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash import objectives
from dflash.model.blocks import plan_blocks, predecessors
from dflash.model.dflash2 import CandidateSelector, DFlash2Config, DFlash2Drafter
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.objectives import Forward, Objective, Term, TermValue, for_drafter
from dflash.objectives.ce import CrossEntropy
from dflash.objectives.head import candidate_logits
from dflash.objectives.positions import DPace, ExpDecay
from dflash.objectives.selector import SelectorLoss, ramp_weight, selector_terms
from dflash.targets.heads import SoftCappedHead
from dflash.train.config import ObjectiveSettings
from dflash.train.device.metrics import StepMetrics


def test_each_slot_s_predecessor_is_the_datas_token_before_its_label():
    ids = torch.arange(100, 120).view(2, 10)  # token at (row r, position p) is 100 + 10 r + p
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    plan = plan_blocks(ids, loss_mask, 4, 2,
                       anchors=(torch.tensor([[0, 5], [2, 6]]), torch.ones(2, 2, dtype=torch.bool)))
    before = predecessors(ids, plan.anchors, plan.sel, plan.slot, 4)
    # labels x[a+1..a+3]; predecessors x[a..a+2] (the anchor's own token for slot 1)
    assert plan.labels.tolist() == [101, 102, 103, 106, 107, 108, 113, 114, 115, 117, 118, 119]
    assert before.tolist() == [100, 101, 102, 105, 106, 107, 112, 113, 114, 116, 117, 118]


def test_the_weight_ramps_in():
    assert [ramp_weight(p, 2.0, 0.1, 0.2) for p in (0.0, 0.099, 0.1, 0.2, 0.3, 0.9)] == \
        pytest.approx([0, 0, 0, 1.0, 2.0, 2.0])
    assert ramp_weight(0.5, 1.5, 0.5, 0.0) == 1.5 and ramp_weight(0.49, 1.5, 0.5, 0.0) == 0.0


def test_the_loss_on_a_case_worked_by_hand():
    """Vocabulary 4, top-2, rank 1, two slots. Slot 1: gold 2 is a candidate; slot 2: gold 0 is not."""
    cfg = DFlash2Config(**{**dict(hidden_size=2, intermediate_size=4, num_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, head_dim=2, vocab_size=4, num_target_layers=2,
                                  target_layer_ids=[0], mask_token_id=3, block_size=4),
                           "selector_rank": 1, "selector_top_k": 2, "conv_group_size": 1})
    sel = CandidateSelector(cfg).double()
    head = torch.nn.Linear(2, 4, bias=False).double().requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
        sel.hidden_projection.weight.copy_(torch.tensor([[1.0, 1.0]]))
        sel.predecessor_codebook.copy_(torch.tensor([[1.0], [0.5], [2.0], [0.0]]))
        sel.successor_codebook.copy_(torch.tensor([[0.0], [1.0], [-1.0], [0.0]]))
    h = torch.tensor([[2.0, 1.0], [1.0, 3.0]]).double()
    labels, before, weights = torch.tensor([2, 0]), torch.tensor([1, 2]), torch.tensor([1.0, 0.5]).double()
    num, counts = selector_terms(sel, head, h, labels, before, weights, torch.topk(head(h), 2).indices)
    # slot 1: logits [0, 2, 1, -3] -> candidates 1 (unary 2), 2 (unary 1); projected 3, context 0.5 * 3
    # scores: 2 + 1.5 * 1 = 3.5 and 1 + 1.5 * (-1) = -0.5; gold 2 is the second candidate
    ce = -math.log(math.exp(-0.5) / (math.exp(3.5) + math.exp(-0.5)))
    assert float(num.detach()) == pytest.approx(1.0 * ce)  # slot 2's gold is no candidate: it adds nothing
    assert counts.tolist() == [1.0, 0.0]  # covered 1 of 2; the best candidate (1) is not the gold one
    # the same by F.cross_entropy over the scores the selector computes
    unary, cands = sel.candidates(head(h).float())
    scores = sel.scores(sel.hidden_projection(h), before, unary, cands)
    assert float(F.cross_entropy(scores[:1].float(), torch.tensor([1]))) == pytest.approx(ce)


def test_chunks_give_the_same_loss_and_gradients():
    d = dflash2()
    sel, head = d.candidate_selector, torch.nn.Linear(H, V, bias=False).double().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, H, generator=g).double().requires_grad_(True)
    labels, before = torch.randint(0, V, (23,), generator=g), torch.randint(0, V, (23,), generator=g)
    labels = torch.where(torch.arange(23) % 3 == 0, labels, head(h).argmax(-1))  # most gold tokens candidates
    w = torch.rand(23, generator=g).double()
    candidates = torch.topk(head(h), sel.top_k).indices
    whole, c1 = selector_terms(sel, head, h, labels, before, w, candidates, chunk=1000)
    grads = torch.autograd.grad(whole, [h, sel.successor_codebook])
    chunked, c2 = selector_terms(sel, head, h, labels, before, w, candidates, chunk=5)
    grads2 = torch.autograd.grad(chunked, [h, sel.successor_codebook])
    torch.testing.assert_close(chunked, whole)
    assert c1.tolist() == c2.tolist() and c1[0] >= 15
    for a, b in zip(grads, grads2, strict=True):
        torch.testing.assert_close(a, b)


def test_the_term_in_the_objective_weighs_ramps_and_reports_recall_and_accuracy():
    d = dflash2()
    embed = torch.nn.Embedding(V, H).double().requires_grad_(False)
    head = torch.nn.Linear(H, V, bias=False).double().requires_grad_(False)
    ids, hidden = batch()
    plan = plan_blocks(ids, torch.ones_like(ids, dtype=torch.bool), B, 4, torch.Generator().manual_seed(0))
    objective = for_drafter(ObjectiveSettings(selector_loss_weight=2.0, selector_warmup=0.5, selector_ramp=0.25), d)
    assert objective.term_names == ("ce", "selector")
    assert objective.metric_names == ("selector_recall", "selector_accuracy")
    selector_term = objective.terms[1]
    for progress, weight in [(0.1, 0.0), (0.625, 1.0), (0.9, 2.0)]:
        selector_term.at(progress)
        out = objective(d, embed, head, ids, hidden, plan)
        terms, measured = out.terms(), out.term_metrics()
        assert float(out.loss) == pytest.approx(terms["ce"] + weight * terms["selector"])
        assert 0 < measured["selector_recall"] <= 1 and 0 <= measured["selector_accuracy"] <= 1
    # the step's metrics sum and name them
    metrics = StepMetrics()
    for _ in range(2):
        metrics.add(out.stats, torch.tensor(1.0), out.per_position_count, out.num_blocks, out.term_names,
                    out.metric_names)
    summary = metrics.collect().summary()
    assert summary["measured"] == pytest.approx(out.term_metrics())


def test_at_the_start_only_the_successor_codebook_learns():
    """A zero successor codebook: its gradient is predecessor x projection (not zero), the other two
    factors' is zero until it moves (the peers' start)."""
    torch.manual_seed(0)
    d = DFlash2Drafter(DFlash2Config(**BASE)).double()
    embed = torch.nn.Embedding(V, H).double().requires_grad_(False)
    head = torch.nn.Linear(H, V, bias=False).double().requires_grad_(False)
    ids, hidden = batch()
    plan = plan_blocks(ids, torch.ones_like(ids, dtype=torch.bool), B, 4, torch.Generator().manual_seed(0))
    objective = for_drafter(ObjectiveSettings(selector_ramp=0.0), d)
    objective.terms[1].at(1.0)
    objective(d, embed, head, ids, hidden, plan).loss.backward()
    sel = d.candidate_selector
    assert sel.successor_codebook.grad.abs().sum() > 0
    assert sel.predecessor_codebook.grad.abs().sum() == 0 and sel.hidden_projection.weight.grad.abs().sum() == 0


def full_head_selector(sel, head, h, labels, before, weights):
    """The selector's weighted loss sum the plain way, as the term computed it before it read the token
    pass's candidates: the whole head over every row, its top-k, the scores, the K-way cross-entropy."""
    unary, cands = sel.candidates(head(h).float())
    scores = sel.scores(sel.hidden_projection(h), before, unary, cands).float()
    match = cands == labels[:, None]
    ce = F.cross_entropy(scores, match.int().argmax(-1), reduction="none")
    return (ce * weights * match.any(-1)).sum()


@pytest.mark.parametrize("cap", [None, 2.0])
def test_the_candidates_columns_give_the_full_heads_loss_and_gradients(cap):
    """fp32, 40 rows in chunks of 7 (checkpointed): the value and the gradients with respect to the states
    and every selector parameter equal the full head's, soft-capped head or not."""
    d = dflash2().float()
    sel = d.candidate_selector
    torch.manual_seed(1)
    linear = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    head = linear if cap is None else SoftCappedHead(linear, cap)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(40, H, generator=g).requires_grad_(True)
    before = torch.randint(0, V, (40,), generator=g)
    top = torch.topk(head(h), sel.top_k).indices
    labels = torch.where(torch.arange(40) % 4 == 0, torch.randint(0, V, (40,), generator=g), top[:, 2])
    w = torch.rand(40, generator=g)
    params = [h, *sel.parameters()]
    ours, counts = selector_terms(sel, head, h, labels, before, w, top.clone(), chunk=7)
    theirs = full_head_selector(sel, head, h, labels, before, w)
    assert counts[0] >= 30 and float(theirs) > 0
    torch.testing.assert_close(ours, theirs)
    for a, b in zip(torch.autograd.grad(ours, params), torch.autograd.grad(theirs, params), strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(candidate_logits(head, h, top), head(h).gather(1, top))


def test_candidate_logits_refuse_a_head_they_cannot_read_in_one_line():
    with pytest.raises(ValueError, match="bias-free linear map .* not Linear"):
        candidate_logits(torch.nn.Linear(H, V), torch.randn(2, H), torch.zeros(2, 3, dtype=torch.long))


class _Capture(Term):
    """Keeps the pass's Forward (after the token and selector terms ran) and adds nothing."""

    name = "capture"

    def __call__(self, fwd: Forward) -> TermValue:
        self.fwd = fwd
        return TermValue(fwd.h.sum() * 0.0)


@pytest.mark.parametrize("weighting", ["exp", "dpace"])
def test_the_term_reads_the_token_passs_candidates_and_weights(monkeypatch, weighting):
    """Through the objective, fp32, in chunks of a few rows: the candidates are the head's top-k of each
    slot, the weights are the token term's (D-PACE's too, over its denominator), and the term's value and
    gradients on every drafter parameter equal the full head's over those weights."""
    monkeypatch.setattr(objectives.head, "CHUNK_BYTES", 4 * V * 9)
    monkeypatch.setattr(objectives.head, "MIN_CHUNK", 1)
    d = dflash2().float()
    embed = torch.nn.Embedding(V, H).requires_grad_(False)
    head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    ids, hidden = batch()
    plan = plan_blocks(ids, torch.ones_like(ids, dtype=torch.bool), B, 4, torch.Generator().manual_seed(0))
    position = ExpDecay(d.config.gamma) if weighting == "exp" else DPace(0.3)
    capture = _Capture()
    out = Objective([CrossEntropy(position), SelectorLoss(1.0), capture])(d, embed, head, ids, hidden.float(), plan)
    fwd = capture.fwd
    assert fwd.selector is d.candidate_selector
    torch.testing.assert_close(fwd.candidates, torch.topk(head(fwd.h), 5).indices)
    confidence = torch.softmax(head(fwd.h).float(), -1).gather(1, plan.labels[:, None])[:, 0].detach()
    w, den = position(plan, B, confidence)
    torch.testing.assert_close(fwd.position_weights[0], w)
    assert float(fwd.position_weights[1]) == pytest.approx(float(den))
    before = predecessors(ids, plan.anchors, plan.sel, plan.slot, B)
    theirs = full_head_selector(d.candidate_selector, head, fwd.h, plan.labels, before, w) / den
    assert out.terms()["selector"] == pytest.approx(float(theirs), rel=1e-5)
    ours = SelectorLoss(1.0)(fwd).value
    params = [p for p in d.parameters() if p.requires_grad]
    mine = torch.autograd.grad(ours, params, retain_graph=True, allow_unused=True)
    reference = torch.autograd.grad(theirs, params, allow_unused=True)
    for a, b in zip(mine, reference, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
    if weighting == "dpace":  # on the token term's scale: not the exponential decay's
        exp_w, exp_den = ExpDecay(d.config.gamma)(plan, B, None)
        other = full_head_selector(d.candidate_selector, head, fwd.h, plan.labels, before, exp_w) / exp_den
        assert abs(float(other) - float(theirs)) > 1e-3


def test_a_drafter_without_a_selector_is_refused_in_one_line():
    torch.manual_seed(0)
    cfg = DrafterConfig(**{k: v for k, v in BASE.items()})
    ids, hidden = batch()
    plan = plan_blocks(ids, torch.ones_like(ids, dtype=torch.bool), B, 4, torch.Generator().manual_seed(0))
    objective = Objective([CrossEntropy(ExpDecay(4.0)), SelectorLoss(1.0)])
    with pytest.raises(ValueError, match="needs a drafter with a candidate selector"):
        objective(DFlashDrafter(cfg).double(), torch.nn.Embedding(V, H).double(),
                  torch.nn.Linear(H, V, bias=False).double().requires_grad_(False), ids, hidden, plan)


def _train(d, objective, params, steps=25):
    """(selector loss, recall, accuracy) of each of ``steps`` AdamW steps over ``params`` on one batch."""
    embed = torch.nn.Embedding(V, H).double().requires_grad_(False)
    torch.manual_seed(1)
    head = torch.nn.Linear(H, V, bias=False).double().requires_grad_(False)
    ids, hidden = batch()
    plan = plan_blocks(ids, torch.ones_like(ids, dtype=torch.bool), B, 6, torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(params, lr=3e-2)
    seen = []
    for _ in range(steps):
        out = objective(d, embed, head, ids, hidden, plan)
        measured = out.term_metrics()
        seen.append((out.terms()["selector"], measured["selector_recall"], measured["selector_accuracy"]))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return seen


def test_dflash2_still_learns_its_selector():
    """AdamW steps on one batch, the selector at full weight. The whole drafter: the gold tokens come
    among the candidates and the selector picks them. The selector alone (the states fixed): its loss
    falls and it ranks better than the unary logits it starts from (the gradient through the candidates'
    columns and the codebooks trains it)."""
    d = dflash2(scramble=False)
    objective = for_drafter(ObjectiveSettings(selector_ramp=0.0), d)
    objective.terms[1].at(1.0)
    seen = _train(d, objective, d.parameters())
    assert seen[0][1] < 0.3 and seen[-1][1] > 0.9 and seen[-1][2] > 0.9, seen
    d = dflash2(scramble=False, selector_top_k=20)  # candidates enough that many gold tokens are among them
    seen = _train(d, for_drafter(ObjectiveSettings(selector_ramp=0.0), d), d.candidate_selector.parameters())
    (first, recall, accuracy), (last, recall_after, accuracy_after) = seen[0], seen[-1]
    assert recall_after == recall and last < 0.25 * first and accuracy_after > accuracy + 0.2, seen
