"""Our caches read by speculators' own code, and theirs by ours (skipped when speculators is not installed).

speculators installs beside this venv's torch without vLLM: ``make speculators`` (``--no-deps``: its pins
would replace this venv's datasets/transformers)."""

from __future__ import annotations

import json

import pytest
import torch

try:
    from speculators.train.dataloader import create_train_val_loaders
except ImportError as e:  # one line: why the cross-tests do not run here
    pytest.skip(f"speculators not importable ({e}); `make speculators` installs it", allow_module_level=True)

from dflash.cli import main
from dflash.data.cache_format import SIDECAR, CacheMeta, read_rows, read_sample, sample_path

torch.set_num_threads(1)
ROWS = 6


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "c"
    assert main(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(out), "--max-samples",
                 str(ROWS), "--batch-size", "4", "--no-telemetry"]) == 0
    return out


def _loaders(cache_dir, total_seq_len: int, hidden: int, taps: int):
    return create_train_val_loaders(
        data_path=str(cache_dir), total_seq_len=total_seq_len, hidden_states_dtype=torch.float32,
        vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path="tiny",
        request_timeout=1.0, max_retries=0, generation_validation_retries=0,
        max_consecutive_generation_failures=1, hidden_size=hidden, num_target_layers=taps, num_workers=0,
        prefetch_factor=None, preprocess=None, train_data_ratio=0.5)


def test_the_data_set_is_saved_as_speculators_saves_it(cache_dir):
    state = json.loads((cache_dir / "state.json").read_text())
    assert state["_format_type"] == "torch"  # what their preprocessing's set_format(type="torch") saves


def test_speculators_loader_reads_our_cache(cache_dir):
    meta = CacheMeta.read(cache_dir)
    taps, rows = len(meta.target_layer_ids), read_rows(cache_dir)
    first, _ = read_sample(sample_path(cache_dir, 0))
    hidden = first.shape[-1]
    longest = max(len(r.input_ids) for r in rows)
    train, val = _loaders(cache_dir, longest, hidden, taps)
    # each split on its own, samples in any order: every one must be ours, bit for bit
    for loader, split in ((train, range(0, ROWS // 2)), (val, range(ROWS // 2, ROWS))):
        ds = loader.dataset
        assert len(ds) == len(split)
        for j, i in enumerate(split):
            item = ds[j]
            hs, ids = read_sample(sample_path(cache_dir, i))
            assert torch.equal(item["input_ids"], ids)
            assert torch.equal(item["hidden_states"], hs[:, :-1].flatten(1))
            assert torch.equal(item["verifier_last_hidden_states"], hs[:, -1])
            assert item["loss_mask"].tolist() == rows[i].loss_mask
        seen = 0
        for batch in loader:
            assert batch["hidden_states"].shape == (1, longest, taps * hidden)
            assert batch["verifier_last_hidden_states"].shape == (1, longest, hidden)
            assert batch["input_ids"].shape == batch["loss_mask"].shape == (1, longest)
            assert batch["error_records"] == 0  # no sample dropped as unreadable or mismatched
            seen += int(batch["document_ids"].max()) + 1
        assert seen == len(split)


def test_dflash_trains_from_a_cache_in_speculators_layout(cache_dir, tmp_path):
    """Their rows as their preprocessing builds and saves them, the engine's files, no sidecar of ours."""
    import shutil

    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    meta, rows = CacheMeta.read(cache_dir), read_rows(cache_dir)
    theirs = tmp_path / "theirs"
    shutil.copytree(sample_path(cache_dir, 0).parent, sample_path(theirs, 0).parent)
    raw = Dataset.from_dict({"input_ids": [r.input_ids for r in rows], "loss_mask": [r.loss_mask for r in rows]})
    built = build_speculator_training_dataset(raw, None, max_length=4096, num_proc=1)
    built.save_to_disk(str(theirs))
    assert read_rows(theirs) == rows and not (theirs / SIDECAR).exists()
    taps = ",".join(str(i) for i in meta.target_layer_ids)
    assert main(["train", "--target", "tiny", "--hidden-states", str(theirs), "--run-dir", str(tmp_path / "run"),
                 "--max-steps", "2", "--batch-size", "4", "--num-anchors", "8", "--eval-prompts", "0",
                 "--no-telemetry", "--target-layer-ids", taps]) == 0
