"""The trainer end to end on a tiny random target: pipeline, telemetry, checkpoints, resume, failures.

Real processes and signals: the trainer runs as `python -m dflash train` where a test needs SIGKILL or
SIGTERM, and in-process where it compares weights.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import wait_until
from test_model_helpers import WORDS, make_target_dir, make_tokenizer, one_thread  # noqa: F401

from dflash.checkpoint_files import list_checkpoints, load_checkpoint
from dflash.telemetry.wire.reader import read_frames
from dflash.train.config.schema import make_config, read_saved
from dflash.train.trainer import Trainer

REPO = Path(__file__).resolve().parent.parent


def _write_data(path: Path, rows: int = 24, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
            # A learnable response: a repeating phrase, so the drafter has something to get right.
            response = " ".join(WORDS[(i * 3) % len(WORDS)] for i in range(rng.randint(24, 40)))
            f.write(json.dumps({"prompt": prompt, "response": response}) + "\n")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_target_dir(root / "target", layers=4, tokenizer=make_tokenizer())
    data = _write_data(root / "data.jsonl")
    return target, data


def _cfg(target: Path, data: Path, run_dir: Path, **kw):
    base = dict(target=str(target), data=str(data), run_dir=str(run_dir), batch_size=4, num_anchors=8,
                max_steps=6, log_every=0.2, telemetry=False, eval_prompts=0, checkpoint_every=1e9,
                lr=1e-3, drafter_layers=1)
    base.update(kw)
    return make_config({}, base)


def _cli(target: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dflash", "train", "--target", str(target), "--data", str(data),
            "--run-dir", str(run_dir), "--batch-size", "4", "--num-anchors", "8", "--drafter-layers", "1",
            "--eval-prompts", "0", *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.drafter.drafter.state_dict().items()}


def test_pipelined_run_streams_telemetry_and_checkpoints(setup, tmp_path):
    target, data = setup
    run_dir, socks = tmp_path / "run", Path("/tmp") / f"dft-train-{os.getpid()}"
    proc = subprocess.run(_cli(target, data, run_dir, "--max-steps", "6", "--log-every", "0.2",
                               "--telemetry-interval", "0.1", "--socket-dir", str(socks), "--eval-prompts", "2"),
                          capture_output=True, text=True, env=_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert re.search(r"attach:    \S*dflash-top ", out) and str(socks) in out
    assert "step      6/6 (100%) | 0:" in out and "| ETA 0:00 |" in out and "sim_tau" in out and "tok/s" in out
    # model FLOPs counted on the host, no peak known there: the TFLOP/s, and MFU n/a rather than a guess
    assert "mfu:       n/a (no peak for cpu)" in out and re.search(r"tok/s \| [\d.e+-]+ TFLOP/s MFU n/a \| lr ", out)
    # the final evaluation is a phase of its own, announced, with progress per prompt
    assert f"[phase] final evaluation on 2 held-out rows of --data {data}: 96 new tokens each" in out
    assert "[final evaluation] prompt 0/2" in out and "[final evaluation] prompt 2/2 |" in out
    # the verdict names the time it judged, with that time's evidence on the next line
    assert re.search(r"bottleneck \((last \d+ s|whole run)[^)]*\): \S+ - .*\n  evidence: ", out)
    assert "drafter-0/drafter_forward" in out
    assert "[eval] step 6: tau" in out
    # the default log is one line per interval: until the last one, nothing but progress lines, events,
    # and a verdict's reason and evidence when it changes (once each); the table after the last line
    lines = out.splitlines()
    progress = [i for i, line in enumerate(lines) if line.startswith("step ")]
    between = lines[progress[0]:progress[-1] + 1]
    assert all(line.startswith(("step ", "[", "bottleneck", "  evidence: ")) for line in between), between
    said = [re.match(r"bottleneck[^:]*: (\S+)", line).group(1) for line in between if line.startswith("bottleneck")]
    assert all(a != b for a, b in zip(said, said[1:], strict=False)), said
    assert not any(line.startswith("category ") for line in between)  # no table until the end
    assert max(i for i, line in enumerate(lines) if line.startswith("bottleneck")) > progress[-1]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step-00000006.pt"]
    saved = json.loads((run_dir / "config.json").read_text())  # nested by section, as a human reads it
    assert saved["run"]["max_steps"] == 6 and saved["pipeline"]["enabled"] is True
    assert saved["telemetry"]["telemetry_interval"] == 0.1 and "lr" not in saved
    stored = load_checkpoint(list_checkpoints(run_dir)[-1])["config"]
    assert stored == saved and read_saved(stored).to_dict() == saved
    frames = list(read_frames(run_dir / "telemetry.jsonl"))
    kinds = [type(f).__name__ for f in frames]
    assert kinds[0] == "Hello" and kinds[-1] == "Bye" and "Snapshot" in kinds
    hello = frames[0]
    assert {"target-0", "drafter-0", "batch-producer"} <= set(hello.threads.values()) | set(hello.workers)
    workers = set().union(*(f.cumulative.keys() for f in frames if type(f).__name__ == "Snapshot"))
    assert {"target-0", "drafter-0", "batch-producer"} <= workers
    last = [f for f in frames if type(f).__name__ == "Snapshot"][-1]
    assert last.counters["steps"] == 6 and last.counters["tokens"] > 0
    # the last snapshot judges the whole run, grouping the workers by the roles they registered
    assert last.bottleneck.scope.startswith("whole run") and last.roles["batch-producer"] == "data"
    assert "target_forward" in last.cumulative["target-0"] and "hs_queue_wait" in last.cumulative["drafter-0"]
    # per step, not per span: the pass and the LM head's chunks are one drafter_forward sample a step
    assert last.cumulative["drafter-0"]["drafter_forward"].n == 6
    assert len(last.metrics["per_position_acc"]) == 15
    assert last.gauges["max_steps"] == 6 and last.gauges["progress"] == 1.0 and last.gauges["train_time_s"] > 0
    # model FLOP/s while it trained (a wall-time window: after a long final evaluation it reads 0, truly);
    # on the CPU no peak, so no MFU
    snapshots = [f for f in frames if type(f).__name__ == "Snapshot"]
    assert max(f.gauges.get("tflops", 0.0) for f in snapshots) > 0
    assert not any("mfu" in f.gauges or "peak_tflops" in f.gauges for f in snapshots)
    assert (last.gauges["eval_done"], last.gauges["eval_total"]) == (2, 2)  # the evaluation reached the stream
    events = [f for f in frames if type(f).__name__ == "Event"]
    assert any(e.kind == "checkpoint" for e in events) and any(e.kind == "eval" for e in events)
    assert not any(socks.glob("*.sock")), "the socket must be removed at exit"


@pytest.mark.parametrize("recipe", [{}, {"optimizer": "muon", "loss": "kl"},
                                    {"optimizer": "muon", "position_weight": "dpace"}],
                         ids=["adamw-ce-exp", "muon-kl-exp", "muon-ce-dpace"])
def test_resume_is_exact(setup, tmp_path, recipe):
    """6 steps straight == 3 steps, stop (as on SIGTERM), resume, 3 more: same weights, bit for bit,
    for either optimizer's state (Muon's momentum and AdamW's moments for the rest) and objective."""
    target, data = setup
    straight = Trainer(_cfg(target, data, tmp_path / "a", **recipe), log=lambda s: None)
    assert straight.run() == 0

    class StopAtThree(Trainer):
        def on_step(self, r):
            if self.state.step == 2:  # becomes 3 inside on_step
                self.stop_requested.set()
            return super().on_step(r)

    first = StopAtThree(_cfg(target, data, tmp_path / "b", **recipe), log=lambda s: None)
    assert first.run() == 0 and first.state.step == 3
    second = Trainer(_cfg(target, data, tmp_path / "b", **recipe), resume=True, log=lambda s: None)
    assert second.run() == 0 and second.state.step == 6
    a, b = _params(straight), _params(second)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs after resume"
    assert second.state.next_batch == straight.state.next_batch == 6
    # And resuming really changed something relative to stopping at step 3.
    assert not all(torch.equal(_params(first)[k], b[k]) for k in b)


def test_sync_mode_trains_in_one_thread(setup, tmp_path):
    target, data = setup
    t = Trainer(_cfg(target, data, tmp_path / "s", pipeline=False, max_steps=3, telemetry=True,
                     socket_dir=str(Path("/tmp") / f"dft-sync-{os.getpid()}"), telemetry_interval=0.05),
                log=lambda s: None)
    assert t.run() == 0 and t.state.step == 3
    frames = list(read_frames(tmp_path / "s" / "telemetry.jsonl"))
    snaps = [f for f in frames if type(f).__name__ == "Snapshot"]
    assert set(snaps[-1].cumulative) == {"trainer"}
    assert {"target_forward", "drafter_forward", "drafter_backward"} <= set(snaps[-1].cumulative["trainer"])
    assert snaps[-1].cumulative["trainer"]["drafter_forward"].n == 3  # one sample a step (its spans' sum)


def test_worker_exception_stops_everything_promptly(setup, tmp_path, capsys):
    target, data = setup

    raised: list[float] = []

    class Exploding(Trainer):
        def on_step(self, r):
            if self.state.step == 1:
                raised.append(time.monotonic())
                raise RuntimeError("boom in the drafter")
            return super().on_step(r)

    t = Exploding(_cfg(target, data, tmp_path / "x", max_steps=100), log=lambda s: None)
    assert t.run() == 1
    # From the raise to run() returning, with every worker joined: the stand-in test
    # (test_train_pipeline_standins.py) holds the pipeline alone to 0.5 s; the whole trainer adds its
    # wind-down (no checkpoint, no evaluation after a failure), far below the 10 s join timeout.
    assert time.monotonic() - raised[0] < 5.0
    err = capsys.readouterr().err
    assert "worker drafter-0 failed" in err and "RuntimeError: boom in the drafter" in err
    assert not t.pipeline.running


def test_sigterm_checkpoints_and_exits_zero(setup, tmp_path):
    target, data = setup
    run_dir, socks = tmp_path / "t", Path("/tmp") / f"dft-term-{os.getpid()}"
    proc = subprocess.Popen(_cli(target, data, run_dir, "--max-steps", "100000", "--log-every", "0.1",
                                 "--socket-dir", str(socks), "--telemetry-interval", "0.1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _wait_for(lambda: "step " in _peek(run_dir), 180, proc)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert "received SIGTERM" in out
    assert f"to continue: dflash train --resume --run-dir {run_dir}" in out  # how to go on, after Ctrl-C too
    ckpts = list_checkpoints(run_dir)
    assert ckpts, "SIGTERM must leave a checkpoint"
    frames = list(read_frames(run_dir / "telemetry.jsonl"))
    assert type(frames[-1]).__name__ == "Bye"
    assert not any(socks.glob("*.sock"))


def _peek(run_dir: Path) -> str:
    """The run's progress as recorded (the telemetry file's step gauge), without reading the pipe."""
    path = run_dir / "telemetry.jsonl"
    if not path.exists():
        return ""
    steps = [f.gauges.get("step", 0) for f in read_frames(path) if type(f).__name__ == "Snapshot"]
    return f"step {int(max(steps))}" if steps and max(steps) >= 1 else ""


def _wait_for(cond, timeout: float, proc: subprocess.Popen) -> None:
    wait_until(cond, timeout, "the trainer", proc=proc,
               output=lambda: proc.communicate()[1][-2000:] if proc.poll() is not None else "")


def test_sigkill_mid_run_then_resume(setup, tmp_path):
    """SIGKILL at an arbitrary moment (possibly mid-checkpoint): every checkpoint left loads, partial
    writes are cleaned, and --resume continues from the newest one."""
    target, data = setup
    run_dir = tmp_path / "k"
    proc = subprocess.Popen(_cli(target, data, run_dir, "--max-steps", "100000", "--checkpoint-every", "0",
                                 "--no-telemetry", "--log-every", "100"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        _wait_for(lambda: len(list_checkpoints(run_dir)) >= 2, 180, proc)
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    ckpts = list_checkpoints(run_dir)
    assert ckpts
    for p in ckpts:  # nothing corrupted: every complete checkpoint loads
        state = torch.load(p, map_location="cpu", weights_only=True)
        assert state["state"]["step"] == int(p.stem.split("-")[1])
    newest = int(ckpts[-1].stem.split("-")[1])
    resumed = subprocess.run(_cli(target, data, run_dir, "--resume", "--max-steps", str(newest + 2),
                                  "--no-telemetry", "--log-every", "100", "--checkpoint-every", "1000"),
                             capture_output=True, text=True, env=_env(), timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from step {newest}" in resumed.stdout
    assert list_checkpoints(run_dir)[-1].name == f"step-{newest + 2:08d}.pt"
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--target-devices", "tpu:0"], "unknown device 'tpu:0'"),
        (["--drafter-device", "cuda:3"], "CUDA is not available"),
        (["--target-devices", "cuda:0"], "a CUDA target needs a CUDA drafter"),
        (["--data", "/nonexistent/data.jsonl"], "/nonexistent/data.jsonl: no such data file"),
        (["--config", "/nonexistent/cfg.toml"], "config file not found"),
        (["--target", "/nonexistent/model"], "/nonexistent/model"),
    ],
)
def test_bad_arguments_fail_at_once_with_one_line(setup, tmp_path, extra, message):
    target, data = setup
    proc = subprocess.run(_cli(target, data, tmp_path / "bad", "--max-steps", "1", *extra),
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_config_file_and_overrides(tmp_path):
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[train]\nlr = 1e-3\nbatch_size = 2\nmax_steps = 5\ntarget_devices = ["cpu", "cpu"]\n')
    from dflash.train.config import ConfigError
    from dflash.train.config.schema import load_toml

    cfg = make_config(load_toml(cfg_file), {"batch_size": 3})
    got = (cfg.optim.lr, cfg.data.batch_size, cfg.run.max_steps, cfg.pipeline.target_devices)
    assert got == (1e-3, 3, 5, ["cpu", "cpu"])
    bad = tmp_path / "bad.toml"
    bad.write_text("lr = [\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_toml(bad)
    with pytest.raises(ConfigError, match="unknown setting 'learning_rate'"):
        make_config({"learning_rate": 1.0, "max_steps": 1}, {})
    with pytest.raises(ConfigError, match="must be a number"):
        make_config({"lr": "fast", "max_steps": 1}, {})
    with pytest.raises(ConfigError, match="epochs must be positive"):
        make_config({"epochs": 0}, {})


def test_metrics_port_serves_prometheus_while_training(setup, tmp_path):
    """--metrics-port: a real scrape of the live trainer parses and carries its step count."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    target, data = setup
    run_dir = tmp_path / "m"
    proc = subprocess.Popen(_cli(target, data, run_dir, "--max-steps", "100000", "--metrics-port", "0",
                                 "--telemetry-interval", "0.1", "--log-every", "100",
                                 "--socket-dir", str(Path("/tmp") / f"dft-prom-{os.getpid()}")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()[-2000:]
            if line.startswith("metrics:"):
                url = line.split()[1]
        _wait_for(lambda: "step " in _peek(run_dir), 180, proc)
        time.sleep(0.3)
        body = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    families = {f.name: f for f in text_string_to_metric_families(body)}
    steps = [s.value for s in families["dflash_steps"].samples if s.name == "dflash_steps_total"]
    assert steps and steps[0] >= 1
    spans = {s.labels["category"] for s in families["dflash_span_seconds"].samples}
    assert {"target_forward", "drafter_forward", "hs_queue_wait"} <= spans
    assert proc.returncode == 0


def test_metrics_port_without_telemetry_is_refused():
    from dflash.train.config import ConfigError

    with pytest.raises(ConfigError, match="needs telemetry"):
        make_config({}, {"metrics_port": 0, "telemetry": False, "max_steps": 1})


def test_two_target_workers_feed_one_drafter_in_batch_order(setup, tmp_path):
    """Two target workers (one shared CPU replica) race; the drafter still consumes batches in order,
    so the result equals a one-worker run bit for bit."""
    target, data = setup
    one = Trainer(_cfg(target, data, tmp_path / "one", max_steps=5), log=lambda s: None)
    assert one.run() == 0
    two = Trainer(_cfg(target, data, tmp_path / "two", max_steps=5, target_devices=["cpu", "cpu"],
                       telemetry=True, telemetry_interval=0.05,
                       socket_dir=str(Path("/tmp") / f"dft-two-{os.getpid()}")), log=lambda s: None)
    assert two.run() == 0
    assert [t.name for t in two.targets] == ["target-0", "target-1"]
    a, b = _params(one), _params(two)
    assert all(torch.equal(a[k], b[k]) for k in a)
    snaps = [f for f in read_frames(tmp_path / "two" / "telemetry.jsonl") if type(f).__name__ == "Snapshot"]
    assert {"target-0", "target-1"} <= set(snaps[-1].cumulative)


def test_a_used_run_dir_needs_resume(setup, tmp_path, capsys):
    from dflash.train.trainer import train

    target, data = setup
    assert Trainer(_cfg(target, data, tmp_path / "u", max_steps=1), log=lambda s: None).run() == 0
    assert train(_cfg(target, data, tmp_path / "u", max_steps=2)) == 2
    assert "already holds checkpoints (newest step-00000001.pt); pass --resume" in capsys.readouterr().err


def test_the_final_evaluation_reaches_prometheus(setup, tmp_path):
    """/metrics outlives the run until a scrape has read its last snapshot, which carries the final
    evaluation's tau (the exporter used to close before any scrape could see it)."""
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    target, data = setup
    run_dir = tmp_path / "m"
    proc = subprocess.Popen(_cli(target, data, run_dir, "--max-steps", "3", "--metrics-port", "0",
                                 "--eval-prompts", "1",
                                 "--telemetry-interval", "0.1", "--metrics-linger", "120",
                                 "--socket-dir", str(Path("/tmp") / f"dft-linger-{os.getpid()}")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        url, lines = None, []
        while True:
            line = proc.stdout.readline()
            assert line, "".join(lines)[-2000:] + proc.stderr.read()[-2000:]
            lines.append(line)
            if line.startswith("metrics:   http"):
                url = line.split()[1]
            if line.startswith("metrics:   serving the final numbers"):
                break  # the run is over; the endpoint waits for us
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    tau = [s.value for s in families["dflash_eval_tau"].samples]
    assert tau and tau[0] >= 1.0
    evals = [json.loads(x) for x in (run_dir / "evals.jsonl").read_text().splitlines()]
    assert tau[0] == pytest.approx(evals[-1]["tau"])
    assert proc.returncode == 0 and "no scrape came" not in out, err[-2000:]
    with pytest.raises(urllib.error.URLError):  # and then it is gone
        urllib.request.urlopen(url, timeout=5)
