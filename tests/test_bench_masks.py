"""The mask benchmark still runs and reports every figure the README needs (a smoke run: its numbers
mean nothing; the full one runs on a quiet machine, docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from conftest import bench_quick


@pytest.mark.slow
def test_bench_masks_quick_json() -> None:
    data = bench_quick("bench_masks.py")
    assert (data["anchors"], data["block"], data["tokens"], data["window"]) == (512, 16, 4096, 2048)
    for kind in ("full", "sliding"):
        assert data[f"{kind}_build_ms"] > 0
        # no Q x KV tensor: the largest intermediate is far below the dense mask
        assert data[f"{kind}_largest_intermediate_bytes"] * 100 < data["dense_mask_bytes"]
        assert 0 < data[f"{kind}_tiles_full"] < data[f"{kind}_tiles_visited"] < data[f"{kind}_tiles_total"]
    assert data["sliding_tiles_visited"] < data["full_tiles_visited"]  # the window skips whole tiles
    assert isinstance(data["foreign_load_cores"], float) and isinstance(data["busy_machine"], bool)
