"""`dflash data cache` on the tiny target: the engines' layout, the states the target computes, reruns."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dflash.cli import main
from dflash.data.cache_format import CacheError, CacheMeta, read_rows, read_sample, sample_path
from dflash.data.cache_writer import check_disk

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "c"
    assert main(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(out), "--max-samples", "6",
                 "--batch-size", "4", "--no-telemetry"]) == 0
    return out


def test_the_cache_holds_the_targets_states(cache_dir):
    from dflash.targets import load_target
    from dflash.train.config.recipes import hardware_recipe

    # by default the taps a bare `dflash train --target tiny` reads on this machine
    recipe, _ = hardware_recipe("tiny")
    target = load_target("tiny", layer_ids=recipe.get("target_layer_ids"), num_draft_layers=recipe.get(
        "drafter_layers", 5))
    meta = CacheMeta.read(cache_dir)
    assert meta.target_layer_ids == target.layer_ids and meta.rows == 6 and meta.dtype == "float32"
    assert meta.aux_hidden_state_layer_ids == [i + 1 for i in target.layer_ids]
    rows = read_rows(cache_dir)
    assert len(rows) == 6
    for i in (0, 5):
        hs, ids = read_sample(sample_path(cache_dir, i))
        assert ids.tolist() == rows[i].input_ids
        assert hs.shape == (len(ids), len(target.layer_ids) + 1, target.hidden_size)
        out = target.model.get_decoder()(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        for slot, layer in enumerate(target.layer_ids):
            torch.testing.assert_close(hs[:, slot], out.hidden_states[layer + 1][0], rtol=1e-4, atol=1e-4)
        # the final slot is the last layer before the norm (vLLM's id N); the decoder's last_hidden_state is after it
        norm = target.model.get_decoder().norm
        torch.testing.assert_close(norm(hs[None, :, -1]), out.last_hidden_state, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(hs[:, -1], out.last_hidden_state[0])


def test_a_rerun_skips_what_is_written(cache_dir, capsys):
    victim = sample_path(cache_dir, 2)
    victim.unlink()
    # what a killed writer leaves (its pid is gone), and a live writer's (this process) temporary
    stale = victim.with_name(".hs_2.safetensors.999999999.tmp")
    live = victim.with_name(f".hs_7.safetensors.{os.getpid()}.tmp")
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    before = {i: sample_path(cache_dir, i).stat().st_mtime_ns for i in (0, 1, 3, 4, 5)}
    assert main(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(cache_dir),
                 "--max-samples", "6", "--no-telemetry"]) == 0
    out = capsys.readouterr().out
    assert "5 files of this share already written, skipped" in out and "wrote 1 files" in out
    assert "removed 1 temporary file a stopped writer left" in out and not stale.exists() and live.exists()
    live.unlink()
    assert victim.is_file()
    assert {i: sample_path(cache_dir, i).stat().st_mtime_ns for i in before} == before


def test_another_target_or_data_is_refused(cache_dir, tmp_path, capsys):
    copy = tmp_path / "c"
    shutil.copytree(cache_dir, copy)
    assert main(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(copy), "--max-samples", "6",
                 "--target-layer-ids", "0,4", "--no-telemetry"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (above it: transformers' loading bar)
    assert err.startswith("dflash data: error: --out ") and "another target or data (target_layer_ids" in err
    assert main(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(copy), "--max-samples", "4",
                 "--no-telemetry"]) == 2
    assert "holds a cache of another target or data (rows" in capsys.readouterr().err


def test_a_disk_too_small_is_refused_before_writing(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    lines = []
    with pytest.raises(CacheError, match="the cache needs .* GB but .* free; free space, choose another --out"):
        check_disk(tmp_path / "new", free + 10**12, "1 sample", lines.append)
    assert "GB to write" in lines[0]
    check_disk(tmp_path / "new", 1, "1 sample", lines.append)  # enough: says so and returns


def test_each_rank_writes_its_share(tmp_path):
    """What torchrun gives each rank (RANK, WORLD_SIZE): two writers, one directory, every row once."""
    import os
    import subprocess
    import sys

    out = tmp_path / "c"
    procs = [subprocess.Popen([sys.executable, "-m", "dflash", "data", "cache", "--target", "tiny", "--data", "demo",
                               "--out", str(out), "--max-samples", "5", "--no-telemetry"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "WORLD_SIZE": "2"})
             for r in (1, 0)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert "rows 3..4 of 5 on rank 1/2" in logs[0] and "rows 0..2 of 5 on rank 0/2" in logs[1]
    assert "wrote 2 files" in logs[0] and "wrote 3 files" in logs[1]
    assert sorted(p.name for p in (out / "hidden_states").iterdir()) == [f"hs_{i}.safetensors" for i in range(5)]
    assert len(read_rows(out)) == 5 and CacheMeta.read(out).rows == 5


def test_the_writer_reports_like_a_training_run(tmp_path, capsys):
    """A telemetry socket while it runs and a recording beside the cache that `dflash stats` reads: the
    target's forward on target-0, the disk writes on writer-0."""
    out = tmp_path / "c"
    assert main(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(out), "--max-samples", "3",
                 "--socket-dir", str(tmp_path / "s")]) == 0
    assert "telemetry: " in capsys.readouterr().out
    assert main(["stats", str(out / "telemetry.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workers"]["target-0"]["target_forward"]["n"] >= 1
    assert report["workers"]["writer-0"]["cache_write"]["n"] == 3
