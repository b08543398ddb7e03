"""The target-memory benchmark still runs and reports every figure docs/training.md quotes (a smoke run
at a small shape: what it shows is that the tap forward keeps less than every layer's output)."""

from __future__ import annotations

import pytest
from conftest import bench_quick


@pytest.mark.slow
def test_bench_target_memory_quick_json() -> None:
    data = bench_quick("bench_target_memory.py")
    assert data["layers"] == 4 and data["taps"] and data["one_state_mib"] > 0
    # at the last layer the whole-tuple forward holds the embeddings and every earlier layer's output; the
    # tap forward holds its taps: at least one state fewer at this shape, and never more
    assert data["kept_mib_tap_hooks"] < data["kept_mib_output_hidden_states"]
    assert data["saved_states"] >= 1
    assert isinstance(data["foreign_load_cores"], float) and isinstance(data["busy_machine"], bool)
