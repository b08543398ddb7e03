"""The objective's seam: each term's value and gradient against a direct computation, D-PACE against a
hand-computed block, extra terms from the drafter's forward, the registry's refusals, and the optimizers
(Muon as torch steps it, the non-finite skip, which parameters it takes)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash import objectives
from dflash.model.blocks import plan_blocks
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.objectives import TERMS, Forward, Term, TermValue, build
from dflash.objectives.head import head_rows
from dflash.objectives.optim import GuardedMuon, Optimizers, build_optimizer, split_for_muon
from dflash.objectives.positions import dpace_grid, exp_weights
from dflash.targets.heads import NormedHead
from dflash.train.config import ConfigError, ObjectiveSettings, OptimSettings
from dflash.train.config.schema import make_config

H, V, T, B = 16, 40, 24, 5


def case(seed: int = 0):
    """Two sequences, hand-placed anchors (one padded), a response mask that leaves some slots out, and
    drafter rows h [S, H] standing in for the drafter's output at the supervised slots."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, T), generator=g)
    loss_mask = torch.ones(2, T, dtype=torch.bool)
    loss_mask[1, 14:] = False  # the second response ends at 13
    anchors = torch.tensor([[2, 9, 15], [4, 11, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    plan = plan_blocks(ids, loss_mask, B, 3, anchors=(anchors, keep))
    h = torch.randn(plan.num_tokens, H, generator=g, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(seed)  # the head's init: the same case whatever ran before (a shifted reading must differ)
    head = torch.nn.Linear(H, V, bias=False).double().requires_grad_(False)
    return ids, loss_mask, anchors, keep, plan, h, head


def forward(plan, h, head, verifier=None, verifier_head=None) -> Forward:
    return Forward(hidden=h.new_zeros(0), h=h, plan=plan, lm_head=head, block_size=B, verifier=verifier,
                   verifier_head=verifier_head)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few rows, so every test also crosses chunk boundaries."""
    monkeypatch.setattr(objectives.head, "CHUNK_BYTES", 4 * V * 3)
    monkeypatch.setattr(objectives.head, "MIN_CHUNK", 1)


def slots_of(anchors, keep, loss_mask):
    """(batch row, anchor, k) of every supervised slot, in the plan's order (block by block, k rising)."""
    out = []
    for b in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            a = int(anchors[b, n])
            out += [(b, a, k) for k in range(1, B) if keep[b, n] and loss_mask[b, a + k]]
    return out


def test_ce_with_exp_weights_value_and_gradient_equal_the_direct_computation(small_chunks):
    ids, loss_mask, anchors, keep, plan, h, head = case()
    gamma = 3.0
    term = build(ObjectiveSettings(loss="ce", position_weight="exp"), gamma).token_term
    out = term(forward(plan, h, head))
    (grad,) = torch.autograd.grad(out.value, h)

    slots = slots_of(anchors, keep, loss_mask)
    assert len(slots) == plan.num_tokens == h.shape[0]
    h2 = h.detach().clone().requires_grad_(True)
    logits = head(h2)
    labels = torch.tensor([int(ids[b, a + k]) for b, a, k in slots])
    w = torch.tensor([math.exp(-(k - 1) / gamma) for _, _, k in slots], dtype=torch.float64)
    ref = (F.cross_entropy(logits, labels, reduction="none") * w).sum() / w.sum()
    ref.backward()
    assert out.value.item() == pytest.approx(ref.item(), rel=1e-6)  # the head's logits run in float32
    torch.testing.assert_close(grad, h2.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(out.pred, logits.argmax(-1))


def test_kl_reads_the_verifier_at_the_position_before_each_label(small_chunks):
    """Slot k of the block at anchor a learns the verifier's distribution at a + k - 1; value and
    gradient against a direct computation through the verifier's norm and head."""
    ids, loss_mask, anchors, keep, plan, h, head = case(1)
    g = torch.Generator().manual_seed(7)
    verifier = torch.randn(2, T, H, generator=g, dtype=torch.float64)
    norm = torch.nn.RMSNorm(H, eps=1e-6).double().requires_grad_(False)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    vhead = NormedHead(norm, head)
    term = build(ObjectiveSettings(loss="kl"), 4.0).token_term
    out = term(forward(plan, h, head, verifier, vhead))
    (grad,) = torch.autograd.grad(out.value, h)

    slots = slots_of(anchors, keep, loss_mask)
    h2 = h.detach().clone().requires_grad_(True)
    p = torch.softmax(head(norm(torch.stack([verifier[b, a + k - 1] for b, a, k in slots]))), -1)
    logq = torch.log_softmax(head(h2), -1)
    per = (p * (p.log() - logq)).sum(-1)
    w = torch.tensor([math.exp(-(k - 1) / 4.0) for _, _, k in slots], dtype=torch.float64)
    ref = (per * w).sum() / w.sum()
    ref.backward()
    assert out.value.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(grad, h2.grad, rtol=1e-4, atol=1e-7)
    # one position off would be another distribution: the test can fail
    shifted = torch.softmax(head(norm(torch.stack([verifier[b, a + k] for b, a, k in slots]))), -1)
    assert ((shifted * (shifted.log() - logq)).sum(-1) * w).sum().item() / w.sum().item() != pytest.approx(
        ref.item(), rel=1e-3)


def test_dpace_weights_of_a_hand_computed_block():
    """alpha 0.5, confidences 0.8 0.5 0.9 0.4: smoothed 0.9 0.75 0.95 0.7, prefix products 0.9 0.675
    0.64125 0.448875, each weight the sum of the prefix products from its slot on. A slot outside the
    response counts as certain in the products and weighs nothing."""
    q = torch.tensor([[0.8, 0.5, 0.9, 0.4], [0.8, 0.5, 0.9, 0.4]], dtype=torch.float64)
    supervised = torch.tensor([[True, True, True, True], [True, True, False, True]])
    w = dpace_grid(q, supervised, 0.5)
    torch.testing.assert_close(w[0], torch.tensor([2.665125, 1.765125, 1.090125, 0.448875], dtype=torch.float64))
    torch.testing.assert_close(w[1], torch.tensor([2.0475, 1.1475, 0.0, 0.4725], dtype=torch.float64))
    # alpha 1: every smoothed confidence is 1, slot k weighs the supervised slots from k on
    torch.testing.assert_close(dpace_grid(q, supervised, 1.0)[1], torch.tensor([3.0, 2.0, 0.0, 1.0],
                                                                                dtype=torch.float64))


def test_ce_with_dpace_value_and_gradient(small_chunks):
    """sum(w * CE) / (supervised slots), with w from the drafter's own (detached) confidence exp(-CE)."""
    ids, loss_mask, anchors, keep, plan, h, head = case(2)
    term = build(ObjectiveSettings(loss="ce", position_weight="dpace", dpace_alpha=0.5), 7.0).token_term
    out = term(forward(plan, h, head))
    (grad,) = torch.autograd.grad(out.value, h)

    slots = slots_of(anchors, keep, loss_mask)
    h2 = h.detach().clone().requires_grad_(True)
    labels = torch.tensor([int(ids[b, a + k]) for b, a, k in slots])
    ce = F.cross_entropy(head(h2), labels, reduction="none")
    conf = torch.exp(-ce.detach())
    # slot k's weight: over the block's supervised slots j >= k, the product of smoothed confidences up to j
    w = torch.tensor([sum(_prefix(slots, conf, j) for j, (b2, a2, k2) in enumerate(slots) if (b2, a2) == (b, a)
                          and k2 >= k) for b, a, k in slots], dtype=torch.float64)
    ref = (ce * w).sum() / len(slots)
    ref.backward()
    assert out.value.item() == pytest.approx(ref.item(), rel=1e-5)
    torch.testing.assert_close(grad, h2.grad, rtol=1e-4, atol=1e-7)


def _prefix(slots, conf, j):
    """The product of smoothed confidences of slot j's block from its first slot to j (alpha 0.5)."""
    b, a, k = slots[j]
    return math.prod(0.5 * conf[m].item() + 0.5 for m, s in enumerate(slots) if s[:2] == (b, a) and s[2] <= k)


def test_head_rows_gradient_equals_autograd_through_a_soft_capped_head(small_chunks):
    """The row gradients taken chunk by chunk, through any frozen head module (here a soft cap)."""
    from dflash.targets.heads import SoftCappedHead

    torch.manual_seed(3)
    head = SoftCappedHead(torch.nn.Linear(H, V, bias=False).double().requires_grad_(False), 2.0)
    h = torch.randn(9, H, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, V, (9,))
    coef = torch.rand(9, dtype=torch.float64)

    def loss(logits, rows, _ref):
        return F.cross_entropy(logits, y[rows], reduction="none"), {}

    value, _ = head_rows(head, h, loss)
    (value * coef).sum().backward()
    h2 = h.detach().clone().requires_grad_(True)
    (F.cross_entropy(head(h2).float(), y, reduction="none") * coef).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-5, atol=1e-8)


class TwoHeads(DFlashDrafter):
    """A drafter whose forward returns more than its states: the way a drafter with extra heads hands
    their outputs to the objective (here a made-up scalar head over the states)."""

    objective_terms = {"test_aux": 0.5}

    def __init__(self, cfg):
        super().__init__(cfg)
        self.aux = torch.nn.Linear(cfg.hidden_size, 1)

    def forward(self, *args, **kwargs):
        hidden = super().forward(*args, **kwargs)
        return {"hidden": hidden, "aux": self.aux(hidden)}


class AuxTerm(Term):
    name = "test_aux"

    def __call__(self, fwd: Forward) -> TermValue:
        return TermValue(fwd.extras["aux"].pow(2).mean())


def test_an_extra_term_reads_the_drafters_other_outputs_and_is_logged_apart(monkeypatch):
    monkeypatch.setitem(TERMS, "test_aux", AuxTerm)
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=32, num_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8, vocab_size=V, num_target_layers=4,
                        target_layer_ids=[1, 2], mask_token_id=V - 1, block_size=B)
    drafter = TwoHeads(cfg).double()
    embed = torch.nn.Embedding(V, H).double().requires_grad_(False)
    head = torch.nn.Linear(H, V, bias=False).double().requires_grad_(False)
    objective = objectives.for_drafter(ObjectiveSettings(), drafter)
    assert objective.term_names == ("ce", "test_aux") and objective.describe() == "ce + 0.5 x test_aux"
    ids = torch.randint(0, V - 1, (2, T))
    hidden = torch.randn(2, T, 2 * H, dtype=torch.float64)
    out = objective.on_batch(drafter, embed, head, ids, hidden, torch.ones(2, T, dtype=torch.bool), num_anchors=3,
                             generator=torch.Generator().manual_seed(0), attn_backend="sdpa")
    terms = out.terms()
    assert set(terms) == {"ce", "test_aux"} and terms["test_aux"] > 0
    assert out.loss.item() == pytest.approx(terms["ce"] + 0.5 * terms["test_aux"], rel=1e-6)
    out.loss.backward()
    assert drafter.aux.weight.grad is not None and drafter.aux.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("values, says", [
    ({"loss": "lk"}, "loss: unknown objective 'lk'; choose from ce, kl"),
    ({"position_weight": "linear"}, "position_weight: unknown weighting 'linear'; choose from dpace, exp"),
    ({"optimizer": "sgd"}, "optimizer: unknown optimizer 'sgd'; choose from adamw, muon"),
    ({"loss": "kl", "position_weight": "dpace"}, "--position-weight dpace weighs slots by the drafter's probability"),
    ({"dpace_alpha": 0.0}, "dpace_alpha must be in (0, 1], got 0.0"),
])
def test_unknown_names_are_refused_in_one_line(values, says):
    with pytest.raises(ConfigError) as e:
        make_config({**values, "max_steps": 1}, {})
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_an_unknown_loss_on_the_command_line_is_one_line(capsys, tmp_path):
    from dflash.cli import main

    assert main(["train", "--loss", "tv", "--max-steps", "1", "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err == "dflash train: error: loss: unknown objective 'tv'; choose from ce, kl\n"
    assert not (tmp_path / "r").exists()


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def test_guarded_muon_steps_as_torch_muon_and_skips_bit_for_bit():
    shapes = [(12, 20), (20, 12), (8, 8)]
    ours, theirs = _params(shapes), _params(shapes)
    kw = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    a, b = GuardedMuon(ours, **kw), torch.optim.Muon(theirs, **kw)
    a.float32_ns = False  # torch's own (bfloat16) iteration, as on a GPU
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        a.found_inf = torch.zeros(())
        a.step()
        b.step()
        for p, q in zip(ours, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    before = [(p.detach().clone(), a.state[p]["momentum_buffer"].clone()) for p in ours]
    for p in ours:
        p.grad = torch.full(p.shape, float("nan"))
    a.found_inf = torch.ones(())
    a.step()
    for p, (w, m) in zip(ours, before, strict=True):
        assert torch.equal(p.detach(), w) and torch.equal(a.state[p]["momentum_buffer"], m)


def test_muon_takes_the_linear_matrices_and_adamw_the_rest():
    cfg = DrafterConfig(hidden_size=H, intermediate_size=32, num_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8, vocab_size=V, num_target_layers=4,
                        target_layer_ids=[1, 2], mask_token_id=V - 1, block_size=B)
    model = torch.nn.ModuleDict({"drafter": DFlashDrafter(cfg), "codebook": torch.nn.Embedding(6, H),
                                 "row": torch.nn.Linear(H, 1)})
    muon, tables, rest = split_for_muon(model)
    linear = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features > 1}
    assert {id(p) for p in muon} == linear and linear
    assert [id(p) for p in tables] == [id(model["codebook"].weight)]
    assert id(model["row"].weight) in {id(p) for p in rest}
    assert all(p.dim() < 2 for p in rest if p is not model["row"].weight)
    assert len(muon) + len(tables) + len(rest) == len(list(model.parameters()))
    opt = build_optimizer(model, OptimSettings(optimizer="muon", lr=1e-3), torch.device("cpu"))
    assert isinstance(opt, Optimizers) and set(opt.named) == {"muon", "adamw"}
    # --muon-lr defaults to --lr (the update is RMS-matched to AdamW's); everything at one rate
    assert {g["lr_scale"] for g in opt.param_groups} == {1.0}
    assert {g["lr"] for g in opt.param_groups} == {1e-3}
    assert exp_weights(4, 2.0).tolist() == pytest.approx([1.0, math.exp(-0.5), math.exp(-1.0)])


def test_the_vocabulary_tables_take_muons_rate_from_adamw():
    """DSpark's Markov factors and DFlash2's codebooks are vocabulary-indexed tables: AdamW's, in a group
    at --muon-lr (what Muon would have given them), while the other AdamW parameters stay at --lr."""
    from dflash.model.dflash2 import DFlash2Config, build_drafter
    from dflash.model.dspark import DSparkConfig

    base = dict(hidden_size=H, intermediate_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=8, vocab_size=V, num_target_layers=4, target_layer_ids=[1, 2], mask_token_id=V - 1,
                block_size=B)
    spark = build_drafter(DSparkConfig(**base, markov_rank=4))
    flash2 = build_drafter(DFlash2Config(**base, selector_rank=3))
    for model, tables in [(spark, [spark.markov_head.markov_w1.weight, spark.markov_head.markov_w2.weight]),
                          (flash2, [flash2.candidate_selector.predecessor_codebook,
                                    flash2.candidate_selector.successor_codebook])]:
        opt = build_optimizer(model, OptimSettings(optimizer="muon", lr=1e-3, muon_lr=4e-3), torch.device("cpu"))
        at = {id(p): (name, g["lr"], g["lr_scale"]) for name, o in opt.named.items() for g in o.param_groups
              for p in g["params"]}
        assert all(at[id(p)] == ("adamw", 4e-3, 4.0) for p in tables), [at[id(p)] for p in tables]
        others = [v for k, v in at.items() if k not in {id(p) for p in tables}]
        assert {v for v in others if v[0] == "adamw"} == {("adamw", 1e-3, 1.0)}
        assert {v for v in others if v[0] == "muon"} == {("muon", 4e-3, 4.0)}
    # the confidence head's [1, H + r] row is a vector to AdamW, not a table
    assert all(p is not spark.confidence_head.proj.weight for p in split_for_muon(spark)[1])


def test_without_torchs_muon_adamw_still_trains_and_muon_is_refused_in_one_line(tmp_path):
    """torch's Muon is private (torch.optim._muon): a torch without it must not break AdamW runs. The
    child process makes that torch (the module unimportable, torch.optim.Muon gone) and runs the CLI."""
    import subprocess
    import sys

    child = ("import sys, torch.optim\n"
             "sys.modules['torch.optim._muon'] = None\n"  # a None entry makes the import raise ImportError
             "del torch.optim.Muon\n"
             "from dflash.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the child is one more process on a shared machine
    base = [sys.executable, "-c", child, "train", "--max-steps", "2", "--no-telemetry", "--eval-prompts", "0",
            "--drafter-layers", "1"]
    adamw = subprocess.run([*base, "--run-dir", str(tmp_path / "adamw")], env=env, capture_output=True, text=True,
                           timeout=300)
    assert adamw.returncode == 0, adamw.stderr[-2000:]
    assert "done: 2 steps" in adamw.stdout and list((tmp_path / "adamw").glob("**/step-00000002.pt"))
    muon = subprocess.run([*base, "--optimizer", "muon", "--run-dir", str(tmp_path / "muon")], env=env,
                          capture_output=True, text=True, timeout=300)
    errors = [line for line in muon.stderr.splitlines() if "error" in line]
    assert muon.returncode == 2 and errors == [
        f"dflash train: error: optimizer: --optimizer muon needs torch.optim.Muon (torch 2.9 or later), and this "
        f"torch ({torch.__version__}) has none; use --optimizer adamw"], muon.stderr
    assert not (tmp_path / "muon").exists()
