"""--report-to: a real run reports to TensorBoard, MLflow (local file store) and W&B (offline), and
each is read back with that tool's own reader: TensorBoard's event accumulator, MLflow's client, and
W&B's own record schema (its offline .wandb log; wandb ships no Python reader for it any more)."""

from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_model_helpers import make_target_dir, make_tokenizer
from test_train_pipeline import _cli, _write_data

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("trackers")
    target = make_target_dir(root / "target", layers=4, tokenizer=make_tokenizer())
    data = _write_data(root / "data.jsonl")
    run_dir = root / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": ""}
    proc = subprocess.run(_cli(target, data, run_dir, "--max-steps", "6", "--log-every", "0.2", "--eval-prompts", "1",
                               "--report-to", "tensorboard,wandb,mlflow",
                               "--telemetry-interval", "0.1",
                               "--socket-dir", str(Path("/tmp") / f"dft-trk-{os.getpid()}")),
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "trackers:  tensorboard, wandb, mlflow" in proc.stdout
    return run_dir, proc.stdout


def _eval_tau(run_dir: Path) -> float:
    return json.loads((run_dir / "evals.jsonl").read_text().splitlines()[-1])["tau"]


def test_tensorboard_reads_back_every_interval_and_the_evaluation(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = run
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/accuracy", "train/sim_tau", "train/tokens_per_s", "train/lr", "train/grad_norm",
            "train/acceptance_1", "eval/tau", "eval/acceptance_1"} <= tags
    assert any(t.startswith("share/drafter-0/") for t in tags) and "bottleneck/target-bound" in tags
    assert [e.step for e in acc.Scalars("train/loss")][-1] == 6
    assert acc.Scalars("eval/tau")[-1].value == pytest.approx(_eval_tau(run_dir))
    assert "config" in acc.Tags()["tensors"] or acc.Tags().get("tensors")  # the config as text


def test_mlflow_reads_back_params_and_metrics(run):
    from mlflow.tracking import MlflowClient

    run_dir, _ = run
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("dflash")
    (r,) = client.search_runs([exp.experiment_id])
    assert r.info.run_name == "run" and r.data.params["batch_size"] == "4" and r.data.params["max_steps"] == "6"
    assert r.data.params["report_to"] == "tensorboard,wandb,mlflow"
    assert [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")][-1] == 6
    assert client.get_metric_history(r.info.run_id, "eval/tau")[-1].value == pytest.approx(_eval_tau(run_dir))
    assert "share/drafter-0/drafter_forward" in r.data.metrics


def wandb_records(path: str) -> list:
    """The records of a .wandb file: W&B's header, then LevelDB-style log chunks in 32 KiB blocks, each
    record one `wandb_internal_pb2.Record` (the schema W&B syncs with)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, payload, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        payload += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(payload)
            out.append(rec)
            payload = b""
    return out


def test_wandb_offline_reads_back_history_and_config(run):
    run_dir, _ = run
    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(path)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    losses = [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert losses and losses[-1][0] == 6
    taus = [h["eval/tau"] for h in history if "eval/tau" in h]
    assert taus and taus[-1] == pytest.approx(_eval_tau(run_dir))
    config = {i.key: json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "run"
              for i in r.run.config.update}
    assert config["batch_size"] == 4 and config["report_to"] == ["tensorboard", "wandb", "mlflow"]


def test_a_missing_tracker_package_is_one_line_before_any_work(tmp_path):
    """wandb made unimportable in a child process (a meta-path finder refuses it), as on a machine
    without the extra."""
    code = (
        "import sys\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'wandb': raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "from dflash.cli import main\n"
        f"sys.exit(main(['train', '--max-steps', '1', '--report-to', 'wandb', '--run-dir', {str(tmp_path / 'r')!r}]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("dflash train: error: --report-to wandb needs the wandb package: "
                                                 "pip install 'dflash-trainer[wandb]' (or pip install wandb)")
    assert not (tmp_path / "r").exists()


def test_an_unknown_tracker_is_refused_at_load():
    from dflash.train.config import ConfigError
    from dflash.train.config.schema import make_config

    with pytest.raises(ConfigError, match="report_to: unknown tracker 'comet'; choose from tensorboard, wandb, mlflow"):
        make_config({}, {"report_to": "comet", "max_steps": 1})
    assert make_config({}, {"report_to": "none", "max_steps": 1}).telemetry.report_to == []
