"""scripts/gpu_check.py is proven on CPU before a GPU is lent: every check that can run on CPU runs at
tiny shapes through the same code, in this process and in a forked child, each result a JSON line the
moment it is known (a run killed mid-check keeps them, a hung check is killed at its limit and says
where it hung), and without CUDA (and without --cpu-smoke) the script skips in one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import wait_until

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _lines(path: Path) -> list[dict]:
    """The JSON lines written so far (a line being written, not yet ended, is not one yet)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


def test_cpu_smoke_runs_every_check_without_errors(tmp_path: Path) -> None:
    out, jsonl = tmp_path / "smoke.json", tmp_path / "smoke.jsonl"
    proc = _run("--cpu-smoke", "--json", str(out), "--jsonl", str(jsonl))
    report = json.loads(out.read_text())
    checks = report["checks"]
    # one line per event, in order: the run, then each check as it began and ended, then the end; the
    # report is what those lines say
    lines = _lines(jsonl)
    assert lines[0]["kind"] == "run" and lines[0]["torch"] and lines[0]["mode"] == "cpu-smoke"
    assert lines[-1]["kind"] == "end" and lines[-1]["wall_s"] == report["wall_s"]
    events = [(k, n) for n in checks for k in ("begin", "check")]
    assert [(x["kind"], x["name"]) for x in lines[1:-1]] == events
    assert {x["name"]: {k: v for k, v in x.items() if k not in ("kind", "name")}
            for x in lines if x["kind"] == "check"} == checks
    assert report["finished"] and report["not_run"] == [] and sum(report["counts"].values()) == len(checks)
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    assert list(checks) == list(mod.CHECKS)  # every check reported, none lost to another's failure
    bad = {k: v for k, v in checks.items() if v["status"] not in ("pass", "skip", "fail")}
    assert not bad, json.dumps(bad, indent=1)[:3000]
    # On a shared 2-core box the verdict of the tiny runs is timing-dependent; everything else must pass.
    failed = {k: v for k, v in checks.items() if v["status"] == "fail" and k != "verdicts"}
    assert not failed, failed
    assert proc.returncode == (0 if report["ok"] else 1)
    for name in ("prewarm", "flex_uneven", "thread_device", "mask_build", "side_stream_copy", "flex_vs_sdpa",
                 "ddp_resume", "eval_lossless", "throughput", "eval_temperature", "dspark"):
        assert checks[name]["status"] == "pass", (name, checks[name])
    # DFlash2 at Qwen3's vocabulary: its head really ran in chunks; the plan was made (its peak is CUDA's)
    d2 = checks["dflash2_vocab"]
    assert d2["status"] == "skip" and d2["vocab"] == 151936 and d2["drafter"] == "DFlash2Drafter"
    assert d2["chunks"] > 1 and d2["head_rows"] > d2["chunk_rows"] and d2["plan_gib"] > d2["plan_fixed_gib"] > 0
    # the FP8 cache written, read back by the trainer's stage equal to the CPU's dequantisation, trained from
    fp8 = checks["fp8_cache_cuda"]
    assert fp8["status"] == "skip" and fp8["values_compared"] > 0 and fp8["values_differing"] == 0
    assert fp8["sync_debug"] == "no sync" and fp8["scales"] == "per tap"
    # the CPU suite's chi-square, through the same code the device runs: both paths of the verifier ran
    for kind in ("dflash2", "dspark"):
        r = checks["eval_temperature"][kind]
        assert r["chi_square"] < r["critical"] and 0 < r["rounds_with_a_kept_draft"] < r["rounds"]
    muon = checks["muon_real_shape"]
    assert muon["status"] == "skip" and muon["optimizers"] == ["adamw", "muon"] and muon["max_change"] > 0
    assert checks["dspark"]["drafter"] == "DSparkDrafter" and checks["dspark"]["lossless"]
    # the trained drafter's rounds counted: every verified position was kept or rejected
    ev = checks["eval_lossless"]
    assert ev["lossless"] and ev["trained_steps"] == 20 and ev["rounds"] == sum(ev["acceptance_histogram"])
    assert ev["kept_positions"] + ev["rejected_positions"] == ev["rounds"] * (len(ev["acceptance_histogram"]) - 1)
    # every thread of a real run bound the run's device (cpu here: none touches CUDA)
    assert set(checks["thread_device"]["bindings"]) >= {"MainThread", "target-0", "drafter-0", "dflash-telemetry"}
    # the whole trainer with telemetry on and a one-rank DDP ran its steady steps (the sync assertion is CUDA's)
    assert checks["host_gap"]["status"] == "skip" and checks["host_gap"]["sync_debug"] == "no sync"
    assert checks["host_gap"]["largest_at_step"] > 0
    assert checks["flex_uneven"]["shapes"][0]["anchors"] % 8 and checks["flex_uneven"]["shapes"][0]["seq"] % 128
    assert checks["ddp_resume"]["ddp"] == "DistributedDataParallel" and checks["ddp_resume"]["bitwise"]
    assert checks["mask_build"]["dense_mask_bytes"] == 2 * 8192 * 12288
    assert checks["nvml"]["status"] == "skip" and "NVML" in checks["nvml"]["reason"]
    assert checks["sync_free"]["status"] == "skip" and checks["sync_free"]["steady_steps"] == 3
    assert checks["throughput"]["pipelined_tokens_per_s"] > 0 and checks["throughput"]["sync_tokens_per_s"] > 0
    # the tiny-kernel pipeline ran and was judged; on the CPU its spans have no device time, so it cannot be
    # launch-bound (the GPU run expects that verdict from NVML's kernel time)
    launch = checks["launch_bound"]
    assert launch["status"] == "skip" and launch["evidence"]["targets"] == 1 and launch["evidence"]["drafters"] == 1
    assert "device_time" not in launch["evidence"] and launch["verdict"] != "launch-bound" and launch["gpu_busy"] == {}


def test_isolated_check_reports_through_a_child_process(tmp_path: Path) -> None:
    out, jsonl = tmp_path / "iso.json", tmp_path / "iso.jsonl"
    proc = _run("--cpu-smoke", "--isolate", "--only", "mask_build", "--json", str(out), "--jsonl", str(jsonl))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["checks"]["mask_build"]
    assert res["status"] == "pass" and res["partial_tiles"] > 0 and res["start_s"] >= 0
    assert proc.stdout.count("mask_build") == 1
    # the start-up was paid once, by the parent, which forked the child from a single thread
    head = _lines(jsonl)[0]
    assert head["isolate"] and head["threads_at_fork"] == 1 and head["warmup_failed"] == {}
    assert head["warmup_s"] > 0


# A driver that adds a check which never returns (it waits on an event nobody sets) to the real script.
HANG = """
import importlib.util, sys, threading
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = mod
spec.loader.exec_module(mod)
def check_hang(ctx):
    threading.Event().wait()
mod.CHECKS["hang"] = (check_hang, float(sys.argv[2]))
sys.exit(mod.main(sys.argv[3:]))
"""


def _hang(budget_s: float, *args: str) -> list[str]:
    return [sys.executable, "-c", HANG, str(SCRIPT), str(budget_s), "--cpu-smoke", "--isolate", *args]


def test_a_hung_check_is_killed_at_its_limit_with_its_stacks_and_hides_nothing(tmp_path: Path) -> None:
    out = tmp_path / "hang.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # budget 0.1 s x the smoke slack, plus the child's start allowance: killed within seconds
    proc = subprocess.run(_hang(0.1, "--only", "hang,mask_build", "--json", str(out)), capture_output=True,
                          text=True, env=env, timeout=240)
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    hang = report["checks"]["hang"]
    assert hang["status"] == "timeout" and hang["limit_s"] == 2.0  # 0.1 x 10 + the 1 s start allowance
    assert "check_hang" in hang["log_tail"]  # every thread's stack, dumped at the limit, says where
    assert report["checks"]["mask_build"]["status"] == "pass"
    assert report["rerun"] == "--only hang" and not report["ok"]
    assert "again: --only hang" in proc.stdout.splitlines()[-1]


def test_a_run_killed_mid_check_leaves_what_it_finished_and_its_children_die_with_it(tmp_path: Path) -> None:
    jsonl = tmp_path / "cut.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_hang(30, "--only", "mask_build,hang,cuda_spans", "--jsonl", str(jsonl)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    children: list = []
    try:
        def hanging() -> list:
            begun = any(x["kind"] == "begin" and x["name"] == "hang" for x in _lines(jsonl))
            return begun and psutil.Process(proc.pid).children(recursive=True)

        wait_until(hanging, timeout=180, what="the hanging check's forked child")
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)  # what a call's time limit does to the run
        proc.wait(timeout=30)
        wait_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
                   timeout=30, what="the forked check to die with its parent")
    finally:
        proc.kill()
        for child in children:  # (only if the test failed: they died with the parent)
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    summary = subprocess.run([sys.executable, str(SCRIPT), "--summarize", str(jsonl)], capture_output=True,
                             text=True, timeout=60)
    assert summary.returncode == 1, summary.stderr[-2000:]
    report = json.loads(summary.stdout)
    assert report["checks"]["mask_build"]["status"] == "pass"
    assert report["checks"]["hang"]["status"] == "cut"
    assert report["not_run"] == ["cuda_spans"] and not report["finished"] and not report["ok"]
    assert report["rerun"] == "--only hang,cuda_spans"


def test_without_cuda_it_skips_in_one_line_and_bad_names_are_refused() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = _run()
    assert proc.returncode == 0 and proc.stdout.count("\n") == 1 and "skipped" in proc.stdout
    proc = _run("--only", "nvml,bogus")
    assert proc.returncode == 2 and "bogus" in proc.stderr and proc.stderr.count("\n") == 1


def test_plan_lists_every_check_by_importance_within_the_total_budget() -> None:
    proc = _run("--plan", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    names = [c["name"] for c in plan["checks"]]
    assert names[0] == "prewarm"  # fills the shared compile cache before anything compiles
    assert {"flex_uneven", "device_shares", "memory_recipe", "host_gap", "checkpoint_1b", "thread_device",
            "sync_free", "flex_vs_sdpa", "throughput", "launch_bound", "dflash2_vocab", "fp8_cache_cuda",
            "eval_temperature", "muon_real_shape", "dspark", "eval_lossless"} <= set(names)
    # issue 44's checks in their order of importance
    new = ["dflash2_vocab", "fp8_cache_cuda", "eval_temperature", "muon_real_shape", "dspark", "eval_lossless"]
    assert [n for n in names if n in new] == new
    assert len(names) == len(set(names))
    # with each forked child's start allowance the budgets fit the total, which leaves a 15-minute lease
    # room for the machine's start and one rerun (docs/gpu.md)
    assert sum(c["budget_s"] + plan["start_allowance_s"] for c in plan["checks"]) <= plan["total_s"] <= 420
    assert all(c["budget_s"] > 0 for c in plan["checks"])
