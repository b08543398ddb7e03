"""The verdict-stability benchmark still runs on a real training run and reports every figure the README
needs (a smoke run: its numbers mean nothing; the full one runs on a quiet machine, docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_verdict_quick_json() -> None:
    cmd = [sys.executable, str(REPO / "scripts" / "bench_verdict.py"), "--quick", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    data = json.loads(r.stdout) if r.returncode == 0 else pytest.fail(r.stderr[-3000:])
    assert data["windows"] > 5 and data["contradicting_evidence"] == 0
    assert min(data["verdict_changes_per_100_windows"], data["one_window_changes_per_100_windows"]) >= 0
    assert data["scope_of_last_window"].startswith("last ") and "whole run" in data["whole_run_verdict"]
    assert {type(data["foreign_load_cores"]), type(data["busy_machine"])} == {float, bool}
