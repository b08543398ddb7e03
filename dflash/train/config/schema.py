"""What the section classes of `dflash/train/config/__init__.py` are turned into: a table of settings by flat
name, the TOML file's keys, the command line's flags, and the merge of defaults <- hardware recipe <-
file <- flags into a checked TrainConfig. Nothing here names a setting: a new field in a section class
is a new flag and a new TOML key."""

from __future__ import annotations

import copy
import difflib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from dflash.train.config import ConfigError, TrainConfig
from dflash.train.config.typecheck import coerce, is_bool, number_type


@dataclass(frozen=True)
class Setting:
    """One field of one section, under its flat name: the flag (with dashes), the top-level TOML key
    and the key in a ``config.json`` saved before the sections existed."""

    name: str
    section: str
    attr: str  # the field's name in its section class
    hint: Any
    default: Any
    meta: Mapping[str, Any]

    def get(self, cfg: TrainConfig) -> Any:
        return getattr(getattr(cfg, self.section), self.attr)

    def put(self, cfg: TrainConfig, value: Any) -> None:
        setattr(getattr(cfg, self.section), self.attr, coerce(self.name, self.hint, value))


def _collect() -> tuple[dict[str, str], dict[str, Setting]]:
    sections, settings = {}, {}
    for section, cls in typing.get_type_hints(TrainConfig).items():
        sections[section] = cls.__doc__
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            name = f.metadata["flat"] or f.name
            assert name not in settings, f"two settings are called {name!r}: flat names must stay unique"
            settings[name] = Setting(name, section, f.name, hints[f.name], f.default, f.metadata)
    return sections, settings


#: section name -> the line heading its flags; flat name -> setting (in declaration order)
SECTIONS, SETTINGS = _collect()


def make_config(file_values: Mapping[str, Any], overrides: Mapping[str, Any],
                recipe: Mapping[str, Any] | None = None, file: str = "config file") -> TrainConfig:
    """Defaults <- hardware recipe <- file (`file` names it) <- CLI; unknown keys and wrong types are
    errors, not silently ignored. The limits given on the command line replace the file's (`--max-time
    600` on a file with a step budget trains 600 s). With no step, time or epoch limit anywhere, the run
    makes one pass over the data. Where each setting came from is kept (`TrainConfig.origin`)."""
    from dflash.train.config.recipes import fresh_run_dir

    cfg = TrainConfig()
    given = {k: v for k, v in overrides.items() if v is not None}  # absent flags are None
    file_values = flatten(file_values, file)
    if given.keys() & set(LIMITS):
        file_values = {k: v for k, v in file_values.items() if k not in LIMITS}
    _apply(cfg, recipe or {}, RECIPE)
    _apply(cfg, file_values, file)
    _apply(cfg, given, COMMAND_LINE)
    if cfg.model.drafter_type == "dspark" and not explicit(cfg, "block_size"):
        from dflash.model.dspark import DEFAULT_BLOCK

        cfg.model.block_size = DEFAULT_BLOCK  # DSpark's recipe drafts 7 tokens a block; its gamma (4) follows
    run = cfg.run
    if run.max_steps is None and run.max_time is None and run.epochs is None:
        run.epochs = 1.0
    if run.run_dir is None:
        run.run_dir = fresh_run_dir()
    cfg.validate()
    return cfg


def read_saved(values: Mapping[str, Any], where: str = "saved config") -> TrainConfig:
    """A run's ``config.json`` or a checkpoint's "config" as the TrainConfig it was: nested by section,
    or flat as releases before the sections wrote it. Type-checked, not validated (its devices need
    not exist on this machine)."""
    return _apply(TrainConfig(), values, where)


#: a run's config.json is a few KB; anything far larger is not one
_MAX_SAVED_BYTES = 1 << 20


def config_beside(drafter: str | Path) -> TrainConfig | None:
    """The training config of the run a drafter comes from: ``config.json`` in a run directory, or in
    the run directory above a checkpoint file (``<run>/checkpoints/step-N.pt``). None where there is
    no run around it (an export directory, whose config.json is the drafter's own; a loose checkpoint
    file); a ConfigError where a run's config.json does not read."""
    import json

    p = Path(drafter).expanduser()
    if p.is_file():
        run_dir = p.parent.parent if p.parent.name == "checkpoints" else None
    else:
        # an export directory holds model.safetensors (export.WEIGHTS_NAME; not imported: that loads torch)
        run_dir = None if (p / "model.safetensors").exists() else p
    path = run_dir / "config.json" if run_dir is not None else None
    if path is None or not path.is_file():
        return None
    try:
        if path.stat().st_size > _MAX_SAVED_BYTES:
            raise ConfigError(f"{path}: {path.stat().st_size:,} bytes, far more than a run's config")
        values = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return read_saved(values, str(path))


#: what a run trains: its checkpoint holds weights and optimizer state made with these, so a resumed
#: run keeps them (a change is refused: a new --run-dir starts a run that has them)
FIXED_ON_RESUME = frozenset({"target", "data"} | {s.name for s in SETTINGS.values()
                                                  if s.section in ("model", "data", "optim")})
#: where a run runs: taken from this start, not the saved config (a run resumes on another machine,
#: or on fewer GPUs, and a multi-rank run saved rank 0's device names)
PLACEMENT_SECTION = "pipeline"
#: the limits: any given on resume replace all the saved ones (as on a fresh start, a given limit is
#: the only one), so `--resume --max-steps 900` is not cut short by the saved first epoch's steps
LIMITS = ("max_steps", "max_time", "epochs")


def resumed(saved: TrainConfig, requested: TrainConfig, given: set[str], where: str) -> tuple[TrainConfig, list[str]]:
    """The config of a resumed run: `saved` (the run's config.json) with the placement of `requested`
    (this start's recipe, file and flags) and the `given` settings that may change; and one line per
    change, for the log. A given setting of FIXED_ON_RESUME that differs from the saved one is a
    ConfigError naming both values."""
    cfg, lines = copy.deepcopy(saved), []
    for s in SETTINGS.values():
        old, new = s.get(saved), s.get(requested)
        if s.section == PLACEMENT_SECTION:
            s.put(cfg, new)
            if s.name in given and new != old:
                lines.append(f"{s.name} {old!r} -> {new!r} (where the run runs may change)")
        elif s.name in given and new != old:
            if s.name in FIXED_ON_RESUME:
                raise ConfigError(f"--resume keeps what the run trains: {s.name} is {old!r} in {where}, not {new!r} "
                                  "(start a new --run-dir to train with it)")
            s.put(cfg, new)
            cfg.origins[s.name] = requested.origin(s.name) or where
            lines.append(f"{s.name} {old!r} -> {new!r}")
    if given & set(LIMITS):
        for name in LIMITS:
            if name not in given and SETTINGS[name].get(cfg) is not None:
                lines.append(f"{name} {SETTINGS[name].get(cfg)!r} -> None (the limits given replace the saved ones)")
                SETTINGS[name].put(cfg, None)
    cfg.validate()
    return cfg, lines


def updated(cfg: TrainConfig, **values: Any) -> TrainConfig:
    """A copy of `cfg` with some settings changed by flat name (``updated(cfg, max_steps=5)``)."""
    return _apply(copy.deepcopy(cfg), values, "updated()")


def flat_values(cfg: TrainConfig) -> dict[str, Any]:
    """Every setting by flat name: the start-up log line and the trackers' hyperparameters."""
    return {s.name: s.get(cfg) for s in SETTINGS.values()}


def load_toml(path: Path) -> dict[str, Any]:
    """A TOML file's settings by flat name. Keys may sit at the top level or under ``[train]``, each
    either flat (``lr = 3e-3``) or in its section's table (``[optim]`` / ``[train.optim]``)."""
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
    return flatten(data, str(path))


def flatten(values: Mapping[str, Any], where: str = "config file") -> dict[str, Any]:
    """Section tables (``{"optim": {"lr": 3e-3}}``) and a ``[train]`` table around them merged into
    flat names; a key in the wrong section is refused, as is one set twice. Top-level keys pass
    through (`_setting` checks them)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key == "train" and isinstance(value, dict):
            pairs = list(flatten(value, where).items())
        elif key in SECTIONS and isinstance(value, dict):  # `data = "demo"` is a setting, `[data]` a section
            pairs = [(_in_section(key, sub, where).name, v) for sub, v in value.items()]
        else:
            pairs = [(key.replace("-", "_"), value)]
        for name, v in pairs:
            if name in flat:
                raise ConfigError(f"{name} is set twice in {where}")
            flat[name] = v
    return flat


#: where a setting came from, besides a file's path (TrainConfig.origins)
RECIPE, COMMAND_LINE = "the recipe for this machine", "command line"


def _apply(cfg: TrainConfig, values: Mapping[str, Any], where: str) -> TrainConfig:
    for name, value in flatten(values, where).items():
        _setting(name, where).put(cfg, value)
        cfg.origins[name] = where
    return cfg


def explicit(cfg: TrainConfig, name: str) -> bool:
    """Whether the user set `name`: a flag, a config file or a saved config, not a default or the
    hardware recipe (which only fills in what nothing else said)."""
    return cfg.origin(name) not in (None, RECIPE)


def stated(cfg: TrainConfig, name: str) -> str:
    """Where `name`'s value was said, in the user's own terms: `--drafter-layers 1`,
    `drafter_layers = 1 in configs/tiny-cpu.toml`, `drafter_layers 1 (the recipe for this machine)`."""
    value, where = SETTINGS[name].get(cfg), cfg.origin(name)
    if where == COMMAND_LINE:
        shown = ",".join(map(str, value)) if isinstance(value, list) else value
        return f"--{name.replace('_', '-')} {shown}"
    if where is None or where == RECIPE:
        return f"{name} {value!r} ({where or 'the default'})"
    return f"{name} = {value!r} in {where}"


def _setting(name: str, where: str) -> Setting:
    if name not in SETTINGS:
        raise _unknown(name, where, SETTINGS)
    return SETTINGS[name]


def _in_section(section: str, key: str, where: str) -> Setting:
    """The setting `key` names in `section`'s table: its field name there or its flat name."""
    own = {k: s for s in SETTINGS.values() if s.section == section for k in (s.attr, s.name)}
    found = own.get(key.replace("-", "_"))
    if found is not None:
        return found
    elsewhere = SETTINGS.get(key.replace("-", "_"))
    if elsewhere is not None:
        raise ConfigError(f"{key!r} in [{section}] of {where}: it belongs in [{elsewhere.section}]")
    raise _unknown(key, f"[{section}] of {where}", own)


#: other trainers' names for our settings (Hugging Face's TrainingArguments, mostly), too unlike ours
#: for a spelling match: a config carried over from one of them gets our name suggested
KNOWN_AS = {"learning_rate": "lr", "num_train_epochs": "epochs", "max_grad_norm": "grad_clip",
            "per_device_train_batch_size": "batch_size", "train_batch_size": "batch_size",
            "output_dir": "run_dir", "logging_steps": "log_every", "save_steps": "checkpoint_every",
            "save_total_limit": "keep_checkpoints", "eval_steps": "eval_every", "max_length": "max_seq_len",
            "num_hidden_layers": "drafter_layers", "warmup": "warmup_ratio"}


def _unknown(key: str, where: str, known: Any) -> ConfigError:
    alias = KNOWN_AS.get(key.replace("-", "_"))
    close = [alias] if alias in known else difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown setting {key!r} in {where}{hint}")


# --- the command line ------------------------------------------------------------------------------------

def add_flags(parser: Any) -> None:
    """One flag per setting that has a help line, grouped by section: ``--batch-size N``; a bool is
    ``--name`` when it defaults to off and ``--no-name`` when it defaults to on (or takes its words,
    ``--pipeline on|off``). Every flag defaults to None: only what is given overrides the file."""
    groups = {name: parser.add_argument_group(f"{name}: {what}") for name, what in SECTIONS.items()}
    for s in SETTINGS.values():
        help, choices = s.meta["help"], s.meta["choices"]
        if help is None:
            continue
        flag, add = "--" + s.name.replace("_", "-"), groups[s.section].add_argument
        if choices is not None:
            add(flag, dest=s.name, choices=list(choices), default=None, help=help)
        elif is_bool(s.hint):
            if s.default:
                add("--no-" + flag[2:], dest=s.name, action="store_false", default=None, help=help)
            else:
                add(flag, dest=s.name, action="store_true", default=None, help=help)
        else:
            add(flag, dest=s.name, type=number_type(s.hint), default=None, metavar=s.meta["metavar"], help=help)


def flag_values(args: Any) -> dict[str, Any]:
    """The settings given on the command line (words mapped to their values), for make_config."""
    out = {}
    for s in SETTINGS.values():
        value = getattr(args, s.name, None)
        if value is not None and isinstance(s.meta["choices"], dict):
            value = s.meta["choices"][value]
        out[s.name] = value
    return out
