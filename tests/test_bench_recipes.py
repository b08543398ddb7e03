"""The recipe benchmark still trains and evaluates every recipe it names, DSpark's and DFlash2's too (a
smoke run: its numbers mean nothing; the full one runs on a quiet machine, docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_recipes_quick_json() -> None:
    recipes = ["ce-dpace-adamw", "kl-exp-muon", "dspark:ce-exp-muon", "dflash2:ce-dpace-adamw"]
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_recipes.py"), "--quick", "--json",
                        "--recipes", ",".join(recipes)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(r.stdout)
    assert list(data["recipes"]) == recipes and data["steps_per_run"] == 2
    for s in data["recipes"].values():
        assert s["steps"] == 2 and s["tau"] >= 1 and len(s["tau_per_seed"]) == 1 and s["lossless"] is True
        assert len(s["acceptance_1_2_3"]) == 3 and s["tokens_per_s"] > 0
    assert isinstance(data["foreign_load_cores"], float)
