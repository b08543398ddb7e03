"""The FP8 per-tap benchmark still runs and reports every figure docs/cache.md quotes (a smoke run at a
small shape: per-tap scales never lose more than the shared one on any slot, and win on the first tap of
the tokens with massive activations)."""

from __future__ import annotations

from conftest import bench_quick


def test_bench_fp8_taps_quick_json() -> None:
    data = bench_quick("bench_fp8_taps.py")
    assert data["taps"] == 6 and data["massive_tokens"] >= 1
    for kind in ("ordinary", "massive"):
        shared, per_tap = data[f"rel_error_shared_{kind}"], data[f"rel_error_per_tap_{kind}"]
        assert len(shared) == len(per_tap) == 6
        assert all(p <= s + 1e-3 for p, s in zip(per_tap, shared, strict=True))
    assert data["first_tap_error_ratio_massive"] > 2 and 0 < data["extra_bytes"] < 0.01
    assert isinstance(data["foreign_load_cores"], float) and isinstance(data["busy_machine"], bool)
