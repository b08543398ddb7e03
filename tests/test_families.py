"""Every target family dflash supports, as a tiny random-weight target built from transformers' own
config class (dflash/targets/families.py): the verifier puts the target's cache back after every partial
acceptance whatever its layers are, per-layer attributes shape the drafter, and each family trains a few
steps and evaluates losslessly."""

from __future__ import annotations

import json

import pytest
import torch
from test_model_helpers import one_thread  # noqa: F401
from test_train_pipeline import _write_data

from dflash.cli import main
from dflash.data.regenerate import generate_batch
from dflash.eval.speculative import greedy_generate
from dflash.eval.verifier import CachedVerifier, new_cache, records_recurrent_states
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.targets import load_target
from dflash.targets.families import FAMILIES, SLIDING_WINDOW, build_family_target
from dflash.targets.heads import ScaledEmbedding, applied
from dflash.train.config.schema import make_config
from dflash.train.run.build import new_drafter_config
from dflash.train.trainer import train

HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # Gated DeltaNet + full attention
PROMPTS = [[4, 5, 6, 7, 8, 9, 10], [9, 10, 11], [12, 13, 14, 15, 4, 6]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The built-in target's byte-level BPE tokenizer for every family: transformers picks a family's own
    tokenizer class for some model types (Qwen3.5-MoE), and those read a BPE vocabulary, not a word list."""
    from transformers import AutoTokenizer

    from dflash.targets.tiny import tiny_target_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir())
    root = tmp_path_factory.mktemp("families")
    return {f: build_family_target(root / f, f, tokenizer) for f in FAMILIES}


@pytest.fixture(scope="module")
def targets(dirs):
    loaded = {}

    def get(family):
        if family not in loaded:
            loaded[family] = load_target(dirs[family], num_draft_layers=2)
        return loaded[family]
    return get


def _decode_with_planned_acceptance(target, prompt, reference, plan, block=4, rollback=None):
    """Drive the verifier with drafts taken from the target's own greedy output, wrong from slot
    ``plan[r] + 1`` on in round r, so round r must accept exactly ``plan[r]``; the tokens committed must
    stay the greedy output through every rollback (a cache left holding rejected tokens, or a recurrent
    state left after the whole block, changes the next round's logits). Returns the rollback used."""
    v = CachedVerifier(target, rollback, hidden=False)
    seq = [int(v.prefill(prompt).logits[-1].argmax())]
    r = 0
    while len(seq) + block <= len(reference):
        want = plan[r % len(plan)]
        drafts = list(reference[len(seq): len(seq) + block - 1])
        if want < block - 1:
            drafts[want] = (drafts[want] + 1) % target.vocab_size  # a wrong draft
        tokens = torch.tensor([seq[-1], *drafts])
        logits = v.verify(tokens).logits
        # The same logits as a forward of the whole sequence without a cache: nothing rejected before
        # is still in the cache, nothing accepted is missing.
        whole = target.model(input_ids=torch.tensor([prompt + seq[:-1] + tokens.tolist()]), use_cache=False)
        torch.testing.assert_close(logits, whole.logits[0, -block:], rtol=1e-4, atol=1e-4)
        posterior = logits.argmax(-1)
        accepted = int((tokens[1:] == posterior[:-1]).int().cumprod(0).sum())
        assert accepted == want, f"round {r}: accepted {accepted}, planned {want}"
        seq += drafts[:accepted] + [int(posterior[accepted])]
        assert seq == reference[: len(seq)], f"round {r}: left the greedy output after a rollback"
        v.commit(accepted + 1)
        r += 1
    assert len(v.ids) == len(prompt) + len(seq) - 1  # the cache holds exactly the committed tokens
    assert r * block > 2 * SLIDING_WINDOW  # the decode ran well past the sliding windows
    return v.rollback


def _records_recurrent(target) -> bool:
    """Whether the installed transformers keeps a linear layer's intermediate recurrent states (5.25+):
    then cropping alone rolls a hybrid target back, before it the recurrent state needs dflash's own way."""
    return records_recurrent_states(new_cache(target.model))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_cache_is_rolled_back_for_every_layer_kind(targets, family):
    t = targets(family)
    reference = greedy_generate(t, PROMPTS[0], 30, stop_token_ids=[])
    used = _decode_with_planned_acceptance(t, PROMPTS[0], reference, plan=[1, 0, 3, 2, 0, 3, 1])
    assert used == ("mixers" if family in HYBRID and not _records_recurrent(t) else "record")


@pytest.mark.parametrize("family,rollback", [("qwen3_5", "reprefill"), ("qwen3_5_moe", "rerun"),
                                             ("qwen3_next", "mixers"), ("gpt_oss", "rerun"),
                                             ("gpt_oss", "reprefill")])
def test_every_exact_rollback_keeps_the_greedy_output(targets, family, rollback):
    t = targets(family)
    reference = greedy_generate(t, PROMPTS[1], 26, stop_token_ids=[])
    assert _decode_with_planned_acceptance(t, PROMPTS[1], reference, [2, 0, 1], rollback=rollback) == rollback


def test_cropping_alone_is_refused_where_it_cannot_restore_the_state(targets):
    t = targets("qwen3_5")
    v = CachedVerifier(t, "record")
    if _records_recurrent(t):  # transformers 5.25+: the crop restores the recurrent state itself
        v.prefill(PROMPTS[0])
        assert v.rollback == "record"
    else:
        with pytest.raises(ValueError, match="recurrent"):
            v.prefill(PROMPTS[0])
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        CachedVerifier(targets("gpt_oss"), "mixers").prefill(PROMPTS[0])
    with pytest.raises(ValueError, match="unknown rollback"):
        CachedVerifier(targets("qwen3"), "replay")


def test_per_layer_attributes_shape_the_drafter(targets, dirs):
    """Gemma 4's head_dim is per layer (16 in its sliding layers, 32 in its full ones): reading it
    globally raised; the drafter takes what most layers have (a tie: the first layer's), from the live
    config and a saved one."""
    t = targets("gemma4")
    assert [c.head_dim for c in t.config.per_layer_config] == [16, 32, 16, 32]
    cfg = DrafterConfig.for_target(t.config, num_layers=1, mask_token_id=3)
    saved = json.loads((dirs["gemma4"] / "config.json").read_text())
    assert cfg.head_dim == DrafterConfig.for_target(saved, mask_token_id=3).head_dim == 16
    saved["per_layer_config"] = {str(i): {"head_dim": 32} for i in range(3)}
    assert DrafterConfig.for_target(saved, mask_token_id=3).head_dim == 32
    DFlashDrafter(cfg)  # builds


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_then_evaluates_losslessly(dirs, tmp_path, family, capsys):
    data = _write_data(tmp_path / "data.jsonl", rows=8)
    run = tmp_path / "run"
    cfg = make_config({}, dict(target=str(dirs[family]), data=str(data), run_dir=str(run), batch_size=4,
                               num_anchors=4, block_size=4, drafter_layers=1, telemetry=False, eval_prompts=0,
                               checkpoint_every=1e9, max_steps=3))
    assert train(cfg) == 0
    assert "done: 3 steps" in capsys.readouterr().out
    rc = main(["eval", "--drafter", str(run), "--data", str(data), "--num-prompts", "2", "--max-new-tokens", "16",
               "--json", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["lossless"] is True and report["rounds"] > 0, report


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss", "gemma4", "deepseek_v3"])
def test_regeneration_is_the_targets_greedy_output(targets, family):
    """`dflash data regenerate` decodes left-padded batches with transformers' generate (no rollback):
    each row is the target's own greedy continuation, on hybrid, windowed and MLA targets alike."""
    t = targets(family)
    eos = t.tokenizer.eos_token_id
    expected = []
    for p in PROMPTS:
        ref = greedy_generate(t, p, 14, stop_token_ids=[eos])
        expected.append(ref[: ref.index(eos)] if eos in ref else ref)
    assert generate_batch(t, PROMPTS, 14) == expected


@pytest.mark.parametrize("family", list(FAMILIES))
def test_taps_embedding_and_head_are_where_the_target_has_them(targets, family):
    """Tap layer i is decoder layer i's own output for every family — output_hidden_states[i + 1] for
    the inner layers, and for the last one its input to the final norm (transformers puts the normed
    states last); the frozen embedding is what the first layer reads (Gemma scales it) and the frozen
    head turns the final states into the model's own logits (Gemma soft-caps them)."""
    t = targets(family)
    layers = t.model.get_decoder().layers
    seen: dict = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, layer in enumerate(layers)]
    hooks.append(layers[0].register_forward_pre_hook(
        lambda m, a, kw: seen.__setitem__("input", kw.get("hidden_states", a[0] if a else None)), with_kwargs=True))
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])
    try:
        out = t.model(input_ids=ids, output_hidden_states=True)
        every = [seen[i] for i in range(t.num_layers)]
        taps = t.replica("cpu").tap_states(ids)  # the trainer's path
    finally:
        for h in hooks:
            h.remove()
    plain = load_target(t.path, layer_ids=list(range(t.num_layers)))
    torch.testing.assert_close(plain.tap_states(ids), torch.cat(every, -1))
    torch.testing.assert_close(taps, torch.cat([every[i] for i in t.layer_ids], -1))
    # the trainer's forward keeps the tap layers' outputs alone, not every layer's (output_hidden_states)
    decoded: list = []
    probe = t.model.get_decoder().register_forward_hook(lambda m, a, o: decoded.append(o.hidden_states))
    try:
        t.tap_states(ids, final=True)
    finally:
        probe.remove()
    assert decoded == [None]
    for i in range(t.num_layers - 1):
        torch.testing.assert_close(out.hidden_states[i + 1], every[i])
    embed, head = t.frozen_head("cpu")
    torch.testing.assert_close(embed(ids), seen["input"])
    final = t.model.get_decoder()(input_ids=ids).last_hidden_state
    torch.testing.assert_close(head(final), out.logits)
    # and what a DFlash2 export records of them for the engines is what they apply
    scale, cap = applied(embed, head)
    torch.testing.assert_close(embed(ids), torch.nn.functional.embedding(ids, embed.weight) * scale)
    assert cap == getattr(t.config, "final_logit_softcapping", None)


def test_a_dflash2_drafter_records_the_scale_and_cap_the_gemma_target_applies(targets, dirs):
    """What a DFlash2 export tells the engines for a Gemma target trained in process: the sqrt(hidden) its
    embedding applies (transformers' own module, which keeps the scale inside) and its soft-cap."""
    t = targets("gemma4")
    cfg = make_config({}, dict(target=str(dirs["gemma4"]), drafter_type="dflash2", drafter_layers=1, block_size=4))
    drafter, _ = new_drafter_config(cfg, t)
    assert drafter.input_embedding_scale == pytest.approx(t.hidden_size ** 0.5) == 8.0
    assert drafter.final_logit_softcapping == 30.0


def test_a_bf16_gemma_embedding_records_the_scale_it_was_given():
    """transformers' Gemma embedding, cast to bf16 with its model, holds sqrt(hidden) rounded (50.5 for 2560);
    what a DFlash2 export records and a release is checked against is the float, whether the target runs in
    process or from a cache (ours, built from the config)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    hidden = 2560
    theirs = Gemma3TextScaledWordEmbedding(8, hidden, 0, embed_scale=hidden ** 0.5).to(torch.bfloat16)
    assert float(theirs.embed_scale) == 50.5
    head = torch.nn.Linear(hidden, 8, bias=False)
    ours = ScaledEmbedding(torch.nn.Embedding(8, hidden), hidden ** 0.5)
    assert applied(theirs, head)[0] == applied(ours, head)[0] == hidden ** 0.5


def test_a_slow_fallback_is_said_with_the_extra_that_avoids_it(targets, dirs, capsys):
    """Without flash-linear-attention (not installed here), transformers runs Gated DeltaNet on a slow
    PyTorch fallback: the target's start-up line says so and names the extra; other families say nothing."""
    note = "linear_attention layers run transformers' slow PyTorch fallback without flash-linear-attention"
    assert note in targets("qwen3_next").describe() and "[linear-attention]" in targets("qwen3_next").describe()
    assert "fallback" not in targets("gpt_oss").describe()
    data = dirs["qwen3_5"] / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "def f(x):", "response": "return x"}) + "\n")
    assert main(["data", "regenerate", "--target", str(dirs["qwen3_5"]), "--data", str(data),
                 "--out", str(data.with_suffix(".out.jsonl")), "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().err.count(note) == 1
