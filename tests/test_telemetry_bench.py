"""The telemetry benchmark still runs and reports every number the README table needs.

Not a timed test: thresholds are for the full run on a quiet machine, the smoke run only proves the
script works (it imports torch, hence slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_quick_json() -> None:
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_telemetry.py"), "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    for key in (
        "add_vs_floor",
        "span_ns",
        "record_function_vs_span",
        "snapshot_ms",
        "throughput_on_vs_off",
        "foreign_load_cores",
    ):
        assert isinstance(data[key], (int, float)), key
    assert data["span_ns"] > 0 and data["snapshot_ms"] > 0 and data["snapshot_bytes"] > 1000
    assert 0 < data["throughput_on_vs_off"] < 10
