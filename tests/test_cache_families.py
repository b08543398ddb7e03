"""A cache of a target that transforms its embeddings and logits (Gemma: embedding times sqrt(hidden),
logits soft-capped): the cache target applies them from the config alone, as the loaded model does."""

from __future__ import annotations

import pytest
import torch

from dflash.cli import main
from dflash.data.cache_format import read_sample, sample_path

pytestmark = pytest.mark.slow
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from transformers import AutoTokenizer

    from dflash.targets.families import build_family_target
    from dflash.targets.tiny import tiny_target_dir

    root = tmp_path_factory.mktemp("gemma")
    target = build_family_target(root / "gemma4", "gemma4", AutoTokenizer.from_pretrained(tiny_target_dir()))
    assert main(["data", "cache", "--target", str(target), "--data", "demo", "--out", str(root / "hs"),
                 "--max-samples", "3", "--max-seq-len", "64", "--target-layer-ids", "0,2", "--no-telemetry"]) == 0
    return target, root / "hs"


def test_the_cache_applies_gemmas_embedding_scale_and_soft_cap(gemma):
    from dflash.targets import load_target
    from dflash.targets.cache import load_cache_target

    model_dir, hs = gemma
    loaded = load_target(model_dir, layer_ids=[0, 2])
    cached = load_cache_target(hs, str(model_dir), None, None, torch.device("cpu"))
    try:
        assert cached.layer_ids == [0, 2] and cached.config.final_logit_softcapping
        ids = torch.tensor([[4, 5, 6, 7]])
        h = torch.randn(1, 4, loaded.hidden_size, generator=torch.Generator().manual_seed(0))
        (e1, h1), (e2, h2) = loaded.frozen_head("cpu"), cached.frozen_head("cpu")
        torch.testing.assert_close(e2(ids), e1(ids))
        torch.testing.assert_close(h2(h), h1(h))
        assert not torch.allclose(e2(ids), cached.embed_tokens(ids))  # the scale is really there
        # and the cached taps are the loaded model's own
        states, tokens = read_sample(sample_path(hs, 0))
        torch.testing.assert_close(states[:, :2].reshape(len(tokens), -1), loaded.tap_states(tokens[None])[0],
                                   rtol=1e-4, atol=1e-4)
    finally:
        cached.close()
