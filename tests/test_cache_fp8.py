"""FP8 hidden-states caches: `dflash data cache --dtype fp8` writes float8_e4m3fn states with a float32
scale per token, the reader dequantises them on its own threads, and every bad FP8 input is one line that
leaves the files as they were. (Against speculators' own FP8 code: tests/test_speculators_interop.py.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash.data.cache_reader as cache_reader
from dflash.cli import main
from dflash.data.cache_format import (
    FP8,
    SCALES,
    CacheError,
    CacheMeta,
    MixedCache,
    cache_bytes,
    dequantize_fp8,
    quantize_fp8,
    read_rows,
    read_sample,
    read_stored,
    sample_path,
    write_sample,
)
from dflash.data.cache_reader import CacheReader, open_cache

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
ROWS = 6


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> Path:
    """The same demo rows cached twice by the tiny target: fp32 (its own dtype on the CPU) and FP8."""
    root = tmp_path_factory.mktemp("fp8")
    for name, flags in (("fp32", []), ("fp8", ["--dtype", "fp8"])):
        assert main(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(root / name),
                     "--max-samples", str(ROWS), "--batch-size", "4", "--no-telemetry", *flags]) == 0
    return root


@pytest.fixture(scope="module")
def tiny():
    from dflash.targets import load_target

    return load_target("tiny")


def _states(seq=7, slots=4, hidden=8):
    g = torch.Generator().manual_seed(seq)
    hs = torch.randn(seq, slots, hidden, generator=g) * torch.logspace(-3, 3, seq)[:, None, None]
    hs[2] = 0.0  # a token whose states are all zero still gets a usable scale
    return hs


def test_per_token_scales_and_the_error_they_bound():
    hs = _states()
    q, scales = quantize_fp8(hs)
    assert q.dtype == FP8 and scales.dtype == torch.float32 and scales.shape == (7, 1, 1)
    # each token's largest magnitude lands on FP8's largest value, 448
    amax = hs.abs().flatten(1).max(dim=1).values
    assert torch.equal(scales.flatten()[amax > 0], amax[amax > 0] / 448)
    assert scales[2].item() == torch.tensor(1e-12).item()  # the floor, in float32
    back = dequantize_fp8(q, scales, torch.float32)
    assert back.dtype == torch.float32 and torch.equal(back[2], hs[2])
    # e4m3 keeps 3 mantissa bits: relative error at most 1/16 where the value is a normal FP8 number,
    # and no token's error exceeds 1/16 of its own largest value (six decades apart here)
    err = (back - hs).abs()
    normal = hs.abs() >= 2.0 ** -6 * scales
    assert bool((err[normal] <= hs.abs()[normal] / 16).all())
    assert bool((err.flatten(1).max(dim=1).values <= amax / 16).all())
    # a padded batch quantises each token as the samples do one by one (the writer quantises batches)
    batch = torch.stack([hs, torch.randn(7, 4, 8)])
    bq, bs = quantize_fp8(batch)
    assert torch.equal(bq[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(bs[0], scales)


def test_per_tap_scales_keep_an_early_tap_beside_a_deep_ones_outliers(tmp_path):
    """A first tap 10^4 times smaller than the last slot's largest value: under the shared per-token
    scale many of its values fall below FP8's normal range (2^-6 of the scale) or to zero; with a scale
    per token and tap it keeps e4m3's precision, and the file reads back through the same reader."""
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(16, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 10.0])[None, :, None]
    hs[:, 2, 0] = 1000.0  # an outlier channel of the deepest slot, on every token

    def first_tap_error(per_tap: bool) -> float:
        q, scales = quantize_fp8(hs, per_tap=per_tap)
        back = dequantize_fp8(q, scales, torch.float32)
        return float((back - hs)[:, 0].norm() / hs[:, 0].norm())

    shared, per_tap = first_tap_error(False), first_tap_error(True)
    assert per_tap < 0.04 < 0.1 < shared  # e4m3's ~2.7% against several times that
    q, scales = quantize_fp8(hs, per_tap=True)
    assert scales.shape == (16, 3, 1)
    path = sample_path(tmp_path, 0)
    write_sample(path, q, torch.arange(16), scales)
    got, _ = read_sample(path)
    assert torch.equal(got, dequantize_fp8(q, scales, torch.float32))
    assert tuple(read_stored(path)[2].shape) == (16, 3, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_code_dequantises_as_torch_converts_it(dtype):
    """The bit arithmetic against torch's own float8 conversion, all 256 codes (the two NaN codes
    included), times scales that round differently in each dtype."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).reshape(256, 1, 1).expand(256, 3, 4).contiguous()
    scales = torch.logspace(-9, 3, 256).reshape(256, 1, 1) * 1.2345
    got = dequantize_fp8(codes, scales, dtype)
    want = codes.to(dtype) * scales.to(dtype)
    assert got.dtype == dtype and int(want.isnan().sum()) == 2 * 12
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got[~want.isnan()], want[~want.isnan()])


def test_an_fp8_file_round_trips(tmp_path):
    hs, ids = _states(), torch.arange(7) + 3
    q, scales = quantize_fp8(hs)
    path = sample_path(tmp_path, 0)
    write_sample(path, q, ids, scales)
    raw = load_file(str(path))  # safetensors' own loader sees the three tensors the FP8 backend writes
    assert {k: v.dtype for k, v in raw.items()} == {"hidden_states": FP8, SCALES: torch.float32,
                                                    "token_ids": torch.int64}
    got, got_ids, got_scales = read_stored(path)
    assert torch.equal(got.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_scales, scales)
    assert torch.equal(got_ids, ids)
    states, _ = read_sample(path)
    assert torch.equal(states, dequantize_fp8(q, scales, torch.float32))
    half, _ = read_sample(path, fp8_as=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, q.to(torch.bfloat16) * scales.to(torch.bfloat16))


def _bad(path: Path, **tensors: torch.Tensor) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"token_ids": torch.arange(5), **tensors}, str(path))
    return path.read_bytes()


@pytest.mark.parametrize("case, why", [
    ("no scales", r"hidden_states is float8_e4m3fn but the file has no 'hidden_states_scales'"),
    ("scales per unit", r"hidden_states_scales is float32 \[5, 3, 8\], expected a float \[5, 1, 1\] \(one "
                        r"scale per token\) or \[5, 3, 1\] \(per token and tap\)"),
    ("scales flat", r"hidden_states_scales is float32 \[5\], expected a float \[5, 1, 1\]"),
    ("integer scales", r"hidden_states_scales is int64 \[5, 1, 1\], expected a float \[5, 1, 1\]"),
    ("scales on bf16", r"has 'hidden_states_scales' but hidden_states is bfloat16, not float8_e4m3fn"),
])
def test_bad_fp8_files_are_one_line_and_left_as_they_are(tmp_path, case, why):
    q, scales = quantize_fp8(torch.randn(5, 3, 8))
    tensors = {
        "no scales": {"hidden_states": q},
        "scales per unit": {"hidden_states": q, SCALES: scales.expand(5, 3, 8).contiguous()},
        "scales flat": {"hidden_states": q, SCALES: scales.flatten()},
        "integer scales": {"hidden_states": q, SCALES: torch.ones(5, 1, 1, dtype=torch.int64)},
        "scales on bf16": {"hidden_states": torch.randn(5, 3, 8).bfloat16(), SCALES: scales},
    }[case]
    path = sample_path(tmp_path, 0)
    before = _bad(path, **tensors)
    with pytest.raises(CacheError, match=f"hs_0.safetensors: {why}") as e:
        read_sample(path)
    assert "\n" not in str(e.value) and "delete it and rerun" in str(e.value)
    assert path.read_bytes() == before


def test_the_cache_command_writes_fp8(caches):
    fp32, fp8 = caches / "fp32", caches / "fp8"
    meta = CacheMeta.read(fp8)
    assert meta.dtype == "float8_e4m3fn" and CacheMeta.read(fp32).dtype == "float32"
    assert read_rows(fp8) == read_rows(fp32)
    for i in range(ROWS):
        ref, ids = read_sample(sample_path(fp32, i))
        q, got_ids, scales = read_stored(sample_path(fp8, i))
        assert torch.equal(got_ids, ids) and scales.shape == (len(ids), 1, 1)
        # the bytes FP8 of these very states is: the writer quantised each token of the padded batch alone
        want_q, want_scales = quantize_fp8(ref)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scales, want_scales)
        # and the disk it takes is what the writer's arithmetic promised before writing
        n = len(ids)
        assert sample_path(fp8, i).stat().st_size - cache_bytes([n], meta.slots, meta.hidden_size, FP8) < 400
        assert sample_path(fp32, i).stat().st_size - cache_bytes([n], meta.slots, meta.hidden_size,
                                                                 torch.float32) < 400
    size = {name: sum(sample_path(caches / name, i).stat().st_size for i in range(ROWS)) for name in ("fp32", "fp8")}
    assert size["fp8"] < 0.27 * size["fp32"]


def test_fp8_scales_without_fp8_is_one_line(tmp_path, capsys):
    assert main(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(tmp_path / "c"),
                 "--fp8-scales", "tap", "--no-telemetry"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--fp8-scales is for FP8 files: give --dtype fp8 too") and "\n" not in err
    assert not (tmp_path / "c").exists()


def test_a_rerun_in_another_dtype_is_refused(caches, tmp_path, capsys):
    out = tmp_path / "c"
    shutil.copytree(caches / "fp8", out)
    before = {p.name: p.read_bytes() for p in (out / "hidden_states").iterdir()}
    assert main(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(out), "--max-samples",
                 str(ROWS), "--no-telemetry", "--dtype", "bf16"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"dflash data: error: --out {out} holds a cache of another target or data (dtype differ); "
                       "choose another --out or delete it")
    assert {p.name: p.read_bytes() for p in (out / "hidden_states").iterdir()} == before


def test_the_reader_threads_dequantise(caches, tiny, monkeypatch):
    lay = open_cache(caches / "fp8", tiny, None, [])
    assert lay.dtype == FP8
    where: list[str] = []
    real = cache_reader.dequantize_fp8

    def noted(*a, **k):
        where.append(threading.current_thread().name)
        return real(*a, **k)

    monkeypatch.setattr(cache_reader, "dequantize_fp8", noted)
    for dtype in (torch.float32, torch.bfloat16):
        reader = CacheReader(lay, threads=2, dtype=dtype)
        try:
            reader.schedule(list(range(ROWS)))
            for i in range(ROWS):
                got = reader.take(i)
                q, _, scales = read_stored(sample_path(caches / "fp8", i))
                assert got.dtype == dtype and torch.equal(got, q.to(dtype) * scales.to(dtype))
        finally:
            reader.close()
    assert len(where) == 2 * ROWS and all(name.startswith("cache-read") for name in where)


def test_a_nan_code_is_one_line(caches, tiny, tmp_path):
    bad = tmp_path / "nan"
    shutil.copytree(caches / "fp8", bad)
    q, ids, scales = read_stored(sample_path(bad, 1))
    q = q.clone()
    q.view(torch.uint8)[4, 2, 7] = 0x7F  # float8_e4m3fn's NaN
    write_sample(sample_path(bad, 1), q, ids, scales)
    reader = CacheReader(open_cache(bad, tiny, None, []), threads=1)
    try:
        with pytest.raises(CacheError, match=r"hs_1.safetensors: 1 non-finite values \(NaN/inf\) in layer slots \[2\]"):
            reader.take(1)
    finally:
        reader.close()


def _mixed(caches: Path, tmp_path: Path, sidecar: bool) -> Path:
    mixed = tmp_path / "mixed"
    shutil.copytree(caches / "fp8", mixed)
    shutil.copy(sample_path(caches / "fp32", 3), sample_path(mixed, 3))
    if not sidecar:
        (mixed / "dflash_cache.json").unlink()
    return mixed


@pytest.mark.parametrize("sidecar", [True, False])
def test_a_mixed_cache_is_one_line(caches, tiny, tmp_path, sidecar):
    mixed = _mixed(caches, tmp_path, sidecar)
    before = sample_path(mixed, 3).read_bytes()
    lay = open_cache(mixed, tiny, None, tiny.layer_ids)
    reader = CacheReader(lay, threads=1)
    try:
        reader.take(2)
        with pytest.raises(MixedCache) as e:  # the cache's fault, not the file's: a run stops, never skips it
            reader.take(3)
    finally:
        reader.close()
    said = "dflash_cache.json" if sidecar else "hs_0.safetensors"
    assert str(e.value) == (f"{sample_path(mixed, 3)}: float32, but the cache is float8_e4m3fn with per-token "
                            f"scales (FP8) (its {said}): a mixed cache; rewrite it in one dtype (`dflash data "
                            "cache --dtype`)")
    assert sample_path(mixed, 3).read_bytes() == before


def test_training_from_an_fp8_cache_and_a_mixed_one(caches, tmp_path):
    def train(hs: Path, run: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "dflash", "train", "--target", "tiny", "--hidden-states", str(hs), "--run-dir",
               str(tmp_path / run), "--max-steps", "2", "--batch-size", "4", "--num-anchors", "8",
               "--eval-prompts", "0", "--no-telemetry"]
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    r = train(caches / "fp8", "ok")
    assert r.returncode == 0, r.stderr[-2000:]
    r = train(_mixed(caches, tmp_path, sidecar=True), "mixed")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("dflash train: ") and "hs_3" in x)
    assert "float32, but the cache is float8_e4m3fn with per-token scales (FP8)" in line and "mixed cache" in line
