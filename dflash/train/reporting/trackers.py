"""Experiment trackers (`--report-to tensorboard,wandb,mlflow`): the numbers of each log interval and
each evaluation, and the resolved config as hyperparameters, sent to the tools a team already uses.

Each tracker is an optional extra (`pip install 'dflash-trainer[tensorboard]'`, `[wandb]`, `[mlflow]`):
a missing package is one line of error at start, before any training. Only rank 0 reports (the ranks
train one model). Where each writes:

* tensorboard: `<run_dir>/tensorboard/` (point `tensorboard --logdir` at it or at `runs/`)
* mlflow: `$MLFLOW_TRACKING_URI` if set, else a local store in `<run_dir>/mlruns`; experiment
  `$MLFLOW_EXPERIMENT_NAME` or "dflash"; the run is named after the dflash run
* wandb: project `$WANDB_PROJECT` or "dflash", files under `<run_dir>/wandb`; `WANDB_MODE=offline`
  keeps everything local (`wandb sync` uploads it later)

A tracker that fails while the run goes on is reported once and dropped: training never stops or
slows for a tracker.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash.telemetry.wire.verdicts import VERDICTS
from dflash.telemetry.wire.vocab import term_gauge

#: --report-to name -> (module that must import, pip extra)
KNOWN = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


class TrackerError(RuntimeError):
    """A tracker that cannot start; the message says how to fix it."""


def check_available(names: list[str]) -> None:
    """Fail in one line, before any work, for a tracker whose package is not installed."""
    for name in names:
        module, extra = KNOWN[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or blocked install counts as missing
            found = False
        if not found:
            raise TrackerError(f"--report-to {name} needs the {module} package: pip install "
                               f"'dflash-trainer[{extra}]' "
                               f"(or pip install {module if name != 'mlflow' else 'mlflow-skinny'})")


def flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    """Config values as hyperparameters: None as "none" and lists as text (what every tool accepts)."""
    return {k: ("none" if v is None else ",".join(map(str, v)) if isinstance(v, list) else v)
            for k, v in config.items()}


class TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in config.items()))
        self._config = flatten(config)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, final: Mapping[str, float]) -> None:
        # hyperparameters with the run's last numbers (TensorBoard's HParams tab compares runs by them),
        # in a subdirectory so that they do not add a step-0 point to every curve
        self.writer.add_hparams({k: v for k, v in self._config.items() if isinstance(v, (int, float, str, bool))},
                                dict(final), run_name="hparams")
        self.writer.close()


class MLflow:
    name = "mlflow"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # a file store next to the run needs no server or database (MLflow 3 keeps it working but
            # asks for this opt-in; give MLFLOW_TRACKING_URI for a tracking server or sqlite)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "dflash"))
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params(flatten(config))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.mlflow.log_metrics(dict(scalars), step=step)

    def close(self, final: Mapping[str, float]) -> None:
        self.mlflow.end_run()


class Wandb:
    name = "wandb"

    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        import wandb

        (run_dir / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dflash"), name=run_name, dir=str(run_dir),
                              config=dict(config))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self, final: Mapping[str, float]) -> None:
        self.run.finish()


OPENERS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": Wandb}


class Trackers:
    """The trackers of one run, fed by the trainer's main thread at each log line and evaluation."""

    def __init__(self, names: list[str], run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        check_available(names)
        self.active: list[Any] = []
        self._final: dict[str, float] = {}
        for name in names:
            try:
                self.active.append(OPENERS[name](run_dir, run_name, config))
            except Exception as e:  # noqa: BLE001 - any failure to start is the user's to fix, in one line
                self.close()
                raise TrackerError(f"--report-to {name}: cannot start ({type(e).__name__}: {e})") from None

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in scalars.items() if isinstance(v, (int, float)) and v == v}
        self._final.update({k: v for k, v in clean.items() if k.startswith(("train/", "eval/"))})
        for tracker in list(self.active):
            try:
                tracker.log(step, clean)
            except Exception as e:  # noqa: BLE001 - a tracker must never stop training
                print(f"dflash train: --report-to {tracker.name} failed ({type(e).__name__}: {e}); "
                      "not reporting to it any more", file=sys.stderr, flush=True)
                self.active.remove(tracker)

    def close(self) -> None:
        for tracker in self.active:
            try:
                tracker.close(self._final)
            except Exception as e:  # noqa: BLE001
                print(f"dflash train: --report-to {tracker.name}: closing failed ({e})", file=sys.stderr, flush=True)
        self.active = []


def interval_scalars(*, loss: float, accuracy: float, sim_tau: float, per_position: list[float], tokens_per_s: float,
                     lr: float, grad_norm: float, workers: Mapping[str, Mapping[str, Any]] | None,
                     verdict: str | None, terms: Mapping[str, float] | None = None,
                     measured: Mapping[str, float] | None = None, tflops: float | None = None,
                     mfu: float | None = None) -> dict[str, float]:
    """One log interval as tracker scalars: training numbers, each objective term (``terms``, before its
    weight: ``train/loss_ce``) and the rates terms measure (``measured``: ``train/selector_recall``),
    acceptance per draft position, each worker's time share per category, and the bottleneck verdict
    as a one-hot set; the model TFLOP/s and MFU where the trainer has them (``None``: left out)."""
    out = {"train/loss": loss, "train/accuracy": accuracy, "train/sim_tau": sim_tau,
           "train/tokens_per_s": tokens_per_s, "train/lr": lr, "train/grad_norm": grad_norm}
    out.update({f"train/{k}": v for k, v in (("tflops", tflops), ("mfu", mfu)) if v is not None})
    out.update({f"train/{term_gauge(k)}": v for k, v in (terms or {}).items()})
    out.update({f"train/{k}": v for k, v in (measured or {}).items()})
    out.update({f"train/acceptance_{k}": a for k, a in enumerate(per_position, 1)})
    for worker, cats in (workers or {}).items():
        for cat, st in cats.items():
            out[f"share/{worker}/{cat}"] = st.share
    if verdict is not None:
        for v in VERDICTS.values():
            out[v.tracker_key] = 1.0 if v.name == verdict else 0.0
    return out


def eval_scalars(summary: Mapping[str, Any]) -> dict[str, float]:
    out = {"eval/tau": summary["tau"]}
    out.update({f"eval/acceptance_{k}": a for k, a in enumerate(summary.get("per_position_acceptance") or [], 1)})
    if summary.get("speedup") is not None:
        out["eval/speedup"] = summary["speedup"]
    return out
