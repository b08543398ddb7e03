"""Random-number state for exact resume, stored as tensors and plain types only.

A checkpoint is loaded with ``torch.load(weights_only=True)``, so nothing in it may need unpickling
beyond tensors, numbers, strings, lists and dicts: Python's ``random`` state (a tuple of 625 ints)
becomes an int64 tensor, generator states are the ByteTensors torch already gives.

CUDA generator states are per device. A run resumed on a machine with fewer (or no) GPUs restores
the devices both have and says which saved states it dropped, instead of failing.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def capture(generator: torch.Generator) -> dict[str, Any]:
    """Every RNG the training step draws from: torch's CPU generator, Python's, the anchor sampler's
    and, with CUDA, each GPU's."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "anchors": generator.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def cuda_plan(saved: int, present: int) -> tuple[int, str | None]:
    """How many saved CUDA states to restore on a machine with ``present`` GPUs, and what to say about
    the rest (None when they match)."""
    n = min(saved, present)
    if saved == present:
        return n, None
    if saved > present:
        dropped = f"GPU {saved - 1}" if saved - present == 1 else f"GPUs {present}-{saved - 1}"
        return n, (f"the checkpoint holds CUDA RNG states for {saved} GPU(s), this machine has {present}: "
                   f"restored {n}, dropped the states of {dropped}")
    return n, (f"the checkpoint holds CUDA RNG states for {saved} GPU(s), this machine has {present}: "
               f"restored {n}, the others keep their fresh seeds")


def restore(state: dict[str, Any], generator: torch.Generator) -> list[str]:
    """Put back what ``capture`` saved; returns notes about what could not be restored exactly."""
    torch.set_rng_state(state["torch"])
    py = state["python"]
    if isinstance(py, dict):
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    else:  # checkpoints written before RNG states were tensors: (version, tuple of ints, gauss)
        version, internal, gauss = py
        random.setstate((version, tuple(internal), gauss))
    generator.set_state(state["anchors"])
    saved = list(state.get("cuda") or [])
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n, note = cuda_plan(len(saved), present)
    for i in range(n):
        torch.cuda.set_rng_state(saved[i], i)
    return [note] if note else []
