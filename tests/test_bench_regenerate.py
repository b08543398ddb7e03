"""The regeneration benchmark still runs and reports every figure docs/data.md quotes (a smoke run: its
numbers mean nothing; the full one runs on a quiet machine), against the session's server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_regenerate_quick_json(transformers_server) -> None:
    # the session's transformers serve (the script starts its own without --endpoint: the same code path)
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_regenerate.py"), "--quick", "--json",
                        "--endpoint", transformers_server.url, "--server_pid", str(transformers_server.pid)],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(r.stdout)
    assert data["rows"] == 8 and data["max_tokens"] == 8
    for run in ("in_process", "server_c1", "server_c8", "server_c32"):
        assert data[run]["rows_per_s"] > 0 and data[run]["tok_per_s"] > 0
    verdicts = {data[f"server_c{c}"].get("verdict") for c in (1, 8, 32)}
    assert verdicts - {None} and verdicts <= {"server-bound", "client-bound", None}  # the job published one
    assert isinstance(data["foreign_load_cores"], float) and isinstance(data["busy_machine"], bool)
