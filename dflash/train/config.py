"""Training configuration: defaults from the published DFlash recipe, a TOML file, then CLI overrides.

The resolved config is printed at start and saved as ``config.toml``-equivalent JSON in the run
directory, so a run can always be told apart from another and resumed with the same settings.
"""

from __future__ import annotations

import difflib
import json
import time
import types
import typing
from collections.abc import Callable
from dataclasses import Field, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A bad setting; the message names it."""


#: The sections the settings are grouped in: `dflash train --help` lists the flags by section, and a
#: TOML file may give each section as a table (``[optim]`` ``lr = 3e-3``) or every key at the top level.
SECTIONS = {
    "run": "what to train and when to stop",
    "model": "the drafter's shape",
    "data": "batches",
    "optim": "optimisation (the recipe: AdamW 6e-4, cosine, 4% warmup, clip 1.0)",
    "pipeline": "devices, workers and queues",
    "checkpoint": "checkpoints",
    "eval": "in-training and final evaluation (real speculative decoding)",
    "telemetry": "telemetry, Prometheus and experiment trackers",
    "health": "stall watchdog and non-finite steps (docs/telemetry.md)",
    "distributed": "multi-rank runs (torchrun)",
}


def setting(section: str, default: Any = None, help: str | None = None, *, factory: Callable[[], Any] | None = None,
            choices: dict[str, Any] | list[str] | None = None, metavar: str | None = None) -> Any:
    """A TrainConfig field with what the TOML schema and the command-line flag are derived from: its
    section, its help line (None: no flag, set it in a TOML file) and, for a flag, the words it takes
    (a dict maps each word to the value it sets, as ``--pipeline on|off``)."""
    assert section in SECTIONS, section
    meta = {"section": section, "help": help, "choices": choices, "metavar": metavar}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """Every setting of a run, declared once: type, default, section, help. The flat attribute names
    (``cfg.lr``) are the TOML keys, the ``config.json`` keys and, with dashes, the flags."""

    # run
    target: str = setting("run", "tiny", "HF model directory or 'tiny' (the built-in target)")
    data: str = setting("run", "demo", "JSONL dataset or 'demo'")
    run_dir: str | None = setting("run", None, "where checkpoints, config.json and telemetry.jsonl go (default: a "
                                  "fresh runs/train-<date>-<time>, so two runs never collide)")
    run_name: str | None = setting("run", None, "the run's name in telemetry (default: the run directory's name)")
    max_steps: int | None = setting("run", None, "stop after this many optimizer steps")
    max_time: float | None = setting("run", None, "stop after this many seconds of training")
    epochs: float | None = setting("run", None, "passes over the data, fractions allowed (default 1 when no step "
                                   "or time limit is given)")
    log_every: float = setting("run", 10.0, "seconds between log lines (default 10)")
    # model (None = derived from the target, as the reference does)
    drafter_layers: int | None = setting("model", None, "drafter layers (default: one per target tap)")
    block_size: int = setting("model", 16, "tokens per block: an anchor and the ones drafted after it (default 16)")
    num_anchors: int = setting("model", 512, "anchors (blocks) sampled per sequence (default 512)")
    gamma: float | None = setting("model", None, "loss weight decay over block positions (default: the recipe's)")
    target_layer_ids: list[int] | None = setting("model", None, "comma-separated target layers whose hidden states "
                                                 "the drafter reads (default: spread evenly)", metavar="IDS")
    # not in the reference recipe, which starts from random weights; it speeds up short runs a lot
    init_from_target: bool = setting("model", False, "start the drafter's layers as copies of the target's top layers")
    # data
    max_seq_len: int = setting("data", 512, "longest sample in tokens (longer ones are cut)")
    batch_size: int = setting("data", 8, "samples per step (per rank)")
    seed: int = setting("data", 0, "seed of the data order, the anchors and the drafter's init")
    # optimisation
    lr: float = setting("optim", 6e-4, "peak learning rate (default 6e-4)")
    min_lr_ratio: float = setting("optim", 0.0, "the cosine schedule's floor, as a fraction of lr")
    warmup_ratio: float = setting("optim", 0.04, "fraction of the run spent warming up (default 0.04)")
    weight_decay: float = setting("optim", 0.0, "AdamW weight decay")
    grad_clip: float = setting("optim", 1.0, "gradient norm clip (default 1.0)")
    # pipeline: one target worker per entry of target_devices
    target_devices: list[str] = setting("pipeline", help="comma-separated, one target worker each: cpu, "
                                        "cuda:0,cuda:1, ...", factory=lambda: ["cpu"])
    drafter_device: str = setting("pipeline", "cpu", "cpu or cuda:N")
    pipeline: bool = setting("pipeline", True, "off: target forward then drafter step in one loop, as public "
                             "trainers do", choices={"on": True, "off": False})
    batch_queue_size: int = setting("pipeline", 4, "batches the producer may build ahead (default 4)")
    hs_queue_size: int = setting("pipeline", 2, "hidden-state batches the targets may hand ahead (default 2)")
    threads_per_worker: int | None = setting("pipeline", None, "torch intra-op threads per worker thread "
                                             "(default: leave torch's)")
    # checkpoints
    checkpoint_every: float = setting("checkpoint", 60.0, "seconds between checkpoints (default 60)")
    keep_checkpoints: int = setting("checkpoint", 3, "newest checkpoints kept (default 3; older ones go first when "
                                    "disk is short)")
    # evaluation
    eval_every: float = setting("eval", 0.0, "seconds between in-training evaluations (0: only at the end)")
    eval_prompts: int = setting("eval", 8, "prompts in each evaluation (0: none)")
    eval_max_new_tokens: int = setting("eval", 64, "tokens generated per evaluation prompt (default 64)")
    # telemetry
    telemetry: bool = setting("telemetry", True, "live telemetry: socket, telemetry.jsonl, watchdog (the flag "
                              "turns it off entirely)")
    telemetry_interval: float = setting("telemetry", 1.0, "seconds between telemetry snapshots (default 1)")
    socket_dir: str | None = setting("telemetry", None, "directory for the telemetry socket")
    metrics_port: int | None = setting("telemetry", None, "serve Prometheus metrics on this port (0: any free port)")
    metrics_addr: str = setting("telemetry", "127.0.0.1", "address for --metrics-port (default 127.0.0.1; 0.0.0.0 "
                                "for remote Prometheus)")
    metrics_linger: float = setting("telemetry", 30.0, "with --metrics-port: seconds to keep serving after the "
                                    "run, until Prometheus has scraped its last numbers (default 30; 0: exit at once)")
    report_to: list[str] = setting("telemetry", help="experiment trackers fed every log interval and evaluation "
                                   "(rank 0), comma-separated: tensorboard, wandb, mlflow (default none; each an "
                                   "optional extra)", factory=list, metavar="TRACKERS")
    gil_probe: bool = setting("telemetry", True, "the GIL contention gauge (the flag turns it off: its probe "
                              "thread takes the GIL 200 times a second)")
    # health
    stall_timeout: float | None = setting("health", None, "seconds without a completed span before a worker counts "
                                          "as stalled (default: from its own history, at least 30; 0: no watchdog)")
    on_stall: str = setting("health", "warn", "exit: checkpoint the last completed step and exit 3 so a scheduler "
                            "can restart the job (default warn)", choices=["warn", "exit"])
    nonfinite_limit: int = setting("health", 3, "non-finite steps in a row (each skipped) that stop the run "
                                   "(default 3)")
    # distributed
    collective_timeout: float = setting("distributed", 300.0, "multi-rank: seconds a collective may wait for a "
                                        "rank before the job gives up on it (default 300)")

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
    # Accept a [train] table or top-level keys; either may hold section tables ([optim], [train.optim]).
    return flatten(data.get("train", data), str(path))


def _settings() -> dict[str, Field]:
    return {f.name: f for f in fields(TrainConfig)}


def _unknown(key: str, where: str, known: Any) -> ConfigError:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown setting {key!r} in {where}{hint}")


def flatten(values: dict[str, Any], where: str = "config file") -> dict[str, Any]:
    """Section tables (``{"optim": {"lr": 3e-3}}``) merged into the flat keys the config is made of; a
    key in the wrong section is refused. Top-level keys pass through (checked by make_config)."""
    settings, flat = _settings(), {}
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):  # `data = "demo"` is a setting, `[data]` a section
            for sub, v in value.items():
                f = settings.get(sub.replace("-", "_"))
                if f is None or f.metadata["section"] != key:
                    own = [n for n, g in settings.items() if g.metadata["section"] == key]
                    if f is not None:
                        raise ConfigError(f"{sub!r} in [{key}] of {where}: it belongs in [{f.metadata['section']}]")
                    raise _unknown(sub, f"[{key}] of {where}", own)
                flat[sub] = v
        else:
            flat[key] = value
    return flat


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
    known = _settings()
    cfg = TrainConfig()
    for source, values in (("recipe", recipe or {}), ("config file", file_values), ("command line", overrides)):
        for key, value in flatten(values, source).items():
            key = key.replace("-", "_")
            if key not in known:
                raise _unknown(key, source, known)
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
    hint = _field_types()[key]
    if isinstance(value, str) and any(typing.get_origin(h) is list for h in _options(hint)):
        value = _split(value)  # comma-separated on the command line
    options = _options(hint)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(f"{key} must be set, got nothing")
    for option in options:
        ok, converted = _matches(value, option)
        if ok:
            return converted
    raise ConfigError(f"{key} must be {_describe(hint)}, got {value!r}")


def _options(hint: Any) -> tuple:
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def _split(text: str) -> list[Any]:
    """`cuda:0,cuda:1` or `1,3,5` as a list (whole numbers as ints, so list[int] checks them); `none`: empty."""
    items = [v.strip() for v in text.split(",") if v.strip() and v.strip() != "none"]
    return [int(v) if v.lstrip("-").isdigit() else v for v in items]


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


# --- the command line, derived from the fields ---------------------------------------------------------

def add_flags(parser: Any) -> None:
    """One flag per setting that has a help line, grouped by section: ``--batch-size N``; a bool is
    ``--name`` when it defaults to off and ``--no-name`` when it defaults to on (or takes its words,
    ``--pipeline on|off``). Every flag defaults to None: only what is given overrides the file."""
    hints = _field_types()
    groups = {name: parser.add_argument_group(f"{name}: {what}") for name, what in SECTIONS.items()}
    for f in fields(TrainConfig):
        m = f.metadata
        if m["help"] is None:
            continue
        flag, add = "--" + f.name.replace("_", "-"), groups[m["section"]].add_argument
        options = [h for h in _options(hints[f.name]) if h is not type(None)]
        choices = m["choices"]
        if choices is not None:
            add(flag, choices=list(choices), default=None, help=m["help"])
        elif options == [bool]:
            if f.default:
                add("--no-" + flag[2:], dest=f.name, action="store_false", default=None, help=m["help"])
            else:
                add(flag, action="store_true", default=None, help=m["help"])
        else:
            scalar = options[0] if options[0] in (int, float) else None
            add(flag, type=scalar, default=None, metavar=m["metavar"], help=m["help"])


def flag_values(args: Any) -> dict[str, Any]:
    """The settings given on the command line (words mapped to their values), for make_config."""
    out = {}
    for f in fields(TrainConfig):
        value = getattr(args, f.name, None)
        if value is not None and isinstance(f.metadata["choices"], dict):
            value = f.metadata["choices"][value]
        out[f.name] = value
    return out
