"""A drafter read back from whatever holds one: an export directory in the reference format (ours,
z-lab's), a speculators DFlash or DFlash2 checkpoint, a training checkpoint file, or a run directory (its
newest checkpoint that verifies). Every path is checked against its config before anything is allocated, and
refused in one line (DrafterLoadError) when it is none of these."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from dflash.model import dspark_formats, speculators_format
from dflash.model.dflash2 import build_drafter, config_from_dict
from dflash.model.drafter import DFlashDrafter, DrafterConfig
from dflash.model.export import (
    CONFIG_NAME,
    DFLASH,
    DFLASH2,
    WEIGHTS_NAME,
    DrafterLoadError,
    config_from_hf,
    read_config_json,
)


def config_of_export(d: dict, where: str) -> DrafterConfig:
    """The DrafterConfig of an export directory's config.json: the reference format (ours, z-lab's), or
    a speculators DFlash or DFlash2 checkpoint (speculators_format.py); anything else refused in one line."""
    try:
        if dspark_formats.is_dspark_config(d):  # DeepSpec's, speculators' or SpecForge's DSpark
            return dspark_formats.read_config(d)
        if speculators_format.is_speculators_config(d):
            return speculators_format.drafter_config(d)
        arch = (d.get("architectures") or [DFLASH])[0]
        if arch not in (DFLASH, DFLASH2):
            raise DrafterLoadError(f"architecture {arch!r} is neither a {DFLASH} nor a {DFLASH2}")
        return config_from_hf(d)
    except DrafterLoadError as e:
        raise type(e)(f"{where}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise DrafterLoadError(f"{where}: {CONFIG_NAME} is not a drafter config ({type(e).__name__}: {e})") from None


def load_exported(path: str | Path, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load an export directory (ours, a z-lab DFlash/DFlash2 drafter, a speculators DFlash/DFlash2
    checkpoint, or a DSpark drafter in DeepSpec's, speculators' or SpecForge's format) back into its
    drafter."""
    from safetensors.torch import load_file

    path = Path(path)
    d = read_config_json(path)
    cfg = config_of_export(d, str(path))
    # a speculators checkpoint or a DeepSpec file may hold the target's tensors too (embedding, heads): the
    # drafter's are kept
    own = dspark_formats.drafter_tensors if dspark_formats.is_dspark_config(d) else \
        speculators_format.drafter_tensors if speculators_format.is_speculators_config(d) else None
    shapes = _safetensors_shapes(path / WEIGHTS_NAME)
    shapes = own(shapes, str(path)) if own else shapes
    check_shapes(cfg, shapes, str(path))
    state = load_file(str(path / WEIGHTS_NAME))
    state = own(state, str(path)) if own else state
    return _build(cfg, state, str(path), dtype)


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header, without reading the tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - not a dict
    except Exception as e:
        raise DrafterLoadError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None


_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def check_shapes(cfg: DrafterConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse a config that does not describe these weights before anything is allocated.

    A config.json (or a checkpoint's drafter_config) with absurd sizes would otherwise allocate the
    whole model first. The expected shapes come from the drafter itself, built on the meta device
    (no memory); the layer count is compared first, since even a meta build of a billion layers takes
    long.
    """
    layers = {int(m.group(1)) for k in shapes if (m := _LAYER_KEY.match(k))}
    if cfg.num_layers != len(layers):
        raise DrafterLoadError(f"{where}: weights do not match the config: it says {cfg.num_layers} layer(s), "
                               f"the weights hold {len(layers)}")
    try:
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in build_drafter(cfg).state_dict().items()}
    except Exception as e:
        raise DrafterLoadError(f"{where}: the config's sizes are invalid ({str(e).splitlines()[0][:120]})") from None
    missing, extra = sorted(expected.keys() - shapes.keys()), sorted(shapes.keys() - expected.keys())
    if missing or extra:
        raise DrafterLoadError(
            f"{where}: weights do not match the config (missing {missing[:3]}, unexpected {extra[:3]})")
    wrong = [k for k in expected if expected[k] != tuple(shapes[k])]
    if wrong:
        k = wrong[0]
        raise DrafterLoadError(f"{where}: weights do not match the config: {k} is {list(shapes[k])} in the "
                               f"weights, the config makes it {list(expected[k])} ({len(wrong)} tensor(s) disagree)")


def _build(cfg: DrafterConfig, state: dict, where: str, dtype: torch.dtype | None) -> DFlashDrafter:
    drafter = build_drafter(cfg)
    result = drafter.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        missing, extra = result.missing_keys[:3], result.unexpected_keys[:3]
        raise DrafterLoadError(f"{where}: weights do not match the config (missing {missing}, unexpected {extra})")
    dtype = dtype or next(iter(state.values())).dtype
    drafter.loaded_from = where  # the file or export a run directory resolved to: commands name it
    return drafter.to(dtype)


def find_checkpoint(directory: Path) -> Path | None:
    """The checkpoint to use in a run directory: ``latest.pt``, else the ``step-<n>.pt`` (the trainer's
    naming) or ``checkpoint-<n>.pt`` with the highest n, else the newest ``*.pt`` — searched in the
    directory itself, then in its ``checkpoints/``."""
    for d in (directory, directory / "checkpoints"):
        if not d.is_dir():
            continue
        if (d / "latest.pt").is_file():
            return d / "latest.pt"
        stepped = [(int(m.group(1)), p) for p in d.glob("*.pt")
                   if (m := re.fullmatch(r"(?:checkpoint|step)-(\d+)\.pt", p.name))]
        if stepped:
            return max(stepped)[1]
        any_pt = sorted(d.glob("*.pt"), key=lambda p: p.stat().st_mtime)
        if any_pt:
            return any_pt[-1]
    return None


def load_checkpoint_drafter(path: str | Path, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """The drafter inside a training checkpoint file."""
    from dflash.checkpoint_files import CheckpointError, safe_load

    path = Path(path)
    try:
        ckpt = safe_load(path)  # tensors and plain types only: a checkpoint never runs code
    except CheckpointError as e:
        raise DrafterLoadError(str(e)) from None
    return _drafter_from_checkpoint(ckpt, path, dtype)


def _newest_verified_drafter(run_dir: Path, dtype: torch.dtype | None) -> DFlashDrafter | None:
    """A trainer's run directory: the newest checkpoint that verifies against its manifest, as
    ``--resume`` picks it (skipped ones are named on stderr); None when there are none."""
    import sys

    from dflash.checkpoint_files import MANIFEST, CheckpointError, checkpoint_dir, load_latest

    if not (checkpoint_dir(run_dir) / MANIFEST).is_file():
        return None  # not written by the trainer (or by an older one): plain newest-file rules
    try:
        found = load_latest(run_dir, note=lambda s: print(f"dflash: {s}", file=sys.stderr))
    except CheckpointError as e:
        raise DrafterLoadError(str(e)) from None
    return None if found is None else _drafter_from_checkpoint(found[1], found[0], dtype)


def _drafter_from_checkpoint(ckpt: object, path: Path, dtype: torch.dtype | None) -> DFlashDrafter:
    if not isinstance(ckpt, dict) or "drafter_config" not in ckpt or "drafter" not in ckpt:
        raise DrafterLoadError(f"{path}: not a dflash checkpoint (no 'drafter_config'/'drafter' entries)")
    state = ckpt["drafter"]
    try:
        cfg = config_from_dict(ckpt["drafter_config"])
        shapes = {k: tuple(v.shape) for k, v in state.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise DrafterLoadError(f"{path}: not a dflash checkpoint ({type(e).__name__}: {e})") from None
    check_shapes(cfg, shapes, str(path))
    return _build(cfg, state, str(path), dtype)


def load_drafter(path: str | Path, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """A drafter from any of: an export directory, a checkpoint file, or a run directory holding
    checkpoints (see ``find_checkpoint``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DrafterLoadError(f"drafter {str(path)!r}: no such file or directory")
    if p.is_file():
        return load_checkpoint_drafter(p, dtype)
    if (p / CONFIG_NAME).is_file() and (p / WEIGHTS_NAME).is_file():
        return load_exported(p, dtype)
    saved = speculators_format.speculators_dir(p)  # a `speculators train` save path: its best (else last) epoch
    if saved is not None:
        return load_exported(saved, dtype)
    drafter = _newest_verified_drafter(p, dtype)
    if drafter is not None:
        return drafter
    ckpt = find_checkpoint(p)
    if ckpt is None:
        found = ", ".join(sorted(x.name for x in p.iterdir())[:8]) or "nothing"
        raise DrafterLoadError(
            f"drafter {str(path)!r}: neither an export ({CONFIG_NAME} + {WEIGHTS_NAME}) nor a directory with "
            f"*.pt checkpoints (found {found})"
        )
    return load_checkpoint_drafter(ckpt, dtype)
