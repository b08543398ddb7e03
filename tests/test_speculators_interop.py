"""Our caches read by speculators' own code, and theirs by ours (skipped when speculators is not installed):
bf16/fp32 caches, and FP8 ones against hs-connectors' FP8 backend (its quantiser, its connector's write
step, its ``FP8Transfer`` reader).

speculators installs beside this venv's torch without vLLM: ``make speculators`` (``--no-deps``: its pins
would replace this venv's datasets/transformers)."""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import types

import pytest
import torch

try:
    from speculators.train.dataloader import create_train_val_loaders
except ImportError as e:  # one line: why the cross-tests do not run here
    pytest.skip(f"speculators not importable ({e}); `make speculators` installs it", allow_module_level=True)

from hs_connectors import FP8Transfer, HiddenStatesBackend
from hs_connectors.fp8_utils import SCALES_KEY, dequantize_fp8_tensor, quantize_tensor_to_fp8
from safetensors.torch import load_file

from dflash.cli import main
from dflash.data.cache_format import SIDECAR, CacheMeta, read_rows, read_sample, read_stored, sample_path

torch.set_num_threads(1)
ROWS = 6


def _cache(out, *flags: str):
    assert main(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(out), "--max-samples",
                 str(ROWS), "--batch-size", "4", "--no-telemetry", *flags]) == 0
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return _cache(tmp_path_factory.mktemp("cache") / "c")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return _cache(tmp_path_factory.mktemp("cache") / "fp8", "--dtype", "fp8")


def _their_transfer(backend: str, root):
    """The reader `speculators train --hidden-states-backend BACKEND` builds for data at ``root``."""
    return HiddenStatesBackend.registry[backend].from_train_args(argparse.Namespace(hidden_states_path=None),
                                                                 str(root))


def _loaders(cache_dir, total_seq_len: int, hidden: int, taps: int, transfer=None):
    return create_train_val_loaders(
        data_path=str(cache_dir), total_seq_len=total_seq_len, hidden_states_dtype=torch.float32, transfer=transfer,
        vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path="tiny",
        request_timeout=1.0, max_retries=0, generation_validation_retries=0,
        max_consecutive_generation_failures=1, hidden_size=hidden, num_target_layers=taps, num_workers=0,
        prefetch_factor=None, preprocess=None, train_data_ratio=0.5)


def test_the_data_set_is_saved_as_speculators_saves_it(cache_dir):
    state = json.loads((cache_dir / "state.json").read_text())
    assert state["_format_type"] == "torch"  # what their preprocessing's set_format(type="torch") saves


@pytest.mark.parametrize("backend", ["file", "fp8"])
def test_speculators_loader_reads_our_cache(cache_dir, fp8_dir, backend):
    """Our fp32 cache through their default backend, our FP8 one through their FP8 backend (which
    dequantises into bf16 unless told otherwise): the states our reader gives, bit for bit."""
    root = {"file": cache_dir, "fp8": fp8_dir}[backend]
    meta = CacheMeta.read(root)
    assert meta.dtype == {"file": "float32", "fp8": "float8_e4m3fn"}[backend]
    taps, rows = len(meta.target_layer_ids), read_rows(root)
    hidden = meta.hidden_size
    longest = max(len(r.input_ids) for r in rows)
    train, val = _loaders(root, longest, hidden, taps, _their_transfer(backend, root))
    # each split on its own, samples in any order: every one must be ours, bit for bit
    for loader, split in ((train, range(0, ROWS // 2)), (val, range(ROWS // 2, ROWS))):
        ds = loader.dataset
        assert len(ds) == len(split)
        for j, i in enumerate(split):
            item = ds[j]
            hs, ids = read_sample(sample_path(root, i), fp8_as=torch.bfloat16)
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


def _their_rows(cache_dir, theirs) -> None:
    """Our rows as their preprocessing builds and saves them (no sidecar of ours)."""
    from datasets import Dataset
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    rows = read_rows(cache_dir)
    raw = Dataset.from_dict({"input_ids": [r.input_ids for r in rows], "loss_mask": [r.loss_mask for r in rows]})
    build_speculator_training_dataset(raw, None, max_length=4096, num_proc=1).save_to_disk(str(theirs))
    assert read_rows(theirs) == rows and not (theirs / SIDECAR).exists()


def _train_from(cache_dir, theirs, run_dir) -> None:
    taps = ",".join(str(i) for i in CacheMeta.read(cache_dir).target_layer_ids)
    assert main(["train", "--target", "tiny", "--hidden-states", str(theirs), "--run-dir", str(run_dir),
                 "--max-steps", "2", "--batch-size", "4", "--num-anchors", "8", "--eval-prompts", "0",
                 "--no-telemetry", "--target-layer-ids", taps]) == 0


def test_dflash_trains_from_a_cache_in_speculators_layout(cache_dir, tmp_path):
    """Their rows as their preprocessing builds and saves them, the engine's files, no sidecar of ours."""
    theirs = tmp_path / "theirs"
    shutil.copytree(sample_path(cache_dir, 0).parent, sample_path(theirs, 0).parent)
    _their_rows(cache_dir, theirs)
    _train_from(cache_dir, theirs, tmp_path / "run")


# --- FP8 -----------------------------------------------------------------------------------------

def test_our_fp8_files_are_what_their_quantiser_writes(cache_dir, fp8_dir):
    """Their quantiser on the states of our fp32 cache gives the bytes `--dtype fp8` wrote; their
    ``FP8Transfer`` dequantises our files to what our reader gives, in bf16 and in fp32."""
    for i in range(ROWS):
        states, _ = read_sample(sample_path(cache_dir, i))
        q, scales = quantize_tensor_to_fp8(states)
        ours = load_file(str(sample_path(fp8_dir, i)))
        assert set(ours) == {"hidden_states", SCALES_KEY, "token_ids"}
        assert torch.equal(ours["hidden_states"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(ours[SCALES_KEY], scales) and ours[SCALES_KEY].dtype == torch.float32
    for dtype in (torch.bfloat16, torch.float32):
        transfer = FP8Transfer(sample_path(fp8_dir, 0).parent, dequantize_dtype=dtype)
        for i in range(ROWS):
            got = transfer.get_cached(i)
            hs, ids = read_sample(sample_path(fp8_dir, i), fp8_as=dtype)
            assert set(got) == {"hidden_states", "token_ids"} and got["hidden_states"].dtype == dtype
            assert torch.equal(got["hidden_states"], hs) and torch.equal(got["token_ids"], ids)


def test_their_fp8_reader_reads_our_per_tap_scales(tmp_path, cache_dir):
    """`--fp8-scales tap` (dflash's own option, not a layout they write): their ``FP8Transfer`` multiplies
    by the scales as they broadcast, so it reads our files to what our reader gives, in bf16 and fp32."""
    tap_dir = _cache(tmp_path / "tap", "--dtype", "fp8", "--fp8-scales", "tap")
    for i in range(ROWS):
        raw = load_file(str(sample_path(tap_dir, i)))
        assert raw[SCALES_KEY].shape == (raw["hidden_states"].shape[0], raw["hidden_states"].shape[1], 1)
        ref, _ = read_sample(sample_path(cache_dir, i))
        got, _ = read_sample(sample_path(tap_dir, i))
        assert ((got - ref).norm(dim=-1) <= ref.norm(dim=-1) / 16).all()  # e4m3 per tap, every slot
    for dtype in (torch.bfloat16, torch.float32):
        transfer = FP8Transfer(sample_path(tap_dir, 0).parent, dequantize_dtype=dtype)
        for i in range(ROWS):
            hs, ids = read_sample(sample_path(tap_dir, i), fp8_as=dtype)
            got = transfer.get_cached(i)
            assert torch.equal(got["hidden_states"], hs) and torch.equal(got["token_ids"], ids)


@pytest.fixture
def their_fp8_writer(request):
    """The write step of hs-connectors' FP8 connector (``FP8HiddenStatesConnector._write_tensors``: quantise,
    add the scales, ``save_file``), their own code. Its module subclasses vLLM's example connector, whose
    code the write step does not use; where vLLM is not installed (here) an empty class stands in for
    that base during the import, and the module is dropped again after the test."""
    name = "hs_connectors.fp8_hidden_states_connector"
    saved = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.") or k == name}
    try:
        import vllm  # noqa: F401
    except ImportError:
        base = "vllm.distributed.kv_transfer.kv_connector.v1"
        parts = base.split(".")
        for k in range(1, len(parts) + 1):
            sys.modules[".".join(parts[:k])] = types.ModuleType(".".join(parts[:k]))
        stand_in = types.ModuleType(f"{base}.example_hidden_states_connector")
        stand_in.ExampleHiddenStatesConnector = type("ExampleHiddenStatesConnector", (), {})
        sys.modules[base].example_hidden_states_connector = stand_in
        sys.modules[stand_in.__name__] = stand_in

    def restore():
        for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.") or k == name]:
            del sys.modules[k]
        sys.modules.update(saved)
        if name not in saved:
            vars(sys.modules["hs_connectors"]).pop("fp8_hidden_states_connector", None)

    request.addfinalizer(restore)
    connector = importlib.import_module(name).FP8HiddenStatesConnector

    def write(path, hidden, token_ids):
        path.parent.mkdir(parents=True, exist_ok=True)
        # the event the connector waits on before reading the states (a device copy there; done here)
        connector._write_tensors({"hidden_states": hidden, "token_ids": token_ids}, torch.Event("cpu"), str(path),
                                 None)
    return write


def test_dflash_reads_and_trains_from_their_fp8_files(cache_dir, tmp_path, their_fp8_writer, capsys):
    """Their connector's FP8 files of our target's states (no sidecar): our reader dequantises them as
    their own reader does, and `dflash train --hidden-states` trains from them."""
    theirs = tmp_path / "theirs"
    for i in range(ROWS):
        states, ids = read_sample(sample_path(cache_dir, i))
        their_fp8_writer(sample_path(theirs, i), states, ids)
    _their_rows(cache_dir, theirs)
    for i in range(ROWS):
        raw = load_file(str(sample_path(theirs, i)))
        for dtype in (torch.float32, torch.bfloat16):
            hs, ids = read_sample(sample_path(theirs, i), fp8_as=dtype)
            assert torch.equal(hs, dequantize_fp8_tensor(raw["hidden_states"], raw[SCALES_KEY], dtype=dtype))
            assert torch.equal(ids, raw["token_ids"])
        q, _, scales = read_stored(sample_path(theirs, i))
        assert q.dtype == torch.float8_e4m3fn and scales.shape == (len(ids), 1, 1)
    capsys.readouterr()
    _train_from(cache_dir, theirs, tmp_path / "run")
    assert "float8_e4m3fn with per-token scales (FP8)" in capsys.readouterr().out  # what the run assumed
