"""The DFlash2 benchmark still runs and reports every figure docs/dflash2.md needs (a smoke run: its
numbers mean nothing; the full one runs on a quiet machine, docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from conftest import bench_quick


@pytest.mark.slow
def test_bench_dflash2_quick_json() -> None:
    data = bench_quick("bench_dflash2.py")
    assert data["dflash_step_ms"] > 0 and data["dflash2_step_ms"] > 0
    assert 0 < data["selector_share_of_dflash2_step"] < 1
    assert data["dflash2_params_m"] > data["dflash_params_m"]  # the convolutions and the selector
    assert data["codebooks_with_adamw_mb"] == pytest.approx(2 * 2000 * 32 * 16 / 1e6, abs=0.1)
    assert data["dflash_peak_rss_mb"] > 0 and data["dflash2_peak_rss_mb"] > 0
    assert isinstance(data["foreign_load_cores"], float) and isinstance(data["busy_machine"], bool)
