"""DSpark: the drafter's heads and settings, its objective's terms against a direct dense computation
(value and gradient, one chunk and many), and the plan that drafts from the anchor slot."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from test_drafter_release import _train, setup  # noqa: F401 (fixtures)
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash import objectives
from dflash.model.dflash2 import build_drafter
from dflash.model.dspark import DSparkConfig, DSparkDrafter
from dflash.model.objective import forward_blocks
from dflash.objectives import for_drafter
from dflash.train.config import ObjectiveSettings

H, V, T, R = 16, 40, 24, 4


def tiny_config(**kw) -> DSparkConfig:
    base = dict(hidden_size=H, intermediate_size=32, num_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=8, vocab_size=V, num_target_layers=4, target_layer_ids=[1, 2], markov_rank=R,
                block_size=4)
    return DSparkConfig(**{**base, **kw})


def test_defaults_are_the_recipe_and_the_tensors_are_named_as_the_public_checkpoints():
    cfg = tiny_config(block_size=7)
    assert (cfg.block_size, cfg.gamma, cfg.plan_block_size, cfg.drafts_per_block) == (7, 4.0, 8, 7)
    assert DSparkConfig.__dataclass_fields__["markov_rank"].default == 256
    shapes = {k: tuple(v.shape) for k, v in build_drafter(cfg).state_dict().items() if "_head" in k}
    assert shapes == {"markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (V, R),
                      "confidence_head.proj.weight": (1, H + R), "confidence_head.proj.bias": (1,)}


@pytest.mark.parametrize(("kw", "says"), [
    ({"markov_rank": 0}, "markov_rank must be at least 1"),
    ({"markov_head_type": "gated"}, "'gated' is not built here"),
    ({"markov_head_type": "lstm"}, "not a DSpark head"),
])
def test_bad_settings_are_one_line(kw, says):
    with pytest.raises(ValueError, match=says) as e:
        tiny_config(**kw)
    assert "\n" not in str(e.value)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, T), generator=g)
    loss_mask = torch.ones(2, T, dtype=torch.bool)
    loss_mask[0, :3] = False  # a prompt
    loss_mask[1, 15:] = False  # the second response ends at 14
    anchors = torch.tensor([[3, 9, 16], [4, 10, 0]])
    keep = torch.tensor([[True, True, True], [True, True, False]])
    return g, ids, loss_mask, anchors, keep


def heads():
    lm_head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    verifier_head = torch.nn.Linear(H, V, bias=False).requires_grad_(False)
    embed = torch.nn.Embedding(V, H).requires_grad_(False)
    return embed, lm_head, verifier_head


def dense_loss(drafter: DSparkDrafter, embed, lm_head, verifier_head, ids, target_hidden, verifier, loss_mask,
               anchors, keep):
    """The DSpark objective written out slot by slot: drafter slot j of the block at anchor a drafts
    x[a + j + 1] after x[a + j], against the target's distribution at a + j, weighted exp(-j/gamma)."""
    cfg = drafter.config
    hidden = forward_blocks(drafter, embed, ids, target_hidden, anchors.clamp(min=0))
    sums = {"ce": 0.0, "tv": 0.0, "bce": 0.0}
    wsum = 0.0
    for b in range(ids.shape[0]):
        for n in range(anchors.shape[1]):
            if not keep[b, n]:
                continue
            a = int(anchors[b, n])
            for j in range(cfg.block_size):
                if not loss_mask[b, a + j + 1]:
                    continue
                h = hidden[b, n, j]
                prev = ids[b, a + j]
                logits = lm_head(h) + drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(prev))
                q = torch.softmax(logits, -1)
                p = torch.softmax(verifier_head(verifier[b, a + j]), -1)
                tv = 0.5 * (q - p).abs().sum()
                conf = drafter.confidence_head.proj(torch.cat([h, drafter.markov_head.markov_w1(prev)]))[0]
                w = torch.exp(torch.tensor(-j / cfg.gamma))
                sums["ce"] = sums["ce"] + w * -torch.log(q[ids[b, a + j + 1]])
                sums["tv"] = sums["tv"] + w * tv
                sums["bce"] = sums["bce"] + w * F.binary_cross_entropy_with_logits(conf, (1 - tv).detach())
                wsum = wsum + w
    terms = {k: v / wsum for k, v in sums.items()}
    return 0.1 * terms["ce"] + 0.9 * terms["tv"] + terms["bce"], terms


@pytest.mark.parametrize("chunk", [None, 3])
def test_the_terms_equal_a_direct_dense_computation_value_and_gradient(monkeypatch, chunk):
    if chunk:  # chunks of 3 rows, checkpointed: the recompute in backward must give the same gradient
        monkeypatch.setattr(objectives.dspark_pass, "chunk_rows", lambda _vocab: chunk)
    torch.manual_seed(0)
    drafter = build_drafter(tiny_config())
    embed, lm_head, verifier_head = heads()
    g, ids, loss_mask, anchors, keep = batch()
    target_hidden = torch.randn(2, T, 2 * H, generator=g)
    verifier = torch.randn(2, T, H, generator=g)
    objective = for_drafter(ObjectiveSettings(), drafter)
    assert objective.describe() == "0.1 x ce + 0.9 x tv + confidence"
    assert objective.needs_verifier
    out = objective.on_batch(drafter, embed, lm_head, ids, target_hidden, loss_mask,
                             anchors=(anchors, keep), verifier=verifier, verifier_head=verifier_head)
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    want, terms = dense_loss(drafter, embed, lm_head, verifier_head, ids, target_hidden, verifier, loss_mask,
                             anchors, keep)
    want.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)
    logged = out.terms()
    for name, key in (("ce", "ce"), ("tv", "tv"), ("confidence", "bce")):
        assert logged[name] == pytest.approx(terms[key].item(), rel=1e-5)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    # every head has a gradient from the first step
    for n in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
        assert got[n].abs().sum() > 0, n
    # the plan supervises every drafter slot, the anchor's first: 4 slots (x[a + 1] .. x[a + 4]) in each of
    # the five kept blocks (row 1's response ends at 14, its block at 10 labels up to x[14])
    assert out.per_position_count == [5, 5, 5, 5]
    assert set(out.term_metrics()) == {"accept_rate", "confidence_error"}


def test_the_token_loss_other_than_ce_is_refused_in_one_line():
    drafter = build_drafter(tiny_config())
    with pytest.raises(ValueError, match="use --loss ce"):
        for_drafter(ObjectiveSettings(loss="kl"), drafter)


def test_a_dspark_run_trains_evaluates_losslessly_and_exports(setup, tmp_path, capsys):  # noqa: F811
    """The end-to-end proof: train a tiny DSpark a few steps on the tiny target, evaluate it greedily
    (token for token the target's output) in the run, export it and read it back."""
    assert _train(setup, tmp_path / "run", drafter_type="dspark", markov_rank=8) == 0
    out = capsys.readouterr().out
    assert "DSpark: Markov head rank 8, confidence head" in out, out
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert evals and all(e["lossless"] for e in evals), evals
    assert len(evals[-1]["per_position_acceptance"]) == 4  # block 4 drafts 4 tokens, the anchor's slot first
