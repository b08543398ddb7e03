"""DSpark against DeepSpec's own model code, both ways, where a checkout of it is given
(``DFLASH_DEEPSPEC_DIR``: a directory holding its ``deepspec/`` package; it needs nothing installed
beyond torch and transformers):

* ours -> theirs: a DSpark drafter exported in the ``deepspec`` format loads into DeepSpec's
  ``Qwen3DSparkModel`` with nothing missing, unexpected or reshaped, every tensor bit for bit, and its
  drafting path (the backbone over one block, the Markov head walked left to right from the anchor, the
  confidence head on ``[h ; markov_w1[prev]]``) gives our drafts, logits, Markov bias and confidence
  scores on the same target states and previous tokens;
* theirs -> ours: a ``Qwen3DSparkModel`` built from a target config as DeepSpec's trainer builds it and
  saved as its checkpoint manager saves it reads back here (``load_exported`` and ``--init-from``'s
  ``start_from_release``) bit for bit, with the same outputs.

The heads are compared exactly (same inputs, the same two matrix products); the backbone to float32
rounding, since the two attention and RMSNorm kernels order their sums differently.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_drafter_release import setup  # noqa: F401 (fixture)
from test_dspark import target_tensors, tiny_target, trained_looking  # noqa: F401 (fixtures)
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash.model.dspark import DSparkDrafter
from dflash.model.loading import load_exported
from dflash.model.released import start_from_release
from dflash.model.write_export import export_drafter

BLOCK, RANK, CONTEXT = 4, 8, 9


@pytest.fixture(scope="module")
def deepspec():
    """DeepSpec's Qwen3 DSpark modeling module, from the checkout ``DFLASH_DEEPSPEC_DIR`` names."""
    where = os.environ.get("DFLASH_DEEPSPEC_DIR")
    if not where or not (Path(where) / "deepspec" / "modeling" / "dspark").is_dir():
        pytest.skip("set DFLASH_DEEPSPEC_DIR to a DeepSpec checkout (a directory holding deepspec/) to run these")
    sys.path.insert(0, str(Path(where).resolve()))
    try:
        from deepspec.modeling.dspark.qwen3 import build_draft_config, modeling
    finally:
        sys.path.remove(str(Path(where).resolve()))
    return modeling, build_draft_config


def their_draft(model, ids: torch.Tensor, feature: torch.Tensor) -> dict:
    """DeepSpec's drafting path for one block as its evaluator runs it (deepspec/eval/dspark/): the
    backbone over ``ids`` [1, B] (anchor then masks) at positions C .. C+B-1 after the context's C target
    feature rows, its LM head, the Markov head walked greedily from the anchor, the confidence head on
    each slot's state and previous token."""
    c, b = feature.shape[1], ids.shape[1]
    h = model._forward_backbone(target_hidden_states=feature, noise_embedding=model.embed_tokens(ids),
                                position_ids=torch.arange(c + b)[None], attention_mask=None, is_causal=False)
    tokens, logits = model.sample_draft_tokens(model.compute_logits(h), first_prev_token_ids=ids[:, 0],
                                               temperature=0.0, hidden_states=h)
    prev = torch.cat([ids[:, :1], tokens[:, :-1]], 1)
    return {"h": h, "tokens": tokens, "logits": logits.float(),
            "confidence": model.predict_confidence_step(h, prev_token_ids=prev)}


def our_draft(d: DSparkDrafter, target, ids: torch.Tensor, feature: torch.Tensor) -> dict:
    """The same through our drafter and the target's embedding and LM head (dflash/eval/speculative.py)."""
    c, b = feature.shape[1], ids.shape[1]
    h = d(target.embed_tokens(ids), feature, torch.arange(c, c + b)[None], torch.arange(c)[None])
    draft = d.walk(h, target.lm_head(h), ids[:, 0])
    return {"h": h, "tokens": draft.tokens, "logits": draft.logits, "confidence": draft.confidence}


def block_inputs(d: DSparkDrafter, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    feature = torch.randn(1, CONTEXT, len(d.config.target_layer_ids) * d.config.hidden_size, generator=g)
    anchor = torch.randint(0, d.config.vocab_size, (1, 1), generator=g)
    return torch.cat([anchor, torch.full((1, BLOCK - 1), d.config.mask_token_id)], 1), feature


def assert_same_drafting(ours: dict, theirs: dict) -> None:
    # the backbone to float32 rounding (different kernels), then the heads on identical inputs
    torch.testing.assert_close(ours["h"], theirs["h"], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours["tokens"], theirs["tokens"])
    torch.testing.assert_close(ours["logits"], theirs["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours["confidence"], theirs["confidence"], rtol=1e-5, atol=1e-5)


def assert_same_heads(d: DSparkDrafter, model, seed: int) -> None:
    """Markov bias and confidence logits on the same states and previous tokens: exactly equal."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, BLOCK, d.config.hidden_size, generator=g)
    prev = torch.randint(0, d.config.vocab_size, (2, BLOCK), generator=g)
    mine_bias, mine_conf = d.logits_and_confidence(torch.zeros(2, BLOCK, d.config.vocab_size), h, prev)
    bias = model.markov_head.compute_step_bias(prev, h)
    torch.testing.assert_close(mine_bias, bias.float(), rtol=0, atol=0)
    torch.testing.assert_close(mine_conf, model.predict_confidence_step(h, prev_token_ids=prev), rtol=0, atol=0)


@torch.no_grad()
def test_deepspec_loads_our_export_strictly_and_drafts_as_we_do(deepspec, tiny_target, tmp_path):  # noqa: F811
    modeling, _ = deepspec
    d = trained_looking(tiny_target)
    export_drafter(d, tmp_path, fmt="deepspec", target_tensors=target_tensors(tiny_target))
    model, info = modeling.Qwen3DSparkModel.from_pretrained(str(tmp_path), output_loading_info=True,
                                                            attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    model.eval()
    # strict, from the file itself, and every tensor as we hold it (the target's two included)
    model.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    theirs = model.state_dict()
    mine = {**d.state_dict(), **target_tensors(tiny_target)}
    assert mine.keys() == theirs.keys()
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []
    assert (model.block_size, model.markov_head.markov_rank, model.target_layer_ids) == (BLOCK, RANK, [1, 3])
    assert model.confidence_head_with_markov and model.markov_head.markov_head_type == "vanilla"
    assert_same_heads(d, model, seed=3)
    for seed in range(3):
        ids, feature = block_inputs(d, seed)
        assert_same_drafting(our_draft(d, tiny_target, ids, feature), their_draft(model, ids, feature))


class _ModelArgs(dict):
    """The keys DeepSpec's trainer reads of its model settings (``in`` and attribute access both)."""

    __getattr__ = dict.__getitem__


@torch.no_grad()
def test_a_deepspec_checkpoint_reads_back_bit_for_bit_and_drafts_as_theirs(deepspec, setup, tiny_target,  # noqa: F811
                                                                           tmp_path):
    modeling, build_draft_config = deepspec
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(str(setup[1]))
    config = build_draft_config(target_config, _ModelArgs(
        num_draft_layers=2, target_layer_ids=[1, 3], block_size=BLOCK, confidence_head_alpha=1.0,
        confidence_head_with_markov=True, markov_rank=RANK, markov_head_type="vanilla",
        mask_token_id=tiny_target.default_mask_token_id(), num_anchors=16))
    config._attn_implementation = "eager"  # their trainer's flex attention is for its packed training mask
    torch.manual_seed(5)
    model = modeling.Qwen3DSparkModel(config)
    model.initialize_embeddings_and_head(embed_tokens=tiny_target.embed_tokens, lm_head=tiny_target.lm_head)
    for p in model.parameters():  # every weight away from its start (norms, biases, the heads)
        p.add_(torch.randn_like(p) * 0.1)
    model.embed_tokens.weight.copy_(tiny_target.embed_tokens.weight)
    model.lm_head.weight.copy_(tiny_target.lm_head.weight)
    model.eval()
    model.save_pretrained(str(tmp_path), state_dict=model.state_dict())  # as their checkpoint manager does
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3DSparkModel"] and "dflash_config" not in saved

    theirs = {k: v for k, v in model.state_dict().items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    back = load_exported(tmp_path)
    cfg, state = start_from_release(tmp_path, tiny_target, block_size=BLOCK, drafter_type="dspark")
    assert isinstance(back, DSparkDrafter)
    for got in (back.state_dict(), state):
        assert got.keys() == theirs.keys()
        assert [k for k in theirs if not torch.equal(got[k], theirs[k])] == []
    assert (back.config.block_size, back.config.markov_rank, back.config.target_layer_ids,
            back.config.mask_token_id, back.config.num_layers) == (BLOCK, RANK, [1, 3], config.mask_token_id, 2)
    assert cfg.markov_rank == RANK and cfg.target_layer_ids == [1, 3]
    back.eval()
    assert_same_heads(back, model, seed=4)
    for seed in range(3):
        ids, feature = block_inputs(back, seed)
        assert_same_drafting(our_draft(back, tiny_target, ids, feature), their_draft(model, ids, feature))
