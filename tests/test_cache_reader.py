"""Opening a cache against the target (each mismatch one line) and reading it ahead, following a writer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from conftest import wait_until

from dflash.data.cache_format import (
    SIDECAR,
    CacheError,
    CacheMeta,
    read_sample,
    sample_path,
    write_rows,
    write_sample,
)
from dflash.data.cache_reader import CacheReader, open_cache
from dflash.data.cache_writer import meta_for
from dflash.data.formats import Sample

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny():
    from dflash.targets import load_target

    return load_target("tiny")


def _rows(n=3):
    return [Sample(list(range(5 + i, 10 + 2 * i)), [0, 1] + [1] * (3 + i)) for i in range(n)]


def _cache(root, tiny, rows, slots=None, meta=True, bad=None):
    """A cache as an engine would write it: one file per row, ``slots`` layers per token."""
    slots = slots or len(tiny.layer_ids) + 1
    write_rows(root, rows)
    for i, r in enumerate(rows):
        hs = torch.randn(len(r.input_ids), slots, tiny.hidden_size, generator=torch.Generator().manual_seed(i))
        if bad == i:
            hs[1, 0, 3] = float("nan")
        write_sample(sample_path(root, i), hs, torch.tensor(r.input_ids))
    if meta:
        meta_for(tiny, "tiny", len(rows)).write(root)
    return root


def test_with_sidecar_the_taps_come_from_it(tmp_path, tiny):
    lay = open_cache(_cache(tmp_path, tiny, _rows()), tiny, None, [0, 0, 0])
    assert lay.layer_ids == tiny.layer_ids and lay.slots == [0, 1, 2] and lay.assumed is None
    sub = open_cache(tmp_path, tiny, [tiny.layer_ids[2], tiny.layer_ids[0]], [])
    assert sub.slots == [2, 0]  # a subset of the cached taps, in the order asked
    with pytest.raises(CacheError, match=r"taps \[5\] are not in the cache \(it holds layers \[1, 2, 3\]\)"):
        open_cache(tmp_path, tiny, [1, 5], [])


def test_another_tokenizer_or_target_is_one_line(tmp_path, tiny):
    _cache(tmp_path, tiny, _rows())
    meta = CacheMeta.read(tmp_path)
    meta.tokenizer_sha256 = "0" * 64
    meta.write(tmp_path)
    with pytest.raises(CacheError, match="written with another tokenizer than --target's") as e:
        open_cache(tmp_path, tiny, None, [])
    assert "\n" not in str(e.value)
    meta = meta_for(tiny, "other", 3)
    meta.hidden_size = 4096
    meta.write(tmp_path)
    with pytest.raises(CacheError, match="written for a target with 6 layers and hidden size 4096"):
        open_cache(tmp_path, tiny, None, [])
    meta = meta_for(tiny, "tiny", 3)
    meta.config_sha256 = "x"
    meta.write(tmp_path)
    with pytest.raises(CacheError, match="written for another target config"):
        open_cache(tmp_path, tiny, None, [])


def test_without_sidecar_shapes_decide_and_the_assumption_is_said(tmp_path, tiny):
    """What vLLM's connector + speculators leave: no dflash_cache.json."""
    _cache(tmp_path, tiny, _rows(), meta=False)
    assert not (tmp_path / SIDECAR).exists()
    lay = open_cache(tmp_path, tiny, None, tiny.layer_ids)
    assert lay.slots == [0, 1, 2] and lay.dtype == torch.float32
    assert lay.assumed.startswith(f"--hidden-states {tmp_path}: no {SIDECAR} (an engine wrote this cache): "
                                  "assuming its 3 aux slots are taps [1, 2, 3] (engine ids [2, 3, 4])")


def test_a_wrong_layer_count_is_refused_in_one_line(tmp_path, tiny):
    _cache(tmp_path, tiny, _rows(), slots=5, meta=False)  # 4 aux + final, the drafter taps 3
    with pytest.raises(CacheError) as e:
        open_cache(tmp_path, tiny, None, tiny.layer_ids)
    assert str(e.value) == (f"--hidden-states {tmp_path}: hs_0.safetensors holds 5 layers per token (4 aux + final) "
                            "but the drafter taps 3 ([1, 2, 3]); pass --target-layer-ids with the 4 layers the "
                            "engine was given, each minus 1 (its aux_hidden_state_layer_ids)")


def test_reads_are_checked_file_by_file(tmp_path, tiny):
    rows = _rows(4)
    lay = open_cache(_cache(tmp_path, tiny, rows, bad=2), tiny, None, [])
    # row 3's file holds another row's tokens
    write_sample(sample_path(tmp_path, 3), torch.zeros(len(rows[0].input_ids), 4, tiny.hidden_size),
                 torch.tensor(rows[0].input_ids))
    reader = CacheReader(lay, threads=2)
    try:
        reader.schedule([1, 2, 3])  # read ahead, checked as they are taken
        assert reader.take(1).shape == (len(rows[1].input_ids), 4, tiny.hidden_size)
        with pytest.raises(CacheError, match=r"hs_2.safetensors: 1 non-finite values \(NaN/inf\) in layer slots \[0\]"):
            reader.take(2)
        with pytest.raises(CacheError, match="hs_3.safetensors: its token_ids differ from row 3 of the data set"):
            reader.take(3)
        sample_path(tmp_path, 0).write_bytes(sample_path(tmp_path, 0).read_bytes()[:-100])
        with pytest.raises(CacheError, match="hs_0.safetensors: truncated"):
            reader.take(0)
        sample_path(tmp_path, 0).unlink()
        with pytest.raises(CacheError, match="hs_0.safetensors: missing"):
            reader.take(0)
    finally:
        reader.close()


WRITER = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from dflash.data.cache_format import sample_path, write_sample
    from dflash.data.cache_reader import FOLLOW_POLL
    torch.set_num_threads(1)
    root, n, hidden = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    go = root / "go"
    for i in range(n):
        while not (root / f"go{i}").exists():   # the test says when each file may appear
            time.sleep(FOLLOW_POLL[0])
        ids = torch.arange(5 + i, 10 + 2 * i)
        write_sample(sample_path(root, i), torch.full((len(ids), 4, hidden), float(i)), ids)
""")


def test_follow_waits_for_files_a_writer_process_adds(tmp_path, tiny):
    """The reader starts before the files exist, waits for each, and never sees a partial one."""
    rows = _rows(3)
    write_rows(tmp_path, rows)
    meta_for(tiny, "tiny", 3).write(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), "3", str(tiny.hidden_size)])
    try:
        lay = open_cache(tmp_path, tiny, None, [], follow=True)
        waited: list[float] = []
        reader = CacheReader(lay, threads=2, follow=True, on_wait=waited.append)
        got: dict[int, torch.Tensor] = {}

        def consume():
            for i in range(3):
                got[i] = reader.take(i)

        t = threading.Thread(target=consume)
        t.start()
        for i in range(3):
            # row i's read is waiting for its file before the writer may write it
            wait_until(lambda i=i: i in reader.waiting, timeout=60, what=f"a read waiting for hs_{i}")
            (tmp_path / f"go{i}").touch()
        t.join(timeout=120)
        assert not t.is_alive()
        for i in range(3):
            assert torch.equal(got[i], torch.full((len(rows[i].input_ids), 4, tiny.hidden_size), float(i)))
        assert len(waited) == 3  # each read waited for its file, and said how long
        reader.close()
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0


def test_the_cache_target_reads_ahead_in_batch_order_and_assembles_padded_batches(tmp_path, tiny):
    from dflash.targets.cache import READ_AHEAD, load_cache_target
    from dflash.train.run.stages import BatchSource

    rows = _rows(12)
    _cache(tmp_path, tiny, rows)
    target = load_cache_target(tmp_path, "tiny", None, None, torch.device("cpu"))
    try:
        samples = target.own_samples(max_len=512, min_loss_tokens=1)
        source = BatchSource(samples, batch_size=2, seed=3, pad_id=0)
        target.read_ahead(source.sample_ids)
        batch = source(0)
        hidden = target.hidden_states(batch)
        # the next READ_AHEAD batches' files are already being read
        ahead = {r for i in range(1, READ_AHEAD + 1) for r in source.sample_ids(i)}
        assert ahead <= target.reader.queued
        h = tiny.hidden_size
        assert hidden.shape == (2, batch.input_ids.shape[1], 3 * h)
        for r, p in enumerate(batch.sample_ids):
            states, _ = read_sample(sample_path(tmp_path, p))
            n = len(rows[p].input_ids)
            assert torch.equal(hidden[r, :n], states[:, :3].reshape(n, 3 * h))  # taps in order, final left out
            assert not hidden[r, n:].any()  # padding stays zero
    finally:
        target.close()
