"""Atomic checkpoints: a crash (even SIGKILL) mid-write never leaves a checkpoint that looks valid.

A checkpoint is written to a temporary file in the same directory, fsynced, renamed into place (rename is
atomic on POSIX), and the directory is fsynced so the rename itself survives a power loss. Readers only
look at ``step-*.pt`` names, so leftovers of an interrupted write are ignored and cleaned up.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^step-(\d+)\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    import torch

    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"step-{step:08d}.pt"
    tmp = d / f".tmp-{final.name}-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def clean_partial(run_dir: Path) -> int:
    """Remove temporary files left by a write that was killed; returns how many."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return 0
    stale = [p for p in d.iterdir() if p.name.startswith(".tmp-")]
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def load_latest(run_dir: Path) -> dict[str, Any] | None:
    import torch

    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        return None
    return torch.load(ckpts[-1], map_location="cpu", weights_only=False)
