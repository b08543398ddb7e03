"""The target seam (dflash/targets/): one interface for whatever produces hidden states, checked on the
built-in tiny target and on a tiny random-weight transformers model, and build() driving any producer."""

from __future__ import annotations

import pytest
import torch
from test_model_helpers import make_target_dir, make_tokenizer, one_thread  # noqa: F401

from dflash.data import Sample
from dflash.targets import (
    LAYER_ID_CONVENTION,
    Target,
    TargetError,
    hidden_states_index,
    load_target,
    make_target,
)
from dflash.targets.hf import HFTarget
from dflash.telemetry.wire.vocab import Role
from dflash.train.config import TrainConfig
from dflash.train.config.schema import updated
from dflash.train.distributed import Dist
from dflash.train.run.build import TrainError, build
from dflash.train.run.stages import BatchSource


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    random_dir = make_target_dir(tmp_path_factory.mktemp("t") / "qwen3", "qwen3", layers=6, tokenizer=make_tokenizer())
    return {"tiny": load_target("tiny", num_draft_layers=3), "random": load_target(random_dir, num_draft_layers=3)}


def rows(vocab: int, n: int = 6, length: int = 40, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(4, vocab, (length - i,), generator=g).tolist(), [0] * 10 + [1] * (length - i - 10))
            for i in range(n)]


@pytest.mark.parametrize("name", ["tiny", "random"])
def test_interface(targets, name):
    """What every consumer reads: sizes from the config, taps by the reference's convention, the frozen
    embedding and head applied exactly as the model applies them, and a verifier."""
    t = targets[name]
    assert isinstance(t, Target) and t.span_category == "target_forward"
    assert (t.num_layers, t.hidden_size) == (t.config.num_hidden_layers, t.config.hidden_size)
    assert t.vocab_size == t.config.vocab_size and t.dtype == torch.float32 and t.device == torch.device("cpu")
    assert t.tokenizer is not None and t.verifier is t and t.replica("cpu") is t
    assert 0 <= t.default_mask_token_id() < t.vocab_size and t.stop_token_ids()

    batch = BatchSource(rows(t.vocab_size), batch_size=3, seed=1, pad_id=0)(0)
    assert len(batch.sample_ids) == 3
    hs = t.hidden_states(batch)
    assert hs.shape == (*batch.input_ids.shape, len(t.layer_ids) * t.hidden_size)
    with torch.no_grad():
        out = t.model(batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True)
    want = torch.cat([out.hidden_states[hidden_states_index(i)] for i in t.layer_ids], -1)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(hs[real], want[real], rtol=1e-4, atol=1e-4)

    embed, head = t.frozen_head("cpu")
    torch.testing.assert_close(embed(batch.input_ids), t.model.get_input_embeddings()(batch.input_ids))
    with torch.no_grad():  # the final norm's output (output_hidden_states ends with the last layer's own)
        final = t.model.get_decoder()(batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        torch.testing.assert_close(head(final)[real], out.logits[real], rtol=1e-4, atol=1e-4)


def test_layer_id_convention():
    assert [hidden_states_index(i) for i in (0, 5)] == [1, 6]
    assert "output_hidden_states[i + 1]" in LAYER_ID_CONVENTION


def test_bad_tap_layers_name_the_convention(targets):
    with pytest.raises(TargetError) as e:
        HFTarget(targets["random"].model, None, [6])
    assert "\n" not in str(e.value) and LAYER_ID_CONVENTION in str(e.value)


def test_make_target_reads_the_run_settings():
    cfg = updated(TrainConfig(), target="tiny", drafter_layers=2)
    t = make_target(cfg, "cpu")
    assert t.num_layers == 6 and len(t.layer_ids) == 2
    assert make_target(updated(cfg, target_layer_ids=[1, 4]), "cpu").layer_ids == [1, 4]


class StoredStates(Target):
    """Hidden states looked up by sample instead of computed: what an offline cache does, written with
    nothing but the interface (it has the target's embedding and head, and no verifier)."""

    span_category = "cache_read"

    def __init__(self, source: HFTarget, states: dict[int, torch.Tensor]):
        super().__init__(source.tokenizer, source.config, source.layer_ids, source.embed_tokens, source.lm_head)
        self.states = states

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def replica(self, device):
        return self

    def hidden_states(self, batch):
        width = batch.input_ids.shape[1]
        out = torch.zeros(len(batch.sample_ids), width, len(self.layer_ids) * self.hidden_size)
        for row, sid in enumerate(batch.sample_ids):
            out[row, :len(self.states[sid])] = self.states[sid]
        return out


def step_loss(target: Target, samples: list[Sample], **settings):
    cfg = updated(TrainConfig(), max_steps=1, batch_size=3, num_anchors=4, block_size=4, drafter_layers=2,
                  **settings)
    parts = build(cfg, Dist(), target, samples=samples, log=lambda s: None)
    assert parts.target is target and parts.targets[0].target is target
    hb = parts.targets[0](parts.source(0))
    loss = float(parts.drafter.step(hb, 0.0).out.loss.detach())
    return loss, parts.stats.drain()


def test_build_takes_any_target(targets):
    """build() drives whatever it is given: training on states stored per sample gives the very loss
    training on the model gives, and the first stage's spans say which one ran."""
    hf = load_target("tiny", num_draft_layers=2)
    samples = rows(hf.vocab_size)
    stored = {i: hf.tap_states(torch.tensor([s.input_ids]))[0] for i, s in enumerate(samples)}
    online, online_summary = step_loss(hf, samples)
    cached, cached_summary = step_loss(StoredStates(hf, stored), samples)
    assert cached == pytest.approx(online, rel=1e-5)
    assert "target_forward" in online_summary.workers["target-0"]
    assert "cache_read" in cached_summary.workers["target-0"]
    assert "target_forward" not in cached_summary.workers["target-0"]
    # Roles come from the vocabulary, registered with the workers, whatever the first stage does.
    want = {"batch-producer": Role.DATA, "target-0": Role.TARGET, "drafter-0": Role.DRAFTER}
    assert online_summary.roles == cached_summary.roles == want


def test_init_from_target_needs_a_verifier(targets):
    hf = targets["tiny"]
    with pytest.raises(TrainError, match="--init-from-target"):
        build(updated(TrainConfig(), max_steps=1, init_from_target=True), Dist(), StoredStates(hf, {}),
              samples=rows(hf.vocab_size), log=lambda s: None)


def test_a_target_that_cannot_decode_refuses_in_training_evaluation_unless_eval_target_names_one(targets, tmp_path):
    hf = targets["tiny"]
    stored, samples, lines = StoredStates(hf, {}), rows(hf.vocab_size), []
    cfg = updated(TrainConfig(), max_steps=1, eval_every=30.0)
    with pytest.raises(TrainError) as e:
        build(cfg, Dist(), stored, samples=samples, log=lines.append)
    assert "\n" not in str(e.value) and "--eval-target" in str(e.value) and "--eval-every" in str(e.value)
    # Without --eval-every only the final evaluation is missing, and the start says so.
    parts = build(updated(cfg, eval_every=0.0), Dist(), stored, samples=samples, log=lines.append)
    assert parts.verifier is None and any("no final evaluation" in line for line in lines)
    # --eval-target names a model that decodes; one of another shape is refused in one line.
    parts = build(updated(cfg, eval_target="tiny"), Dist(), stored, samples=samples, log=lines.append)
    assert isinstance(parts.verifier, HFTarget) and parts.verifier.layer_ids == hf.layer_ids
    other = make_target_dir(tmp_path / "other", "qwen3", layers=6)
    with pytest.raises(TrainError, match="is not the target") as e:
        build(updated(cfg, eval_target=str(other)), Dist(), stored, samples=samples, log=lines.append)
    assert "\n" not in str(e.value)
    # An in-process target is its own verifier.
    assert build(cfg, Dist(), hf, samples=samples, log=lines.append).verifier is hf


def test_the_last_tap_is_the_last_layers_own_output_where_transformers_ties_it_to_the_final_norm() -> None:
    """transformers 5.17 (the lent GPU machine's) puts the final-normed states last whatever the config
    says, and the target's load-time probe puts the last layer's own output back; a transformers that
    honours the flag ties again when it is switched back on, and the probe must notice that too."""
    target = load_target("tiny")
    last = target.num_layers - 1
    target._decoder.config.tie_last_hidden_states = True
    ids = torch.tensor([[4, 5, 6, 7, 8, 9]])
    layer_out: dict = {}
    hook = target._decoder.layers[last].register_forward_hook(
        lambda m, a, o: layer_out.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    try:
        tied = target._decoder(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[-1]
        if not torch.equal(tied, layer_out["h"]):  # (else the flag is ignored and the load already untied it)
            assert not torch.allclose(tied, layer_out["h"])  # the normed states: what a tap must not be
            target._untie_last_hidden_state()
        untied = target._decoder(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states[-1]
        torch.testing.assert_close(untied, layer_out["h"], rtol=0, atol=0)
        # the whole model too (the verifier's and eval's path)
        whole = target.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(whole, layer_out["h"], rtol=0, atol=0)
    finally:
        hook.remove()
