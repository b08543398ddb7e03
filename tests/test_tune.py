"""`dflash tune`: the chooser's decisions on constructed verdicts, a real tune of two trials killed and
resumed, no trial process or socket outliving it, and bad flags in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, wait_until

from dflash.cli import main
from dflash.telemetry.wire.protocol import Event
from dflash.telemetry.wire.reader import read_frames
from dflash.telemetry.wire.sockets import parse_socket_filename, pid_alive
from dflash.tune import table as T
from dflash.tune.knobs import FROZEN, KNOBS, MOVES, Machine, advice, choose, gained, moves

CPU = {"target_devices": ["cpu"], "drafter_device": "cpu", "pipeline": True, "threads_per_worker": 1,
       "batch_queue_size": 4, "hs_queue_size": 2}
GPU = {**CPU, "target_devices": ["cuda:0"], "drafter_device": "cuda:0", "threads_per_worker": None}
TWO_CORES = Machine(cores=2)


def trial(settings, verdict, rate=1000.0, spread=10.0, **kw):
    return {"settings": dict(settings), "verdict": verdict, "tokens_per_s": rate, "spread": spread,
            "status": "ok", **kw}


def test_first_trial_is_the_start_and_frozen_settings_are_never_moves():
    d = choose(CPU, [], TWO_CORES)
    assert d.settings == CPU and d.stop is None
    for verdict in [*MOVES, "balanced", "unknown", "launch-bound", "input-bound"]:
        for s in (CPU, GPU, {**CPU, "pipeline": False, "threads_per_worker": 8, "target_devices": ["cpu", "cpu"]}):
            for mv in moves(dict(s), verdict, Machine(cores=16, gpus=4)):
                assert set(mv.changes) <= set(KNOBS) and not set(mv.changes) & set(FROZEN)


def test_each_verdict_picks_its_side():
    # CPU-starved: fewer threads
    d = choose(CPU, [trial({**CPU, "threads_per_worker": 4}, "CPU-starved")], Machine(cores=8))
    assert d.changes == {"threads_per_worker": 2}
    # target-bound on GPUs: another target worker on an idle GPU
    d = choose(GPU, [trial(GPU, "target-bound")], Machine(cores=16, gpus=2))
    assert d.changes == {"target_devices": ["cuda:0", "cuda:1"]}
    # drafter-bound with a CPU drafter and a GPU here: the drafter moves to it
    d = choose(CPU, [trial(CPU, "drafter-bound")], Machine(cores=4, gpus=1))
    assert d.changes == {"drafter_device": "cuda:0"}
    # data-bound: more batches built ahead
    d = choose(CPU, [trial(CPU, "data-bound")], TWO_CORES)
    assert d.changes == {"batch_queue_size": 8}
    # the pipeline off: turned on before anything else (its loop has no stages to judge)
    d = choose(CPU, [trial({**CPU, "pipeline": False}, "unknown")], TWO_CORES)
    assert d.changes == {"pipeline": True}
    # threads oversubscribing the cores: fewer, whatever the stage verdict
    d = choose(CPU, [trial({**CPU, "threads_per_worker": 4}, "drafter-bound")], TWO_CORES)
    assert d.changes == {"threads_per_worker": 2}


def test_stops_when_balanced_or_no_gain_beyond_noise():
    d = choose(CPU, [trial(CPU, "balanced")], TWO_CORES)
    assert d.settings is None and "balanced" in d.stop
    start = trial({**CPU, "hs_queue_size": 1}, "drafter-bound", rate=1000, spread=50)
    within = trial(CPU, "drafter-bound", rate=1040, spread=30)  # +40 < noise 50
    assert not gained(within, [start])
    d = choose(CPU, [start, within], TWO_CORES)
    assert d.settings is None and "less than its noise" in d.stop
    # with patience 2 it goes on from the best trial with the next untried move
    d = choose(CPU, [start, within], TWO_CORES, patience=2)
    assert d.settings is not None and d.settings != within["settings"]
    beyond = trial(CPU, "drafter-bound", rate=1100, spread=30)
    assert gained(beyond, [start])
    # nothing left to try for the best trial's verdict: stop and say so
    d = choose(CPU, [trial(CPU, "input-bound")], TWO_CORES)
    assert d.settings is None and "no untried setting" in d.stop


def test_advice_names_a_frozen_setting_with_its_evidence():
    said = advice(trial(CPU, "CPU-starved", stage_verdict="drafter-bound",
                        evidence={"drafter.busy": 0.97, "target.hs_queue_put": 0.35}))
    assert said.startswith("num_anchors") and "drafter.busy 97%" in said
    assert advice(trial(CPU, "balanced")) is None


def test_best_settings_toml_reads_back_as_a_train_config(tmp_path):
    from dflash.train.config.schema import load_toml, make_config

    values = {**CPU, "target_layer_ids": [1, 3, 5], "data": "demo", "lr": 3e-3, "max_time": 60.0, "report_to": []}
    p = tmp_path / "best.toml"
    p.write_text(T.toml_text(values, ["a header"]))
    cfg = make_config(load_toml(p), {})
    assert cfg.pipeline.hs_queue_size == 2 and cfg.model.target_layer_ids == [1, 3, 5] and cfg.optim.lr == 3e-3


@pytest.mark.parametrize("argv, says", [
    (["--trials", "0"], "--trials must be at least 1"),
    (["--run-dir", "x"], "give --tune-dir"),
    (["--resume"], "--resume needs --tune-dir"),
    (["--trails", "3"], "did you mean --trials"),
    (["--hs-queue-size", "0", "--tune-dir", "{tmp}/t"], "hs_queue_size must be positive"),
    (["--resume", "--tune-dir", "{tmp}/none"], "no tune table here"),
])
def test_bad_flags_are_one_line(argv, says, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) if argv[0] == "--trails" else _no_raise():
        rc = main(["tune", *argv])
        assert rc == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1
    assert not (tmp_path / "t").exists()  # nothing made for a tune that never started


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_resume_ends_the_trial_a_killed_tune_left_running(tmp_path):
    from dflash.commands.tune import _stop_leftover

    run_dir = tmp_path / "trial-01"
    # a real process in its own session that names the trial's run dir, as a trial's command line does
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", str(run_dir)],
                              start_new_session=True)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        _stop_leftover({"running": {"index": 1, "pid": stranger.pid, "run_dir": str(run_dir)}}, tmp_path)
        assert stranger.poll() is None  # not a trial: left alone
        _stop_leftover({"running": {"index": 1, "pid": orphan.pid, "run_dir": str(run_dir)}}, tmp_path)
        assert orphan.wait(timeout=30) is not None
    finally:
        for p in (orphan, stranger):
            if p.poll() is None:
                p.kill()
                p.wait()


def _sockets(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if parse_socket_filename(p.name) is not None] if d.exists() else []


@pytest.mark.slow
def test_a_real_tune_killed_mid_trial_resumes_and_leaves_nothing(tmp_path, sock_dir):
    """Two real trials of a few seconds: oversubscribed threads at the start, fewer in trial 2. The tune is
    stopped (SIGTERM) during trial 2: no trial process or socket survives it, and --resume measures trial
    2 again from the start, trial 1 kept as it was."""
    tune_dir = tmp_path / "tune"
    cores = len(os.sched_getaffinity(0))  # two workers with this many threads each oversubscribe any machine
    cmd = [sys.executable, "-m", "dflash", "tune", "--tune-dir", str(tune_dir), "--trials", "2",
           "--trial-time", "5", "--threads-per-worker", str(cores), "--hs-queue-size", "1",
           "--telemetry-interval", "0.5",
           "--socket-dir", str(sock_dir), "--no-gil-probe"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "tune.log"
    table_path = tune_dir / T.TABLE_NAME

    def table():
        try:
            return json.loads(table_path.read_text())
        except (OSError, ValueError):
            return {}

    with log.open("w") as out:
        tune = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: len(table().get("trials", [])) == 1 and (table().get("running") or {}).get("index") == 2,
                       timeout=90, what="trial 2 running", proc=tune, output=log.read_text)
            trial_pid = table()["running"]["pid"]
            wait_until(lambda: _sockets(sock_dir), timeout=60, what="trial 2's socket", proc=tune,
                       output=log.read_text)
            tune.send_signal(signal.SIGTERM)
            assert tune.wait(timeout=60) == 130
        finally:
            if tune.poll() is None:
                tune.kill()
                tune.wait()
    assert not pid_alive(trial_pid), "trial 2 outlived the tune"
    assert _sockets(sock_dir) == []
    first = table()["trials"][0]
    assert first["status"] == "ok" and first["tokens_per_s"] > 0 and first["verdict"]
    assert first["settings"]["threads_per_worker"] == cores and first["settings"]["hs_queue_size"] == 1
    # the trial announced itself as a phase on its telemetry (what dflash-top shows)
    phases = [f.message for f in read_frames(Path(first["run_dir"]) / "telemetry.jsonl")
              if isinstance(f, Event) and f.kind == "phase"]
    assert any(f"tune {tune_dir.name}: trial 1" in m for m in phases)

    r = subprocess.run([sys.executable, "-m", "dflash", "tune", "--resume", "--tune-dir", str(tune_dir),
                        "--trials", "2"], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    done = table()
    assert len(done["trials"]) == 2 and done["trials"][0] == first
    second = done["trials"][1]
    # 2 workers x all the cores' threads: fewer threads, whatever the verdict; the math untouched
    assert second["changes"] == {"threads_per_worker": max(1, cores // 2)}, second
    assert "--trials 2 reached" in done["stopped"] or "noise" in done["stopped"]
    assert "tok/s" in r.stdout and "best settings:" in r.stdout
    assert not pid_alive(second["pid"]) and _sockets(sock_dir) == []
    from dflash.train.config.schema import load_toml, make_config

    best = make_config(load_toml(tune_dir / "best.toml"), {})
    assert best.pipeline.hs_queue_size == 1 and best.data.batch_size == 8  # the user's own settings kept


@pytest.mark.slow
async def test_dflash_top_follows_the_tune_trial_by_trial(tmp_path, sock_dir):
    """dflash-top attached to a tune's first trial shows it as a phase on the screen, then, when that trial
    ends, finds the next trial's socket (the same run name) and shows trial 2."""
    from conftest import screen_text, until

    from dflash_tui.app import DFlashTop

    cmd = [sys.executable, "-m", "dflash", "tune", "--tune-dir", str(tmp_path / "follow"), "--trials", "2",
           "--trial-time", "5", "--telemetry-interval", "0.5", "--socket-dir", str(sock_dir), "--no-gil-probe"]
    tune = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _sockets(sock_dir), timeout=90, what="trial 1's socket", proc=tune)
        app = DFlashTop(_sockets(sock_dir)[0])
        async with app.run_test(size=(140, 44)) as pilot:
            for n in (1, 2):
                await until(pilot, lambda n=n: f"follow: trial {n}" in screen_text(app), f"trial {n}'s phase",
                            timeout=120)
    finally:
        tune.send_signal(signal.SIGTERM)  # the tune stops its trial (its own process group) cleanly
        try:
            tune.wait(timeout=60)
        except subprocess.TimeoutExpired:
            tune.kill()
            tune.wait()
