"""Health signals against real faults in real trainer processes (DFLASH_FAULT): a hang is caught by the
stall watchdog with its stack and training goes on; --on-stall exit checkpoints and exits 3; NaN steps
are skipped on the optimizer and, K in a row, stop the run with the last good state saved."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from test_model_helpers import make_target_dir, make_tokenizer
from test_train_pipeline import _cli, _env, _write_data

from dflash.checkpoint_files import list_checkpoints
from dflash.telemetry.wire.protocol import Event, Snapshot
from dflash.telemetry.wire.reader import read_frames
from dflash.telemetry.wire.vocab import WAIT_SUFFIXES
from dflash.train.health.faults import FaultPlan, FaultSpecError, parse


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("health")
    target = make_target_dir(root / "target", layers=4, tokenizer=make_tokenizer())
    return target, _write_data(root / "data.jsonl")


def _train(setup, run_dir: Path, fault: str | None, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    target, data = setup
    env = _env()
    env.pop("DFLASH_FAULT", None)
    if fault is not None:
        env["DFLASH_FAULT"] = fault
    return subprocess.run(_cli(target, data, run_dir, "--telemetry-interval", "0.2", "--socket-dir",
                               str(run_dir.parent / "socks"), *extra),
                          capture_output=True, text=True, env=env, timeout=timeout)


def _frames(run_dir: Path) -> tuple[list[Event], list[Snapshot]]:
    frames = list(read_frames(run_dir / "telemetry.jsonl"))
    return [f for f in frames if isinstance(f, Event)], [f for f in frames if isinstance(f, Snapshot)]


def test_a_hang_is_caught_with_its_stack_and_training_continues(setup, tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(setup, run_dir, "hang:drafter:step=3:seconds=6", "--max-steps", "6", "--stall-timeout", "1.5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fault injection (DFLASH_FAULT): hang drafter at step 3" in proc.stdout
    events, snaps = _frames(run_dir)
    stalls = [e for e in events if e.kind == "stall"]
    assert len(stalls) == 1, [e.message for e in events]  # the targets wait on a queue: not stalls
    st = stalls[0]
    assert st.data["worker"] == "drafter-0" and st.data["category"] == "drafter_forward"
    assert "injected_hang" in st.data["frame"]
    # caught while the hang lasted, not when it ended
    assert st.data["elapsed"] < 6.0
    recovered = [e for e in events if e.kind == "recovered"]
    assert len(recovered) == 1 and recovered[0].t > st.t and "drafter-0" in recovered[0].message
    stack = Path(st.data["stack_file"]).read_text()
    mine = stack.split("\n\n")[1]  # the header, then the stalled thread's block first
    assert '"drafter-0" (stalled)' in mine and "injected_hang" in mine and "time.sleep" not in mine
    native = list((run_dir / "stalls").glob("*-native.txt"))
    assert len(native) == 1 and native[0].read_text().strip()  # py-spy's dump, or why there is none
    stalled = [s for s in snaps if s.stalls]
    assert stalled and stalled[0].stalls[0].worker == "drafter-0"
    assert stalled[0].inflight["drafter-0"].category == "drafter_forward"
    assert snaps[-1].counters["steps"] == 6 and not snaps[-1].stalls  # training went on to the end


def test_on_stall_exit_checkpoints_and_exits_3(setup, tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(setup, run_dir, "hang:drafter:step=3:seconds=120", "--max-steps", "100", "--stall-timeout",
                  "1.5", "--on-stall", "exit", timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "drafter-0 stalled in drafter_forward" in line and "checkpointed step 3" in line, line
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000003.pt"]


def test_nan_steps_are_skipped_then_three_in_a_row_stop_the_run(setup, tmp_path):
    one = _train(setup, tmp_path / "one", "nan:drafter:step=2", "--max-steps", "4")
    assert one.returncode == 0, one.stderr[-3000:]
    events, snaps = _frames(tmp_path / "one")
    bad = [e for e in events if e.kind == "nonfinite"]
    assert len(bad) == 1 and bad[0].data["step"] == 3 and bad[0].data["batch"] == 2

    # a constant learning rate, so that runs of different lengths take the same first steps
    flat = tmp_path / "flat.toml"
    flat.write_text("warmup_ratio = 0.0\nmin_lr_ratio = 1.0\n")
    stop = _train(setup, tmp_path / "stop", "nan:drafter:from_step=2", "--max-steps", "100", "--config", str(flat))
    assert stop.returncode == 1, stop.stderr[-3000:]
    line = stop.stderr.strip().splitlines()[-1]
    assert "3 non-finite steps in a row (steps 3-5, batches 2-4)" in line and "last good state (step 2)" in line
    # the saved state is exactly that of a clean run stopped after step 2: the skipped steps moved
    # neither the weights nor AdamW's moments and step count
    clean = _train(setup, tmp_path / "clean", None, "--max-steps", "2", "--config", str(flat))
    assert clean.returncode == 0, clean.stderr[-3000:]
    a = torch.load(list_checkpoints(tmp_path / "stop")[-1], weights_only=False)
    b = torch.load(list_checkpoints(tmp_path / "clean")[-1], weights_only=False)
    assert a["state"]["step"] == 5 and b["state"]["step"] == 2
    for k, v in b["drafter"].items():
        assert torch.equal(a["drafter"][k], v), k
    for i, st in b["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(a["optimizer"]["state"][i][k], v), (i, k)


@pytest.mark.parametrize("spec, msg", [
    ("hang:drafter:step=2", "hang needs seconds=S"),
    ("boom:drafter", "unknown kind 'boom'"),
    ("slow:target:factor=0.5", "slow needs factor=F (> 1)"),
    ("nan:target:step=1", "use nan:drafter"),
    ("hang:drafter:step=x:seconds=1", "step must be an integer"),
    ("hang:drafter:step=1:from_step=2:seconds=1", "not both"),
    ("hang:gpu:seconds=1", "unknown stage 'gpu'"),
])
def test_bad_fault_specs_are_one_line_errors(spec: str, msg: str) -> None:
    with pytest.raises(FaultSpecError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        parse(spec)


def test_fault_matching() -> None:
    faults = parse("hang:target-1:step=5:seconds=1:rank=1; slow:target:factor=3:from_step=4:count=2")
    assert [f.kind for f in faults] == ["hang", "slow"]
    hang, slow = faults
    assert hang.hits("target-1", 5, 1) and not hang.hits("target-0", 5, 1) and not hang.hits("target-1", 5, 0)
    assert [s for s in range(10) if slow.hits("target-3", s, 0)] == [4, 5]
    assert FaultPlan(parse("nan:drafter:step=7"), 0).poison(7) and not FaultPlan(parse("nan:drafter:step=7")).poison(8)


def test_a_bad_spec_stops_the_trainer_with_one_line(setup, tmp_path):
    proc = _train(setup, tmp_path / "run", "hang:drafter", "--max-steps", "2", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "dflash train: error: DFLASH_FAULT 'hang:drafter': hang needs seconds=S (> 0)"]


def test_a_slowdown_raises_one_anomaly(setup, tmp_path):
    """Normal for 6 s of training (the baseline forms, whatever the machine's speed; nothing may be
    raised), then every target forward takes 4x as long: one anomaly, on that worker and category (the
    drafter's longer waits are not another)."""
    run_dir = tmp_path / "run"
    proc = _train(setup, run_dir, "slow:target:factor=4:after_s=6", "--max-time", "20", "--log-every", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    events, snaps = _frames(run_dir)
    anomalies = [e for e in events if e.kind == "anomaly"]
    # One for the slowed stage, raised first; the drafter's longer waits raise none. (A knock-on
    # deviation of another worker's own work may follow: the producer's batch_build p95 on 2 shared
    # cores, or the drafter's optimizer_step when another process takes a core: it is real, and not
    # the fault's stage.)
    assert [(e.data["worker"], e.data["category"]) for e in anomalies].count(("target-0", "target_forward")) == 1
    waits = [e for e in anomalies
             if e.data["worker"].startswith("drafter") and e.data["category"].endswith(WAIT_SUFFIXES)]
    assert not waits, [e.message for e in anomalies]
    a = anomalies[0]
    assert (a.data["worker"], a.data["category"]) == ("target-0", "target_forward") and a.data["ratio"] >= 2
    assert a.message.startswith("target-0/target_forward ") and "x its baseline (" in a.message
    assert any(s.anomalies and s.anomalies[0].category == "target_forward" for s in snaps)
    first_step = min(s.t for s in snaps if s.counters.get("steps", 0) > 0)
    assert min(s.t for s in snaps if s.anomalies) >= first_step + 5  # not before the slowdown


def test_a_stopped_rank_makes_rank_0_report_its_stalled_allreduce(tmp_path, tmp_path_factory):
    """2 ranks; rank 1 gets SIGSTOP. Rank 0's drafter then waits in the gradient all-reduce: its
    watchdog reports that stall, with the stack, long before the 60 s collective timeout."""
    import os
    import signal
    import time

    from test_train_distributed import _finish, _launch, _wait_for_rank_0_to_hear_from, _wait_for_training

    root = tmp_path_factory.mktemp("dist-health")
    target = make_target_dir(root / "target", layers=4, tokenizer=make_tokenizer())
    data = _write_data(root / "data.jsonl", rows=48)
    socks, run = tmp_path / "socks", tmp_path / "run"
    proc = _launch(target, data, run, socks, "--max-steps", "100000", "--collective-timeout", "60",
                   "--stall-timeout", "3")
    pids = {}
    try:
        pids = _wait_for_training(proc, socks)
        _wait_for_rank_0_to_hear_from(run, pids[1])
        os.kill(pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        stall = None
        while stall is None and time.monotonic() - t0 < 40:
            stall = next((f for f in read_frames(run / "telemetry.jsonl")
                          if isinstance(f, Event) and f.kind == "stall" and f.data["worker"] == "drafter-0"), None)
            time.sleep(0.2)
        assert stall is not None, "rank 0 reported no stall"
        assert time.monotonic() - t0 < 30  # the collective timeout is 60 s
        block = Path(stall.data["stack_file"]).read_text().split("\n\n")[1]
        assert '"drafter-0" (stalled)' in block
        # stuck in the all-reduce: DDP's backward, or the per-step agreement, both wait on gloo
        assert any(w in block for w in ("backward", "all_reduce", "allreduce", "wait", "exchange")), block
    finally:
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        _finish(proc, timeout=60)
