"""The bucketing benchmark still runs and reports every figure the docs quote (a smoke run: its numbers
mean little; the full one is in docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from conftest import bench_quick


@pytest.mark.slow
def test_bench_bucketing_quick_json() -> None:
    data = bench_quick("bench_bucketing.py")
    # the skewed corpus pads most slots of a shuffled batch, few of a bucketed one
    assert data["padding_share_off"] > 0.3 > data["padding_share_on"] >= 0
    assert data["real_tokens_per_s_off"] > 0 and data["real_tokens_per_s_on"] > 0
    assert set(data["per_round"]) == {"off", "on"}
    assert isinstance(data["foreign_load_cores"], float) and isinstance(data["busy_machine"], bool)
    assert len(data["loadavg_1m_before_after"]) == 2
