"""DSpark: the drafter's heads and settings, its objective's terms against a direct dense computation
(value and gradient, one chunk and many), and the plan that drafts from the anchor slot."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from test_drafter_release import _train, setup  # noqa: F401 (fixtures)
from test_model_helpers import one_thread  # noqa: F401 (autouse fixture)

from dflash import objectives
from dflash.cli import main
from dflash.model.blocks import forward_blocks
from dflash.model.dflash2 import build_drafter
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.dspark import DSparkConfig, DSparkDrafter
from dflash.model.export import DrafterLoadError
from dflash.model.loading import load_drafter, load_exported
from dflash.model.released import ReleaseMismatch, start_from_release
from dflash.model.write_export import export_drafter
from dflash.objectives import for_drafter
from dflash.targets import load_target
from dflash.train.config import ObjectiveSettings
from dflash.train.config.schema import make_config

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
    objective = for_drafter(ObjectiveSettings(position_weight="exp"), drafter)  # DSpark's own exp(-(k-1)/4)
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


def test_a_dspark_run_trains_evaluates_losslessly_exports_and_is_read_back(setup, tmp_path, capsys):  # noqa: F811
    """The end-to-end proof: train a tiny DSpark a few steps on the tiny target, evaluate it greedily
    (token for token the target's output) in the run, export it in each format, evaluate each export
    with `dflash eval` (greedy: lossless; sampled: by rejection sampling), and start a run from one."""
    _, target_dir, data = setup
    assert _train(setup, tmp_path / "run", drafter_type="dspark", markov_rank=8) == 0
    out = capsys.readouterr().out
    assert "DSpark: Markov head rank 8, confidence head" in out and "0.1 x ce + 0.9 x tv + confidence" in out, out
    assert "| accept 0." in out and " conf err 0." in out, out  # the step's 1 - TV and the head's error
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert evals and all(e["lossless"] for e in evals), evals
    assert len(evals[-1]["per_position_acceptance"]) == 4  # block 4 drafts 4 tokens, the anchor's slot first
    trained = load_drafter(tmp_path / "run")
    # the default format carries the target's embedding and head: refused without the target, in one line
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "x")]) == 2
    assert "give the target (--target MODEL_DIR)" in capsys.readouterr().err
    for fmt in ("deepspec", "speculators", "specforge"):
        flags = ["--target", str(target_dir)] if fmt == "deepspec" else ["--format", fmt]
        assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / fmt), "--dtype", "keep", *flags]) == 0
        text = capsys.readouterr().out
        assert f"to {tmp_path / fmt}" in text
        # the engines that load the format read it as trained, heads and backbone (engine_contracts.check_dspark)
        loads = {"deepspec": ("vllm", "sglang"), "speculators": ("vllm",), "specforge": ("sglang",)}[fmt]
        assert all(f"engine check: {e} reads the DSpark drafter as trained" in text for e in loads), text
        back = load_exported(tmp_path / fmt)
        assert all(torch.equal(v, trained.state_dict()[k]) for k, v in back.state_dict().items()), fmt
        for temperature in ("0", "0.8"):
            rc = main(["eval", "--drafter", str(tmp_path / fmt), "--target", str(target_dir), "--data", str(data),
                       "--max-new-tokens", "10", "--num-prompts", "2", "--json", "--device", "cpu",
                       "--temperature", temperature])
            text = capsys.readouterr().out
            assert rc == 0, text
            r = json.loads(text)
            assert r["lossless"] is (True if temperature == "0" else None), r
            assert len(r["per_position_acceptance"]) == 4 and sum(r["acceptance_histogram"]) == r["rounds"]
    assert json.loads((tmp_path / "deepspec" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    # a release says what it is: a run starts from it as DSpark, without --drafter-type
    assert _train(setup, tmp_path / "again", init_from=str(tmp_path / "specforge")) == 0
    assert "drafter initialised from" in capsys.readouterr().out


def test_a_dflash_release_does_not_become_dspark(tiny_target, tmp_path):
    plain = DrafterConfig.for_target(tiny_target.config, num_layers=1, block_size=4,
                                     target_layer_ids=tiny_target.layer_ids,
                                     mask_token_id=tiny_target.default_mask_token_id())
    export_drafter(DFlashDrafter(plain), tmp_path / "dflash")
    with pytest.raises(ReleaseMismatch, match="a dflash drafter, not a DSpark one .*: drop --drafter-type dspark"):
        start_from_release(tmp_path / "dflash", tiny_target, block_size=4, drafter_type="dspark")


# --------------------------------------------------------------------------------------------------
# The three formats
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_target(setup):  # noqa: F811
    return load_target(setup[1], layer_ids=[1, 3])


def trained_looking(target, seed=0) -> DSparkDrafter:
    """A DSpark drafter for the tiny target with every head weight away from its start."""
    cfg = DSparkConfig.for_target(target.config, num_layers=2, block_size=4, target_layer_ids=target.layer_ids,
                                  mask_token_id=target.default_mask_token_id())
    torch.manual_seed(seed)
    d = DSparkDrafter(DSparkConfig(**{**cfg.__dict__, "markov_rank": 8}))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return d.eval()


def target_tensors(target) -> dict:
    return {"embed_tokens.weight": target.embed_tokens.weight.detach(),
            "lm_head.weight": target.lm_head.weight.detach()}


@pytest.mark.parametrize("fmt", ["deepspec", "speculators", "specforge"])
def test_each_format_reads_back_bit_for_bit(tiny_target, tmp_path, fmt):
    d = trained_looking(tiny_target)
    export_drafter(d, tmp_path, fmt=fmt, target_tensors=target_tensors(tiny_target))
    config = json.loads((tmp_path / "config.json").read_text())
    back = load_exported(tmp_path)
    assert isinstance(back, DSparkDrafter)
    assert (back.config.block_size, back.config.markov_rank, back.config.target_layer_ids, back.config.gamma) == \
        (4, 8, [1, 3], 4.0)
    mine, theirs = d.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    if fmt == "deepspec":  # vLLM's and SGLang's loaders read these at the top level, and the target's tensors
        assert config["architectures"] == ["Qwen3DSparkModel"]
        assert (config["target_layer_ids"], config["markov_rank"], config["draft_vocab_size"]) == \
            ([1, 3], 8, tiny_target.vocab_size)
        assert config["enable_confidence_head"] and config["confidence_head_with_markov"]
        with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
            assert torch.equal(f.get_tensor("lm_head.weight"), tiny_target.lm_head.weight.detach())
    else:
        assert "lm_head.weight" not in names
    if fmt == "specforge":
        assert config["architectures"] == ["DSparkDraftModel"]
        assert config["dflash_config"]["projector_type"] == "dspark"
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias"} <= names


def test_what_cannot_be_carried_is_refused_in_one_line(tiny_target, tmp_path):
    d = trained_looking(tiny_target)
    with pytest.raises(ValueError, match="give the target"):
        export_drafter(d, tmp_path / "a")  # the default, DeepSpec's, carries the target's tensors
    assert not (tmp_path / "a").exists()  # refused before anything was written
    plain = DFlashDrafter(DrafterConfig(**{k: v for k, v in d.config.__dict__.items() if "markov" not in k}))
    with pytest.raises(ValueError, match="--format speculators is for DSpark drafters"):
        export_drafter(plain, tmp_path / "b", fmt="speculators")
    export_drafter(d, tmp_path / "c", fmt="specforge")
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    for change, says in [({"markov_head_type": "rnn"}, "'rnn' is not built here"),
                         ({"draft_vocab_size": 32}, "pruned to 32 tokens"),
                         ({"sample_from_anchor": False}, "sample_from_anchor false"),
                         ({"enable_confidence_head": False}, "without its confidence head")]:
        (tmp_path / "c" / "config.json").write_text(json.dumps({**config, "dflash_config": {
            **config["dflash_config"], **change}}))
        with pytest.raises(DrafterLoadError, match=says) as e:
            load_exported(tmp_path / "c")
        assert "\n" not in str(e.value)


def test_speculators_dspark_classes_read_our_export_and_we_read_theirs(tiny_target, tmp_path):
    """Both directions against speculators' own DSpark model: the weights bit for bit, and its Markov
    bias and confidence scores equal ours on the same states and previous tokens."""
    spec = pytest.importorskip("speculators.models.dspark")
    d = trained_looking(tiny_target)
    export_drafter(d, tmp_path / "ours", fmt="speculators")
    config = spec.DSparkSpeculatorConfig.from_pretrained(str(tmp_path / "ours"))
    assert (config.markov_rank, config.block_size, config.sample_from_anchor) == (8, 4, True)
    theirs = spec.DSparkDraftModel(config)
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        result = theirs.load_state_dict({k: f.get_tensor(k) for k in f.keys()}, strict=False)  # noqa: SIM118
    # what they hold beyond the drafter is the target's (embedding, heads, final norm)
    assert set(result.missing_keys) <= {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                                        "verifier_norm.weight"}, result.missing_keys
    assert not result.unexpected_keys
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 4, d.config.hidden_size, generator=g)
    prev = torch.randint(0, d.config.vocab_size, (3, 4), generator=g)
    base = torch.zeros(3, 4, d.config.vocab_size)
    with torch.no_grad():
        mine_logits, mine_conf = d.logits_and_confidence(base, h, prev)
        emb = theirs.markov_head.prev_embeddings(prev)
        bias = theirs.markov_head.block_bias(prev_token_ids=prev, hidden_states=h, prev_emb=emb)
        conf = theirs.confidence_head(torch.cat([h, emb], -1))
    torch.testing.assert_close(mine_logits, bias.float(), rtol=0, atol=0)
    torch.testing.assert_close(mine_conf, conf.float(), rtol=0, atol=0)
    # theirs -> ours: their save_pretrained directory loads as a drafter with their tensors
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.01)
    theirs.save_pretrained(str(tmp_path / "theirs"))
    back = load_exported(tmp_path / "theirs")
    state = theirs.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in back.state_dict().items())
    assert back.config.target_layer_ids == [1, 3] and back.config.markov_rank == 8


def test_the_recipe_defaults_and_bad_settings_on_the_command_line(setup, tmp_path, capsys):  # noqa: F811
    _, target_dir, data = setup
    base = dict(target=str(target_dir), data=str(data), run_dir=str(tmp_path / "run"), max_steps=1)
    cfg = make_config({}, {**base, "drafter_type": "dspark"})
    assert (cfg.model.block_size, cfg.model.markov_rank, cfg.model.num_anchors, cfg.optim.lr) == (7, 256, 512, 6e-4)
    assert make_config({}, {**base, "drafter_type": "dspark", "block_size": 5}).model.block_size == 5
    assert make_config({}, base).model.block_size == 16  # DFlash's own default stays
    for flags, says in [(["--markov-rank", "0"], "markov_rank must be at least 1"),
                        (["--loss", "kl"], "use --loss ce, not kl")]:
        rc = main(["train", "--target", str(target_dir), "--data", str(data), "--run-dir", str(tmp_path / "bad"),
                   "--max-steps", "1", "--no-telemetry", "--drafter-type", "dspark", *flags])
        err = capsys.readouterr().err
        assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_confidence_scheduling_cuts_where_the_running_product_falls_and_stays_lossless(tiny_target):
    from dflash.eval.speculative import Sampling, evaluate, scheduled_length

    logit = torch.logit(torch.tensor([0.9, 0.9, 0.5, 0.99]))
    assert [scheduled_length(logit, t) for t in (0.0, 0.85, 0.81, 0.5, 0.95)] == [4, 1, 1, 2, 0]
    d = trained_looking(tiny_target)
    prompts = [[5, 9, 11, 4, 7], [8, 3, 12, 6]]
    full = evaluate(d, tiny_target, prompts, max_new_tokens=12)
    assert full.mean_verified == 4 and full.confidence_threshold is None
    with torch.no_grad():  # a head that gives every slot 0.9: running survival 0.9, 0.81, 0.73, 0.66
        d.confidence_head.proj.weight.zero_()
        d.confidence_head.proj.bias.fill_(float(torch.logit(torch.tensor(0.9))))
    cut = evaluate(d, tiny_target, prompts, max_new_tokens=12, confidence_threshold=0.7)
    assert cut.lossless and cut.mean_verified == pytest.approx(3.0)
    sampled = evaluate(d, tiny_target, prompts, max_new_tokens=12, confidence_threshold=0.95,
                       sampling=Sampling(0.8, generator=torch.Generator().manual_seed(0)))
    assert sampled.mean_verified == 0 and sampled.tau == 1.0  # nothing verified: the target's own tokens
    plain = DFlashDrafter(DrafterConfig(**{k: v for k, v in d.config.__dict__.items() if "markov" not in k}))
    with pytest.raises(ValueError, match="DSpark drafter's confidence head"):
        evaluate(plain, tiny_target, prompts, max_new_tokens=4, confidence_threshold=0.5)
