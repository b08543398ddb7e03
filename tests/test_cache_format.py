"""The offline cache's files: written and read in the engines' layout, every bad file one line."""

from __future__ import annotations

import fcntl
import os
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.data.cache_format import (
    SIDECAR,
    CacheError,
    CacheMeta,
    cache_bytes,
    check_finite,
    is_ready,
    read_header,
    read_rows,
    read_sample,
    sample_path,
    write_rows,
    write_sample,
)
from dflash.data.cache_writer import rank_share
from dflash.data.formats import Sample

torch.set_num_threads(1)


def _sample(seq: int = 7, slots: int = 4, hidden: int = 8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seq)
    return torch.randn(seq, slots, hidden, generator=g).to(dtype), torch.arange(seq, dtype=torch.int64) + 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sample_round_trip_matches_safetensors(tmp_path, dtype):
    hs, ids = _sample(dtype=dtype)
    path = sample_path(tmp_path, 3)
    write_sample(path, hs, ids)
    assert path.name == "hs_3.safetensors" and path.parent.name == "hidden_states"
    assert [p.name for p in path.parent.iterdir()] == ["hs_3.safetensors"]  # no temporary left behind
    got_hs, got_ids = read_sample(path)
    assert got_hs.dtype == dtype and torch.equal(got_hs, hs) and torch.equal(got_ids, ids)
    # what speculators reads with safetensors' own loader
    ref = load_file(str(path))
    assert set(ref) == {"hidden_states", "token_ids"} and ref["token_ids"].dtype == torch.int64
    assert torch.equal(ref["hidden_states"], hs)


def test_a_vllm_written_file_reads(tmp_path):
    """vLLM's connector calls save_file on {hidden_states, token_ids} (token ids from a Python list)."""
    hs, _ = _sample(seq=5, dtype=torch.bfloat16)
    path = tmp_path / "hidden_states" / "hs_0.safetensors"
    path.parent.mkdir()
    save_file({"hidden_states": hs, "token_ids": torch.tensor([9, 8, 7, 6, 5])}, str(path))
    got_hs, got_ids = read_sample(path)
    assert torch.equal(got_hs, hs) and got_ids.tolist() == [9, 8, 7, 6, 5]


def test_truncated_file_is_one_line(tmp_path):
    path = sample_path(tmp_path, 0)
    write_sample(path, *_sample())
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CacheError, match=r"hs_0\.safetensors: truncated") as e:
        read_sample(path)
    assert "\n" not in str(e.value)
    path.write_bytes(data[:5])
    with pytest.raises(CacheError, match="truncated"):
        read_sample(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CacheError, match="truncated or not a safetensors file"):
        read_header(path)


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(CacheError, match=r"hs_4\.safetensors: missing; rerun `dflash data cache`"):
        read_sample(sample_path(tmp_path, 4))


def test_wrong_tensors_and_shapes(tmp_path):
    path = sample_path(tmp_path, 0)
    path.parent.mkdir()
    save_file({"hidden_states": torch.zeros(4, 8)}, str(path))
    with pytest.raises(CacheError, match="no 'token_ids' tensor"):
        read_sample(path)
    save_file({"hidden_states": torch.zeros(4, 8), "token_ids": torch.zeros(4, dtype=torch.int64)}, str(path))
    with pytest.raises(CacheError, match=r"hidden_states has shape \[4, 8\], expected \[seq, layers, hidden\]"):
        read_sample(path)
    save_file({"hidden_states": torch.zeros(4, 2, 8), "token_ids": torch.zeros(5, dtype=torch.int64)}, str(path))
    with pytest.raises(CacheError, match="does not match hidden_states' 4 positions"):
        read_sample(path)


def test_non_finite_states_name_their_slots(tmp_path):
    hs, _ = _sample()
    check_finite(hs, tmp_path)  # finite: nothing to say
    hs[2, 1, 0] = float("nan")
    hs[5, 3, 4] = float("inf")
    with pytest.raises(CacheError, match=r"2 non-finite values \(NaN/inf\) in layer slots \[1, 3\]"):
        check_finite(hs, tmp_path / "hs_0.safetensors")


def test_a_locked_file_is_not_ready(tmp_path):
    """vLLM holds an exclusive flock on <file>.lock until its write ends."""
    path = sample_path(tmp_path, 0)
    assert not is_ready(path)
    write_sample(path, *_sample())
    assert is_ready(path)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert not is_ready(path)
    finally:
        os.close(fd)  # releases the lock, as the connector's writer thread does
    assert is_ready(path)


def test_sidecar_round_trip_and_engine_ids(tmp_path):
    meta = CacheMeta(target="tiny", num_hidden_layers=6, hidden_size=192, config_sha256="c", tokenizer_sha256="t",
                     target_layer_ids=[1, 2, 3], dtype="float32", rows=10)
    assert meta.aux_hidden_state_layer_ids == [2, 3, 4] and meta.slots == 4
    assert CacheMeta.read(tmp_path) is None
    meta.write(tmp_path)
    assert CacheMeta.read(tmp_path) == meta
    (tmp_path / SIDECAR).write_text("{not json")
    with pytest.raises(CacheError, match="unreadable sidecar"):
        CacheMeta.read(tmp_path)


def test_rows_in_the_datasets_layout(tmp_path):
    samples = [Sample([1, 2, 3], [0, 1, 1]), Sample([4, 5], [1, 1])]
    write_rows(tmp_path, samples)
    from datasets import load_from_disk

    ds = load_from_disk(str(tmp_path))  # what speculators' ArrowDataset opens
    assert ds.column_names == ["input_ids", "loss_mask", "seq_len"] and ds["seq_len"] == [3, 2]
    assert read_rows(tmp_path) == samples
    with pytest.raises(CacheError, match="no such directory"):
        read_rows(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CacheError, match=r"no data set \(state.json\) here"):
        read_rows(empty)


def test_rank_shares_cover_the_rows_once():
    shares = [rank_share(10, None, 3, r) for r in range(3)]
    assert [list(s) for s in shares] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert list(rank_share(10, 4, 3, 0)) == [0, 1] and list(rank_share(10, 4, 3, 2)) == [3]


def test_qwen3_8b_arithmetic():
    """The README's figure: 4,096 tokens, 5 taps + final layer, hidden 4096, bf16."""
    per_sample = cache_bytes([4096], slots=6, hidden=4096, dtype=torch.bfloat16)
    assert 200e6 < per_sample < 202e6
