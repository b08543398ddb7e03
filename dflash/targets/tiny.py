"""The built-in default target: a 2.76M-parameter Qwen3 that ships with dflash as package data (tiny/).

It is an ordinary transformers model (hf.py loads it); what is special is where it lives and what a
missing copy means. tiny_build.py holds how it was made (`dflash target build-tiny`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash.targets.base import TargetError
from dflash.targets.hf import HFTarget, load_hf_target

#: where the built-in target ships (package data); `dflash target build-tiny` writes it
TINY_DIR = Path(__file__).with_name("tiny")


class TinyTargetMissing(FileNotFoundError):
    """The built-in target's files are not installed; the message says how to rebuild them."""


def tiny_target_dir() -> Path:
    """Where the shipped tiny target lives. A missing one is an error, never a silent rebuild: the build
    takes up to 40 minutes and would write into the installed package."""
    path = TINY_DIR
    missing = [n for n in ("config.json", "model.safetensors") if not (path / n).is_file()]
    if missing:
        raise TinyTargetMissing(f"the built-in tiny target is missing {' and '.join(missing)} in {path}: "
                                "rebuild it with `dflash target build-tiny` (up to 40 minutes on a CPU)")
    return path


def load_tiny_target(device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                     layer_ids: list[int] | None = None, num_draft_layers: int = 5) -> HFTarget:
    """The built-in target, loaded like any local model; a missing copy is a one-line TargetError."""
    try:
        path = tiny_target_dir()
    except TinyTargetMissing as e:
        raise TargetError(f"target 'tiny': {e}") from None
    return load_hf_target(path, device=device, dtype=dtype, layer_ids=layer_ids, num_draft_layers=num_draft_layers)
