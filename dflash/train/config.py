"""Training configuration: defaults from the published DFlash recipe, a TOML file, then CLI overrides.

The resolved config is printed at start and saved as ``config.toml``-equivalent JSON in the run
directory, so a run can always be told apart from another and resumed with the same settings.
"""

from __future__ import annotations

import json
import time
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad setting; the message names it."""


@dataclass
class TrainConfig:
    # what to train on
    target: str = "tiny"
    data: str = "demo"
    run_dir: str | None = None  # None: a fresh runs/train-<date>-<time>, so two runs never collide
    # devices: one target worker per entry of target_devices
    target_devices: list[str] = field(default_factory=lambda: ["cpu"])
    drafter_device: str = "cpu"
    pipeline: bool = True  # False: target forward then drafter step in one loop, as public trainers do
    # drafter shape (None = derived from the target, as the reference does)
    drafter_layers: int | None = None
    block_size: int = 16
    num_anchors: int = 512
    gamma: float | None = None
    target_layer_ids: list[int] | None = None
    # start the drafter's layers as copies of the target's top layers (not in the reference recipe,
    # which starts from random weights; it speeds up short runs a lot)
    init_from_target: bool = False
    # data
    max_seq_len: int = 512
    batch_size: int = 8
    seed: int = 0
    # optimisation (the recipe: AdamW 6e-4, cosine, 4% warmup, clip 1.0)
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_steps: int | None = None
    max_time: float | None = None
    # passes over the data (fractions allowed); with no step, time or epoch limit a run makes one pass
    epochs: float | None = None
    # plumbing
    batch_queue_size: int = 4
    hs_queue_size: int = 2
    threads_per_worker: int | None = None  # torch intra-op threads per worker thread (None: leave torch's)
    checkpoint_every: float = 60.0  # seconds between checkpoints
    keep_checkpoints: int = 3
    eval_every: float = 0.0  # seconds between in-training evaluations (0: only at the end)
    eval_prompts: int = 8
    eval_max_new_tokens: int = 64
    log_every: float = 10.0
    telemetry: bool = True
    telemetry_interval: float = 1.0
    socket_dir: str | None = None
    metrics_port: int | None = None  # Prometheus exposition (0: pick a free port)
    metrics_addr: str = "127.0.0.1"
    metrics_linger: float = 30.0  # seconds /metrics outlives the run, until Prometheus reads its last numbers
    run_name: str | None = None  # default: the run directory's name
    # experiment trackers fed every log interval and evaluation (rank 0): tensorboard, wandb, mlflow
    report_to: list[str] = field(default_factory=list)
    # multi-rank runs (torchrun): seconds any collective may wait before the job gives up on a rank
    collective_timeout: float = 300.0
    # health (docs/telemetry.md): stall watchdog timeout in seconds (None: from each worker's own
    # history; 0: no watchdog), what a stall does ("warn", or "exit": checkpoint and exit 3), and how
    # many non-finite steps in a row stop the run (each one is skipped)
    stall_timeout: float | None = None
    on_stall: str = "warn"
    nonfinite_limit: int = 3
    gil_probe: bool = True  # the GIL contention gauge (a thread sampling the GIL every 5 ms)

    def validate(self) -> None:
        if not self.target_devices:
            raise ConfigError("target_devices is empty: give at least one device, e.g. cpu or cuda:0")
        if self.drafter_device.startswith("cpu") and any(d.startswith("cuda") for d in self.target_devices):
            raise ConfigError("a CUDA target needs a CUDA drafter (--drafter-device cuda): a CPU drafter would "
                              "wait on the host for every hidden-state copy")
        for dev in [*self.target_devices, self.drafter_device]:
            check_device(dev)
        if self.max_steps is None and self.max_time is None and self.epochs is None:
            raise ConfigError("give max_steps, max_time or epochs so the run and its LR schedule have an end")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"epochs must be positive, got {self.epochs}")
        positive = {"block_size": self.block_size, "num_anchors": self.num_anchors, "batch_size": self.batch_size,
                    "max_seq_len": self.max_seq_len, "lr": self.lr, "log_every": self.log_every,
                    "telemetry_interval": self.telemetry_interval, "batch_queue_size": self.batch_queue_size,
                    "hs_queue_size": self.hs_queue_size, "keep_checkpoints": self.keep_checkpoints,
                    "collective_timeout": self.collective_timeout}
        for name, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.block_size < 2:
            raise ConfigError("block_size must be at least 2 (an anchor and one predicted token)")
        if self.metrics_port is not None and not self.telemetry:
            raise ConfigError("--metrics-port needs telemetry; drop --no-telemetry")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be 0-65535, got {self.metrics_port}")
        from dflash.train.trackers import KNOWN

        unknown = [t for t in self.report_to if t not in KNOWN]
        if unknown:
            raise ConfigError(f"report_to: unknown tracker {unknown[0]!r}; choose from {', '.join(KNOWN)} (or none)")
        if self.stall_timeout is not None and (isinstance(self.stall_timeout, bool)
                                               or not isinstance(self.stall_timeout, (int, float))
                                               or self.stall_timeout < 0):
            raise ConfigError(f"stall_timeout must be seconds >= 0 (0: no watchdog), got {self.stall_timeout!r}")
        if self.on_stall not in ("warn", "exit"):
            raise ConfigError(f"on_stall must be 'warn' or 'exit', got {self.on_stall!r}")
        if self.on_stall == "exit" and (not self.telemetry or self.stall_timeout == 0):
            raise ConfigError("--on-stall exit needs the stall watchdog: drop --no-telemetry / --stall-timeout 0")
        if self.nonfinite_limit < 1:
            raise ConfigError(f"nonfinite_limit must be at least 1, got {self.nonfinite_limit}")
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")

    @property
    def name(self) -> str:
        return self.run_name or Path(self.run_dir or "").name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def check_device(dev: str) -> None:
    """Fail at once, in one line, on a device this machine does not have."""
    import torch

    try:
        d = torch.device(dev)
    except RuntimeError:
        raise ConfigError(f"unknown device {dev!r}: use cpu, cuda or cuda:N") from None
    if d.type == "cpu":
        return
    if d.type != "cuda":
        raise ConfigError(f"unsupported device {dev!r}: dflash trains on cpu or cuda devices")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {dev!r} requested but CUDA is not available on this machine")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise ConfigError(f"device {dev!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)")


def load_toml(path: Path) -> dict[str, Any]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    # Accept a [train] table or top-level keys.
    return data.get("train", data)


#: The published recipe (512 anchors, a drafter as deep as the taps) is sized for GPUs: on a CPU it
#: makes ~10 s steps. Without CUDA a bare `dflash train` uses this scaled one instead, measured on
#: 2 cores (configs/tiny-cpu.toml holds the same values; a test keeps them equal).
CPU_RECIPE: dict[str, Any] = {
    "drafter_layers": 1, "num_anchors": 24, "batch_size": 8, "max_seq_len": 320, "lr": 3e-3,
    "threads_per_worker": 1, "checkpoint_every": 60.0, "log_every": 15.0, "eval_prompts": 8,
    "eval_max_new_tokens": 96,
}
#: the tiny target's taps for a 1-layer drafter: real tau 1.40 with these against 1.21 with [3]
TINY_CPU_TAPS = [1, 3, 5]


def hardware_recipe(target: str | None) -> tuple[dict[str, Any], str]:
    """The settings a run without --config starts from on this machine, and the line that says so."""
    import torch

    if torch.cuda.is_available():
        return ({"target_devices": ["cuda"], "drafter_device": "cuda"},
                "recipe: CUDA found, the published GPU recipe on cuda (give --config or flags to change it)")
    recipe = dict(CPU_RECIPE)
    if (target or "tiny") == "tiny":
        recipe["target_layer_ids"] = TINY_CPU_TAPS
    return recipe, ("recipe: no CUDA here, the CPU-scaled one (1 drafter layer, 24 anchors, batch 8; "
                    "see configs/tiny-cpu.toml); give --config or flags to change it")


def fresh_run_dir(root: Path = Path("runs")) -> str:
    """runs/train-<date>-<time>, with a suffix if two runs start within one second. Under torchrun the
    ranks start at different moments, so they share the job's run id instead (`--nproc` names the
    directory once, before launching them)."""
    import os

    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return str(root / f"train-{job}")
    base = root / time.strftime("train-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def make_config(file_values: dict[str, Any], overrides: dict[str, Any],
                recipe: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults <- hardware recipe <- file <- CLI; unknown keys and wrong types are errors, not silently
    ignored. With no step, time or epoch limit anywhere, the run makes one pass over the data."""
    known = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig()
    for source, values in (("recipe", recipe or {}), ("config file", file_values), ("command line", overrides)):
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in known:
                raise ConfigError(f"unknown setting {key!r} in {source}")
            if value is None and source == "command line":
                continue
            setattr(cfg, key, _coerce(key, value))
    if cfg.max_steps is None and cfg.max_time is None and cfg.epochs is None:
        cfg.epochs = 1.0
    if cfg.run_dir is None:
        cfg.run_dir = fresh_run_dir()
    cfg.validate()
    return cfg


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _coerce(key: str, value: Any) -> Any:
    """Check `value` against the field's declared type (``int | None`` included), so that a TOML's
    ``batch_size = 8.5`` or ``metrics_port = "9400"`` fails here in one line, not inside a worker."""
    if key in ("target_devices", "report_to") and isinstance(value, str):  # comma-separated on the command line
        value = [v.strip() for v in value.split(",") if v.strip() and v.strip() != "none"]
    hint = _field_types()[key]
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} must be set, got nothing")
    for option in options:
        ok, converted = _matches(value, option)
        if ok:
            return converted
    raise ConfigError(f"{key} must be {_describe(hint)}, got {value!r}")


def _matches(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether `value` fits `hint`, and the value to store (an int where a float is declared)."""
    if hint is type(None):
        return False, None
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number, float(value) if number else value
    if hint is str:
        return isinstance(value, str), value
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            return False, value
        checked = [_matches(v, item) for v in value]
        return all(ok for ok, _ in checked), [v for _, v in checked]
    raise TypeError(f"TrainConfig field type {hint!r} has no check")  # a new field type: add it above


def _describe(hint: Any) -> str:
    names = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}
    if isinstance(hint, types.UnionType):
        parts = [_describe(h) for h in typing.get_args(hint) if h is not type(None)]
        return " or ".join(parts) + (" (or unset)" if type(None) in typing.get_args(hint) else "")
    if typing.get_origin(hint) is list:
        return f"a list of {_describe(typing.get_args(hint)[0]).removeprefix('a ')}s"
    return names.get(hint, str(hint))
