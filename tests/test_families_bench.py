"""The rollback benchmark still runs and reports every figure the README needs (a smoke run: its
numbers mean nothing; the full one runs on a quiet machine, docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from conftest import bench_quick


@pytest.mark.slow
def test_bench_rollback_quick_json() -> None:
    data = bench_quick("bench_rollback.py")
    assert data["hybrid_family"] == "qwen3_5" and data["sliding_family"] == "gpt_oss"
    assert "Gated DeltaNet" in data["sliding_mixers_refused"]  # no linear-attention mixers to rerun
    ways = ["hybrid_mixers", "hybrid_rerun", "hybrid_reprefill", "sliding_record", "sliding_rerun", "sliding_reprefill"]
    if data["hybrid_records_recurrent_states"]:  # transformers 5.25+: cropping restores Gated DeltaNet too
        ways.append("hybrid_record")
        assert data["hybrid_record_extra_forwards"] == 0
    else:
        assert "recurrent" in data["hybrid_record_refused"]  # cropping alone cannot restore Gated DeltaNet
    for key in ways:
        assert data[f"{key}_exact"] is True, key  # every way offered keeps the target's greedy output
        assert data[f"{key}_rounds"] > 0 and data[f"{key}_verify_ms"] > 0 and data[f"{key}_round_ms"] > 0
    assert data["sliding_record_extra_forwards"] == data["hybrid_mixers_extra_forwards"] == 0
    assert data["sliding_rerun_extra_forwards"] > 0 and data["hybrid_rerun_extra_forwards"] > 0
    assert isinstance(data["foreign_load_cores"], float) and isinstance(data["busy_machine"], bool)
