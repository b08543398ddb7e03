"""Training configuration: defaults from the published DFlash recipe, a TOML file, then CLI overrides.

The resolved config is printed at start and saved as ``config.toml``-equivalent JSON in the run
directory, so a run can always be told apart from another and resumed with the same settings.
"""

from __future__ import annotations

import json
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
    run_dir: str = "runs/default"
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
    run_name: str | None = None  # default: the run directory's name
    # multi-rank runs (torchrun): seconds any collective may wait before the job gives up on a rank
    collective_timeout: float = 300.0

    def validate(self) -> None:
        if not self.target_devices:
            raise ConfigError("target_devices is empty: give at least one device, e.g. cpu or cuda:0")
        for dev in [*self.target_devices, self.drafter_device]:
            check_device(dev)
        if self.max_steps is None and self.max_time is None:
            raise ConfigError("give max_steps or max_time (or both) so the run and its LR schedule have an end")
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
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")

    @property
    def name(self) -> str:
        return self.run_name or Path(self.run_dir).name

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


def make_config(file_values: dict[str, Any], overrides: dict[str, Any]) -> TrainConfig:
    """Defaults <- file <- CLI; unknown keys and wrong types are errors, not silently ignored."""
    known = {f.name for f in fields(TrainConfig)}
    cfg = TrainConfig()
    for source, values in (("config file", file_values), ("command line", overrides)):
        for key, value in values.items():
            key = key.replace("-", "_")
            if key not in known:
                raise ConfigError(f"unknown setting {key!r} in {source}")
            if value is None and source == "command line":
                continue
            setattr(cfg, key, _coerce(key, value))
    cfg.validate()
    return cfg


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def _coerce(key: str, value: Any) -> Any:
    """Check `value` against the field's declared type (``int | None`` included), so that a TOML's
    ``batch_size = 8.5`` or ``metrics_port = "9400"`` fails here in one line, not inside a worker."""
    if key == "target_devices" and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
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
