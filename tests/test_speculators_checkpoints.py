"""speculators' DFlash and DFlash2 checkpoints read by dflash, and our export read by speculators' own
`convert`.

Every speculators checkpoint here is made by speculators' own code, as `speculators train` makes it: the
draft layers' config from the target (``create_transformer_layer_config``), the model from
``DFlashDraftModel.from_training_args`` (``DFlash2DraftModel``'s for DFlash2), one optimizer step through
its own forward and loss, and the save through its own ``SingleGPUCheckpointer`` (``save_pretrained`` +
the optimizer's state). Its forward runs on CPU with eager attention, so the logits of both sides are
compared (and DFlash2's selector scores). Skipped with one line when speculators is not importable
(`make speculators` installs it).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

try:
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dflash2 import DFlash2DraftModel
    from speculators.train.checkpointer import SingleGPUCheckpointer
    from speculators.train.cli import create_transformer_layer_config
except ImportError as e:  # one line: why the cross-tests do not run here
    pytest.skip(f"speculators not importable ({e}); `make speculators` installs it", allow_module_level=True)

from dflash.cli import main
from dflash.data import load_prompts
from dflash.model.dflash2 import DFlash2Config, DFlash2Drafter
from dflash.model.drafter import FULL, SLIDING, DFlashDrafter, DrafterConfig
from dflash.model.loading import load_drafter
from dflash.model.released import release_config
from dflash.targets import load_target
from dflash.targets.tiny import tiny_target_dir
from dflash.train.config.schema import make_config
from dflash.train.distributed import Dist
from dflash.train.run.build import build, run_target

torch.set_num_threads(1)
AUX = [2, 4]  # speculators' ids of the taps our [1, 3] name
TAPS = [1, 3]
BLOCK = 4
WINDOW = 64  # wider than any sequence here: their sliding mask and the engines' then see the same keys
#: DFlash2's settings, none of them speculators' default, so a setting read wrong (or not at all) shows
CONV, GROUP, RANK, TOP_K = 3, 32, 8, 4


@pytest.fixture(scope="module")
def target():
    return load_target("tiny", layer_ids=TAPS)


@pytest.fixture(scope="module")
def tokens(target) -> torch.Tensor:
    """A real prompt's tokens, [1, T]."""
    return torch.tensor([load_prompts("demo", target.tokenizer, 1)[0][:40]])


@pytest.fixture(scope="module")
def verifier():
    """The tiny target as speculators' data path sees it: plain transformers, all hidden states."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir(), dtype=torch.float32).eval()


def their_inputs(verifier, ids: torch.Tensor) -> dict:
    """A packed one-document batch as speculators' loader yields it: ``hidden_states`` the aux layers
    taken at their own ids (``output_hidden_states[k]``), independent of our tap-id arithmetic."""
    with torch.no_grad():
        hs = verifier(input_ids=ids, output_hidden_states=True).hidden_states
    return {"hidden_states": torch.cat([hs[k] for k in AUX], dim=-1), "input_ids": ids,
            "loss_mask": torch.ones_like(ids), "verifier_last_hidden_states": hs[-1],
            "document_ids": torch.zeros_like(ids)}


def speculators_drafter(model_class=DFlashDraftModel, **overrides) -> DFlashDraftModel:
    """A DFlash (or DFlash2) drafter for the tiny target built the way `speculators train` builds one: 2
    layers, the first full attention, the second sliding."""
    tiny = str(tiny_target_dir())
    layers = create_transformer_layer_config(tiny, num_layers=2, draft_arch="qwen3", hidden_act=None,
                                             sliding_window=WINDOW, full_attention_indices=[0])
    args = dict(draft_vocab_size=layers.vocab_size, block_size=BLOCK, target_layer_ids=AUX, mask_token_id=5,
                verifier_name_or_path=tiny, draft_attn_impl="eager")
    return model_class.from_training_args(verifier_config=layers, **{**args, **overrides})


def speculators_dflash2(**overrides) -> DFlash2DraftModel:
    """A DFlash2 drafter as `speculators train` builds one (sliding layers causal, which dflash runs), its
    convolutions moved off the identity they start as and its codebooks scaled up from their small start,
    so that a convolution read wrong shows in the logits and the selector changes drafts."""
    settings = dict(conv_kernel_size=CONV, conv_group_size=GROUP, selector_rank=RANK, selector_top_k=TOP_K,
                    sliding_window_non_causal=False)
    model = speculators_drafter(DFlash2DraftModel, **{**settings, **overrides})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conv." in name:
                p.add_(torch.randn_like(p), alpha=0.05)
            elif "codebook" in name:
                p.normal_()
    return model


def train_and_save(model, batch: dict, save_path: Path, epochs: int = 1) -> None:
    """One step of their forward, loss and AdamW per epoch, each epoch saved by their checkpointer."""
    kwargs, _ = type(model).get_trainer_kwargs(loss_fn="ce", loss_implementation="eager", max_anchors=8)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    checkpointer = SingleGPUCheckpointer(save_path)
    model.train()
    for epoch in range(epochs):
        _, loss, _ = model(**batch, **kwargs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        checkpointer.save_checkpoint(model, opt, epoch)
    model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, verifier, tokens) -> Path:
    """`speculators train`'s save path after two epochs, the first linked as the best."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("speculators") / "save"
    train_and_save(speculators_drafter(), their_inputs(verifier, tokens), root, epochs=2)
    SingleGPUCheckpointer(root).update_best_symlink(0)
    return root


@pytest.fixture(scope="module")
def saved2(tmp_path_factory, verifier, tokens) -> Path:
    """`speculators train --algorithm dflash2`'s save path after one epoch."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("speculators2") / "save"
    train_and_save(speculators_dflash2(), their_inputs(verifier, tokens), root)
    return root


def their_model(path: Path, model_class=DFlashDraftModel) -> DFlashDraftModel:
    """A checkpoint loaded as speculators loads one to finetune it (eager attention, for the CPU)."""
    config = model_class.config_class.from_pretrained(str(path))
    config.transformer_layer_config._attn_implementation = "eager"
    return model_class.from_pretrained(str(path), config=config, dtype=torch.float32).eval()


def their_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def forward_both_ways(theirs: DFlashDraftModel, ours: DFlashDrafter, target, batch: dict) -> dict:
    """Their forward over every anchor of the sequence against ours, one block at a time, as decoding
    runs it: the context strictly before the anchor, our taps taken at our ids. Each side's final hidden
    states and logits [anchors, BLOCK, ...], and their block indices (as their forward has them)."""
    ids = batch["input_ids"]
    n = ids.shape[1] - BLOCK  # their anchors: every position but the last block's
    with torch.no_grad():
        hidden, logits, _, _, where = theirs._backbone_forward(**batch, max_anchors=n)
        assert where[::BLOCK].tolist() == list(range(n))
        embed, head = target.frozen_head("cpu")
        taps = target.tap_states(ids)
        mine = []
        for a in range(n):
            block = torch.tensor([[int(ids[0, a])] + [ours.mask_token_id] * (BLOCK - 1)])
            mine.append(ours(embed(block), taps[:, :a], torch.arange(a, a + BLOCK)[None], torch.arange(a)[None]))
        mine = torch.cat(mine)
        return {"their_hidden": hidden[0].view(n, BLOCK, -1), "their_logits": logits[0].view(n, BLOCK, -1),
                "our_hidden": mine, "our_logits": head(mine), "where": where, "head": head}


def logits_both_ways(theirs: DFlashDraftModel, ours: DFlashDrafter, target, batch: dict) -> tuple:
    both = forward_both_ways(theirs, ours, target, batch)
    return both["their_logits"], both["our_logits"]


def test_a_speculators_checkpoint_reads_with_the_taps_shifted(saved):
    """aux ids [2, 4] are our taps [1, 3]; the save path resolves to its best epoch; the shape is theirs."""
    theirs = json.loads((saved / "0" / "config.json").read_text())
    assert theirs["aux_hidden_state_layer_ids"] == AUX and theirs["speculators_model_type"] == "dflash"
    cfg = release_config(saved)
    assert cfg.target_layer_ids == TAPS
    assert (cfg.num_layers, cfg.layer_types, cfg.sliding_window) == (2, [FULL, SLIDING], WINDOW)
    assert (cfg.block_size, cfg.mask_token_id) == (BLOCK, 5)
    best, last = load_drafter(saved), load_drafter(saved / "1")
    assert best.loaded_from == str(saved / "checkpoint_best") and (saved / "checkpoint_best").resolve() == saved / "0"
    assert not torch.equal(best.state_dict()["fc.weight"], last.state_dict()["fc.weight"])  # epoch 1 trained on


def test_forward_agrees_with_speculators_own(saved, target, verifier, tokens):
    """Same weights, same hidden states: their training forward and our decoding forward give the same
    logits at every anchor, full and sliding layers alike; with the aux ids read unshifted they do not."""
    theirs, ours = their_model(saved / "0"), load_drafter(saved / "0").float()
    assert ours.config.target_layer_ids == target.layer_ids == TAPS  # read from their aux ids
    batch = their_inputs(verifier, tokens)
    a, b = logits_both_ways(theirs, ours, target, batch)
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()
    wrong = load_target("tiny", layer_ids=AUX)  # the aux ids taken as our tap ids
    _, c = logits_both_ways(theirs, ours, wrong, batch)
    assert (a - c).abs().max() > 0.1


def test_init_from_starts_from_their_weights_and_trains(saved, tmp_path, capsys):
    cfg = make_config({}, dict(target="tiny", data="demo", run_dir=str(tmp_path / "built"), max_steps=1,
                               telemetry=False, init_from=str(saved / "0")))
    parts = build(cfg, Dist(), run_target(cfg), log=lambda line: None)
    assert cfg.model.target_layer_ids == TAPS and cfg.model.block_size == BLOCK
    mine = parts.drafter.drafter.state_dict()
    weights = their_weights(saved / "0")
    assert set(mine) == set(weights)  # all of it: nothing of theirs left out, nothing of ours made up
    for name, tensor in weights.items():
        assert torch.equal(mine[name], tensor.to(mine[name].dtype)), name
    assert main(["train", "--target", "tiny", "--data", "demo", "--init-from", str(saved), "--run-dir",
                 str(tmp_path / "run"), "--max-steps", "2", "--batch-size", "4", "--num-anchors", "8",
                 "--eval-prompts", "2", "--eval-max-new-tokens", "12", "--no-telemetry"]) == 0
    assert f"drafter initialised from {saved} (2 layers, 1 sliding (window {WINDOW}))" in capsys.readouterr().out
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert evals and all(e["lossless"] for e in evals), evals


def test_eval_decodes_a_speculators_checkpoint_losslessly(saved, capsys):
    assert main(["eval", "--drafter", str(saved), "--num-prompts", "2", "--max-new-tokens", "24", "--device",
                 "cpu", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    assert result["lossless"] is True and result["tokens_generated"] > 0, result
    assert f"target {tiny_target_dir()} (the verifier its speculators config names" in err


def _refused(args: list[str], capsys) -> str:
    assert main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if ": error" in line]
    assert len(errors) == 1, errors
    return errors[0]


def _both_refuse(path: Path, needle: str, tmp_path: Path, capsys, target: str | None = None) -> None:
    """`dflash eval --drafter` and `dflash train --init-from` each refuse in one line; nothing trained.
    ``target``: the target both are given (else eval takes the verifier the checkpoint names, train tiny)."""
    line = _refused(["eval", "--drafter", str(path), "--num-prompts", "1", "--device", "cpu",
                     *(["--target", target] if target else [])], capsys)
    assert needle in line, line
    run = tmp_path / f"run-{path.name}"
    line = _refused(["train", "--target", target or "tiny", "--data", "demo", "--init-from", str(path), "--run-dir",
                     str(run), "--max-steps", "1", "--eval-prompts", "0", "--no-telemetry"], capsys)
    assert needle in line, line
    assert not list(run.glob("checkpoints/*.pt"))


def test_a_target_that_scales_its_embedding_is_refused_in_one_line(saved, saved2, tmp_path, capsys):
    """speculators looks a block up in the target's embedding rows as they are; a Gemma target scales them
    (by sqrt(hidden), 8 here), as dflash applies them: a DFlash or DFlash2 checkpoint would read inputs it
    never saw, so both are refused, with that reason (not "made for another target")."""
    from transformers import AutoTokenizer

    from dflash.targets.families import build_family_target

    gemma = build_family_target(tmp_path / "gemma", "gemma4", AutoTokenizer.from_pretrained(tiny_target_dir()))
    for path in (saved / "0", saved2 / "0"):
        _both_refuse(path, "speculators trained it on the target's embedding rows unscaled, and this target scales "
                     "them by 8, as dflash applies them: it would draft from inputs it never saw", tmp_path, capsys,
                     target=str(gemma))


def test_what_dflash_cannot_use_is_refused_in_one_line(tmp_path, verifier, tokens, capsys):
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    batch = their_inputs(verifier, tokens)
    vocab = verifier.config.vocab_size
    freq = {int(t): 1 for t in tokens[0]}
    d2t, t2d = build_vocab_mappings_from_distribution(freq, 512, vocab)
    train_and_save(speculators_drafter(t2d=t2d, d2t=d2t, draft_vocab_size=512), batch, tmp_path / "pruned")
    _both_refuse(tmp_path / "pruned" / "0", "draft vocabulary is pruned to 512 tokens, the target has 2048", tmp_path,
                 capsys)
    # a config that claims the whole vocabulary still holds the maps in its weights
    shutil.copytree(tmp_path / "pruned" / "0", tmp_path / "claims-full")
    d = json.loads((tmp_path / "claims-full" / "config.json").read_text())
    (tmp_path / "claims-full" / "config.json").write_text(json.dumps({**d, "draft_vocab_size": vocab}))
    line = _refused(["eval", "--drafter", str(tmp_path / "claims-full"), "--device", "cpu"], capsys)
    assert "its weights hold t2d and d2t: a pruned draft vocabulary" in line, line

    train_and_save(speculators_drafter(sample_from_anchor=True), batch, tmp_path / "anchor")
    _both_refuse(tmp_path / "anchor" / "0", "(sample_from_anchor)", tmp_path, capsys)

    # DFlash2 as speculators makes it by default: its sliding layer attends both ways inside a block
    train_and_save(speculators_drafter(DFlash2DraftModel, selector_rank=8, selector_top_k=4), batch, tmp_path / "nc")
    _both_refuse(tmp_path / "nc" / "0", "sliding layers attend both ways inside a block", tmp_path, capsys)
    # an algorithm neither side knows yet
    shutil.copytree(tmp_path / "anchor" / "0", tmp_path / "future")
    d = json.loads((tmp_path / "future" / "config.json").read_text())
    d["speculators_model_type"] = d["speculators_config"]["algorithm"] = "dflash9"
    (tmp_path / "future" / "config.json").write_text(json.dumps(d))
    _both_refuse(tmp_path / "future", "a speculators 'dflash9' checkpoint", tmp_path, capsys)


def test_settings_dflash_does_not_run_are_refused_in_one_line(saved):
    """Their config with one setting changed at a time, read as `--init-from` and `eval` read it."""
    from dflash.model.export import DrafterLoadError
    from dflash.model.loading import config_of_export

    real = json.loads((saved / "0" / "config.json").read_text())
    layers = real["transformer_layer_config"]
    cases = [({"sliding_window_non_causal": True}, "sliding layers attend both ways inside a block"),
             ({"aux_hidden_state_layer_ids": [0, 4]}, "taps the embedding output (id 0)"),
             ({"mask_token_id": None}, "it has no mask_token_id"),
             ({"transformer_layer_config": {**layers, "hidden_act": "gelu"}}, "the 'gelu' activation"),
             ({"speculators_config": None, "speculators_model_type": "eagle3"}, "a speculators 'eagle3' checkpoint")]
    for change, needle in cases:
        with pytest.raises(DrafterLoadError) as e:
            config_of_export({**real, **change}, "here")
        assert str(e.value).startswith("here: ") and needle in str(e.value) and "\n" not in str(e.value), change
    # full layers are bidirectional in every reader: the flag says nothing about them
    full = {**layers, "layer_types": [FULL, FULL], "use_sliding_window": False}
    cfg = config_of_export({**real, "sliding_window_non_causal": True, "transformer_layer_config": full}, "here")
    assert cfg.layer_types == [FULL, FULL]


def test_a_speculators_dflash2_checkpoint_reads_as_our_dflash2(saved2):
    """Their DFlash2 config is our DFlash2Config (its four settings, taps = aux ids - 1, layers); their
    tensors are ours, every one, to the bit."""
    theirs = json.loads((saved2 / "0" / "config.json").read_text())
    assert theirs["speculators_model_type"] == "dflash2" and theirs["aux_hidden_state_layer_ids"] == AUX
    cfg = release_config(saved2)
    assert isinstance(cfg, DFlash2Config)
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (CONV, GROUP, RANK,
                                                                                                  TOP_K)
    assert cfg.target_layer_ids == TAPS and (cfg.block_size, cfg.mask_token_id) == (BLOCK, 5)
    assert (cfg.num_layers, cfg.layer_types, cfg.sliding_window) == (2, [FULL, SLIDING], WINDOW)
    ours = load_drafter(saved2)
    assert isinstance(ours, DFlash2Drafter) and ours.loaded_from == str(saved2 / "0")
    mine, weights = ours.state_dict(), their_weights(saved2 / "0")
    assert set(mine) == set(weights)  # nothing of theirs left out, nothing of ours made up
    for name, tensor in weights.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name


def test_dflash2_forward_and_selector_agree_with_speculators_own(saved2, target, verifier, tokens):
    """Same weights, same hidden states: their training forward and our decoding forward give the same
    final hidden states and logits at every anchor (convolutions inside each block, full and sliding
    layers); their selector's scores of the unary top-k after the block's previous tokens (the
    predecessors their forward scores with) are ours; their selector walked greedily from the anchor
    drafts the tokens ours does."""
    theirs, ours = their_model(saved2 / "0", DFlash2DraftModel), load_drafter(saved2 / "0").float()
    batch = their_inputs(verifier, tokens)
    both = forward_both_ways(theirs, ours, target, batch)
    for side in ("hidden", "logits"):
        a, b = both[f"their_{side}"], both[f"our_{side}"]
        assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (side, (a - b).abs().max())
    hidden, logits, ids = both["their_hidden"], both["their_logits"], batch["input_ids"]
    n = hidden.shape[0]
    selector, mine = theirs.candidate_selector, ours.candidate_selector
    with torch.no_grad():
        predecessors = theirs._predecessor_ids(ids, both["where"])
        candidates = logits.topk(TOP_K, dim=-1).indices
        their_scores = selector.score_candidates(logits, hidden, predecessors, candidates)
        our_scores = mine.scores(mine.hidden_projection(both["our_hidden"]), predecessors,
                                 both["our_logits"].gather(-1, candidates), candidates)
        assert torch.allclose(their_scores, our_scores, atol=2e-4, rtol=1e-4), (their_scores - our_scores).abs().max()
        previous, walked = ids[0, :n], []  # slot k's predecessor: the token drafted for slot k-1 (the anchor)
        for k in range(1, BLOCK):
            chosen, scores = selector.select(logits[:, k], hidden[:, k], previous)
            previous = chosen.gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
            walked.append(previous)
        proposal = ours.propose(both["our_hidden"][:, 1:], ids[0, :n], both["head"])
        assert torch.equal(proposal.tokens, torch.stack(walked, 1))
        assert not torch.equal(proposal.tokens, logits[:, 1:].argmax(-1))  # the selector changed drafts
        for layer in ours.layers:  # the convolutions count: set back to the identity, the logits move
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
    moved = forward_both_ways(theirs, ours, target, batch)["our_logits"]
    assert (moved - both["their_logits"]).abs().max() > 0.1


def test_a_speculators_dflash2_checkpoint_trains_and_decodes_losslessly(saved2, tmp_path, capsys):
    cfg = make_config({}, dict(target="tiny", data="demo", run_dir=str(tmp_path / "built"), max_steps=1,
                               telemetry=False, init_from=str(saved2)))
    drafter = build(cfg, Dist(), run_target(cfg), log=lambda line: None).drafter.drafter
    assert isinstance(drafter, DFlash2Drafter) and drafter.config.conv_kernel_size == CONV
    mine, weights = drafter.state_dict(), their_weights(saved2 / "0")
    assert set(mine) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(mine[name], tensor.to(mine[name].dtype)), name
    assert main(["train", "--target", "tiny", "--data", "demo", "--init-from", str(saved2), "--run-dir",
                 str(tmp_path / "run"), "--max-steps", "2", "--batch-size", "4", "--num-anchors", "8",
                 "--eval-prompts", "2", "--eval-max-new-tokens", "12", "--no-telemetry"]) == 0
    out = capsys.readouterr().out
    assert f"DFlash2: conv kernel {CONV} group {GROUP}, selector rank {RANK} top-{TOP_K}" in out, out
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert evals and all(e["lossless"] for e in evals), evals
    assert main(["eval", "--drafter", str(saved2), "--num-prompts", "2", "--max-new-tokens", "24", "--device",
                 "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["lossless"] is True and result["tokens_generated"] > 0, result


def test_dflash2_settings_dflash_does_not_run_are_refused_in_one_line(saved2):
    """Their DFlash2 config with one thing changed at a time, read as `--init-from` and `eval` read it."""
    from dflash.model.export import DrafterLoadError
    from dflash.model.loading import config_of_export

    real = json.loads((saved2 / "0" / "config.json").read_text())

    def without(key: str) -> dict:
        return {k: v for k, v in real.items() if k != key}

    cases = [({**real, "sliding_window_non_causal": True}, "sliding layers attend both ways inside a block"),
             (without("sliding_window_non_causal"), "sliding layers attend both ways"),  # DFlash2's default
             ({**real, "speculators_config": {**real["speculators_config"], "algorithm": "dflash"}},
              "its speculators_model_type 'dflash2' and speculators_config.algorithm 'dflash' disagree"),
             ({**real, "sample_from_anchor": True}, "(sample_from_anchor)"),
             ({**real, "conv_kernel_size": BLOCK + 1}, f"conv_kernel_size {BLOCK + 1} is longer than the block"),
             # relabelled DSpark, it reaches DSpark's reader (dspark_formats.py), which refuses its settings
             ({**real, "speculators_config": None, "speculators_model_type": "dspark"},
              "sample_from_anchor false"),
             ({**real, "speculators_config": None, "speculators_model_type": "eagle3"},
              "a speculators 'eagle3' checkpoint: dflash reads speculators' 'dflash', 'dflash2' and 'dspark' "
              "drafters only")]
    for d, needle in cases:
        with pytest.raises(DrafterLoadError) as e:
            config_of_export(d, "here")
        assert str(e.value).startswith("here: ") and needle in str(e.value) and "\n" not in str(e.value), needle
    # full layers are bidirectional in every reader: DFlash2's default says nothing about them
    full = {**real["transformer_layer_config"], "layer_types": [FULL, FULL], "use_sliding_window": False}
    cfg = config_of_export({**without("sliding_window_non_causal"), "transformer_layer_config": full}, "here")
    assert isinstance(cfg, DFlash2Config) and cfg.layer_types == [FULL, FULL]
    assert config_of_export(without("conv_group_size"), "here").conv_group_size == 16  # speculators' default


def test_our_export_converts_with_speculators_own_convert(tmp_path, target, verifier, tokens):
    """`dflash export` of a run's checkpoint, converted by speculators' `convert --algorithm dflash` (the
    entry point its CLI calls, validating on the CPU): their loader reads it with our taps + 1 and our
    weights, and its forward gives our logits. Read back by us, it is the drafter we exported."""
    from speculators.convert import convert_model

    from dflash.model.export import checkpoint_dict

    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target.config, num_layers=2, block_size=BLOCK, target_layer_ids=TAPS,
                                   mask_token_id=target.default_mask_token_id())
    ours = DFlashDrafter(DrafterConfig(**{**cfg.__dict__, "layer_types": [SLIDING, FULL], "sliding_window": WINDOW}))
    with torch.no_grad():  # norms away from their initial ones, so a norm left behind shows
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    torch.save(checkpoint_dict(ours), tmp_path / "step-1.pt")
    assert main(["export", str(tmp_path / "step-1.pt"), "--out", str(tmp_path / "export"), "--dtype", "fp32"]) == 0
    convert_model(model=str(tmp_path / "export"), verifier=str(tiny_target_dir()), algorithm="dflash",
                  output_path=str(tmp_path / "converted"), validate_device="cpu")

    converted = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert converted["aux_hidden_state_layer_ids"] == AUX  # our taps + 1, by their converter
    assert (converted["block_size"], converted["mask_token_id"]) == (BLOCK, ours.mask_token_id)
    assert converted["transformer_layer_config"]["layer_types"] == [SLIDING, FULL]
    theirs = their_model(tmp_path / "converted")
    state = theirs.state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(state[name], tensor), name
    a, b = logits_both_ways(theirs, ours, target, their_inputs(verifier, tokens))
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()
    back = load_drafter(tmp_path / "converted")  # now a speculators checkpoint: read as one
    assert back.config.target_layer_ids == TAPS
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_dflash_export_refuses_a_speculators_checkpoint(saved, tmp_path, capsys):
    line = _refused(["export", str(saved), "--out", str(tmp_path / "out")], capsys)
    assert "is a speculators checkpoint, which names its verifier but not the verifier's layer count" in line
    assert not (tmp_path / "out").exists()
