"""The evaluation benchmark still runs and reports every figure the README needs (a smoke run: its
numbers mean nothing; the full one runs on a quiet machine, docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_eval_quick_json() -> None:
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_eval.py"), "--quick", "--json"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(r.stdout)
    assert data["prompts"] == 1 and data["new_tokens"] == 8 and data["lossless"] is True and data["tau"] >= 1
    assert data["workers_threads"] == 1  # configs/tiny-cpu.toml's threads_per_worker
    assert data["eval_s_workers_threads"] > 0 and data["eval_s_default_threads"] > 0
    assert isinstance(data["foreign_load_cores"], float) and isinstance(data["busy_machine"], bool)
