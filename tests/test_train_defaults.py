"""A bare `dflash train` makes sense: the recipe this machine can run, one pass over the data, and a
fresh run directory every time (so a second run, or a second `make demo`, never collides)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from test_model_helpers import make_target_dir, make_tokenizer
from test_train_pipeline import _write_data

from dflash.train.config.recipes import CPU_RECIPE, TINY_CPU_TAPS, hardware_recipe
from dflash.train.config.schema import load_toml, make_config
from dflash.train.trainer import train

ROOT = Path(__file__).resolve().parent.parent


def test_no_limit_means_one_epoch_in_a_fresh_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = make_config({}, {})
    assert (first.run.epochs, first.run.max_steps, first.run.max_time) == (1.0, None, None)
    assert re.fullmatch(r"runs/train-\d{8}-\d{6}", first.run.run_dir), first.run.run_dir
    Path(first.run.run_dir).mkdir(parents=True)
    second = make_config({}, {})  # even within the same second
    assert second.run.run_dir != first.run.run_dir and not Path(second.run.run_dir).exists()
    assert make_config({}, {"max_time": 5}).run.epochs is None  # a given limit is the only one


def test_ranks_under_torchrun_name_their_fresh_run_dir_after_the_job_and_refuse_a_job_without_one(tmp_path,
                                                                                                    monkeypatch):
    """Each rank makes its config alone: the job's run id is the name they all agree on. Without --rdzv-id
    torchrun calls every job 'none' (multi-node launches with --master-addr or c10d): one directory for all
    jobs, so it is refused and --run-dir asked for."""
    from dflash.train.config import ConfigError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert make_config({}, {}).run.run_dir == "runs/train-job-7"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(ConfigError, match="give --run-dir"):
        make_config({}, {})
    assert make_config({}, {"run_dir": "runs/mine"}).run.run_dir == "runs/mine"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU recipe is chosen only without CUDA")
def test_without_cuda_the_cpu_recipe_is_chosen_and_said():
    recipe, line = hardware_recipe("tiny")
    assert recipe == {**CPU_RECIPE, "target_layer_ids": TINY_CPU_TAPS}
    assert line.startswith("recipe: no CUDA here, the CPU-scaled one") and "\n" not in line
    other, _ = hardware_recipe("/models/some-hf-model")  # the tiny target's taps fit only the tiny target
    assert "target_layer_ids" not in other
    cfg = make_config({}, {"batch_size": 4}, recipe)  # flags still win over the recipe
    assert (cfg.data.batch_size, cfg.model.num_anchors, cfg.model.drafter_layers) == (4, 24, 1)


def test_the_cpu_recipe_is_what_configs_tiny_cpu_holds():
    toml = load_toml(ROOT / "configs" / "tiny-cpu.toml")
    assert {k: toml[k] for k in CPU_RECIPE} == CPU_RECIPE
    assert toml["target_layer_ids"] == TINY_CPU_TAPS


def test_epochs_bound_the_run_by_steps(tmp_path, capsys):
    target = make_target_dir(tmp_path / "target", layers=4, tokenizer=make_tokenizer())
    data = _write_data(tmp_path / "data.jsonl", rows=24)
    cfg = make_config({}, dict(target=str(target), data=str(data), run_dir=str(tmp_path / "run"), batch_size=4,
                               num_anchors=8, drafter_layers=1, telemetry=False, eval_prompts=0,
                               checkpoint_every=1e9, epochs=1.5))
    assert train(cfg) == 0
    out = capsys.readouterr().out
    per_epoch = int(re.search(r"epochs: +1\.5 x (\d+) steps per pass", out).group(1))
    assert cfg.run.max_steps == -(-3 * per_epoch // 2)  # ceil(1.5 * per_epoch)
    assert f"done: {cfg.run.max_steps} steps" in out


def test_make_demo_twice_gets_two_run_dirs(tmp_path):
    """Without tmux the demo prints its two commands; each run gets its own directory."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "cat", "date", "tput"):
        found = next((Path(d) / tool for d in ("/usr/bin", "/bin") if (Path(d) / tool).exists()), None)
        if found is not None:
            (bin_dir / tool).symlink_to(found)
    env = {**os.environ, "PATH": str(bin_dir)}
    env.pop("RUN_DIR", None)
    dirs = []
    for _ in range(2):
        r = subprocess.run([str(bin_dir / "bash"), str(ROOT / "scripts" / "demo.sh")], env=env, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0 and "tmux is not installed" in r.stdout, r.stdout + r.stderr
        dirs.append(re.search(r"--run-dir (\S+)", r.stdout).group(1))
        assert f"dflash-top --wait {dirs[-1]}" in r.stdout
        (ROOT / dirs[-1]).mkdir(parents=True)  # what the first run's trainer creates
    try:
        assert dirs[0] != dirs[1] and re.fullmatch(r"runs/demo-\d{8}-\d{6}(-\d+)?", dirs[0])
    finally:
        for d in dirs:
            (ROOT / d).rmdir()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
def test_a_second_demo_never_starts_a_second_trainer(tmp_path):
    """On a private tmux server: a second detached `make demo` says the session is open and starts
    nothing (one message, not two that contradict); from inside tmux, a second one switches to the
    first one's window instead of opening another. The script runs from a copy of the repository
    without a venv, so its panes start no trainer here."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "demo.sh", repo / "scripts")
    (tmp_path / "tmux").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("TMUX", "TMUX_PANE", "RUN_DIR")}
    env["TMUX_TMPDIR"] = str(tmp_path / "tmux")

    def run(*cmd: str, **extra: str) -> str:
        r = subprocess.run(cmd, env={**env, **extra}, capture_output=True, text=True, timeout=30, cwd=repo)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def demo(**extra: str) -> str:
        return run("bash", str(repo / "scripts" / "demo.sh"), **extra)

    try:
        first = demo(DEMO_DETACHED="1")
        assert first.startswith("tmux session dflash-demo started: the trainer (run dir runs/demo-"), first
        assert demo(DEMO_DETACHED="1") == (
            "a dflash-demo tmux session is already open; not starting another (tmux attach -t dflash-demo to watch "
            "it; tmux kill-session -t dflash-demo, then make demo, to start a new run)\n")
        # inside tmux: a session of the user's own, as the demo sees it from one of its panes
        run("tmux", "new-session", "-d", "-s", "work", "sleep 600")
        where = run("tmux", "display-message", "-p", "-t", "work", "#{socket_path},#{pid},#{session_id},#{pane_id}")
        socket_path, pid, session, pane = where.strip().split(",")
        inside = {"TMUX": f"{socket_path},{pid},{session.lstrip('$')}", "TMUX_PANE": pane}
        assert demo(**inside).startswith("demo started in tmux window dflash-demo")
        assert demo(**inside) == ("a dflash-demo window is already open in this tmux session; switching to it "
                                  "(close it, then make demo, to start a new run)\n")
        windows = run("tmux", "list-windows", "-t", "work", "-F", "#{window_name}").split()
        assert windows.count("dflash-demo") == 1 and len(windows) == 2, windows
        assert run("tmux", "display-message", "-p", "-t", "work", "#{window_name}").strip() == "dflash-demo"
    finally:
        subprocess.run(["tmux", "kill-server"], env=env, capture_output=True, timeout=30)


def test_make_train_is_a_step_budget_and_a_limit_flag_replaces_it():
    """The demo's result must not depend on the machine: it ends after a number of steps, not seconds.
    A limit given on the command line replaces the file's (`--max-time 600` trains 600 s)."""
    toml = load_toml(ROOT / "configs" / "tiny-cpu.toml")
    cfg = make_config(toml, {})
    assert cfg.run.max_steps and (cfg.run.max_time, cfg.run.epochs) == (None, None)
    cfg = make_config(toml, {"max_time": 600.0})
    assert (cfg.run.max_steps, cfg.run.max_time) == (None, 600.0)
    assert make_config(toml, {"max_steps": 5}).run.max_steps == 5
