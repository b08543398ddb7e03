"""Where a run starts from when nothing says otherwise: the recipe this machine can run, and a fresh
run directory."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

#: The published recipe (512 anchors, a drafter as deep as the taps) is sized for GPUs: on a CPU it
#: makes ~10 s steps. Without CUDA a bare `dflash train` uses this scaled one instead, measured on
#: 2 cores (configs/tiny-cpu.toml holds the same values; a test keeps them equal). Keys are flat
#: setting names, as in a TOML file.
CPU_RECIPE: dict[str, Any] = {
    "drafter_layers": 1, "num_anchors": 24, "batch_size": 8, "max_seq_len": 320, "lr": 3e-3,
    "threads_per_worker": 1, "checkpoint_every": 60.0, "log_every": 15.0, "eval_prompts": 8,
    "eval_max_new_tokens": 96,
}
#: The published GPU recipe: the devices, and the length the DFlash paper and SpecForge's DFlash trainer train
#: at (3,072 tokens; docs/training.md says why). The settings' own default (512) would cut most real
#: conversations, thinking traces all of them, without a word.
GPU_RECIPE: dict[str, Any] = {"target_devices": ["cuda"], "drafter_device": "cuda", "max_seq_len": 3072}
#: the tiny target's taps for a 1-layer drafter: real tau 1.40 with these against 1.21 with [3]
TINY_CPU_TAPS = [1, 3, 5]


def hardware_recipe(target: str | None) -> tuple[dict[str, Any], str]:
    """The settings a run without --config starts from on this machine, and the line that says so."""
    import torch

    if torch.cuda.is_available():
        return (dict(GPU_RECIPE),
                f"recipe: CUDA found, the published GPU recipe on cuda (max_seq_len {GPU_RECIPE['max_seq_len']}; "
                "give --config or flags to change it)")
    recipe = dict(CPU_RECIPE)
    if (target or "tiny") == "tiny":
        recipe["target_layer_ids"] = TINY_CPU_TAPS
    return recipe, ("recipe: no CUDA here, the CPU-scaled one (1 drafter layer, 24 anchors, batch 8; "
                    "see configs/tiny-cpu.toml); give --config or flags to change it")


def fresh_run_dir(root: Path = Path("runs")) -> str:
    """runs/train-<date>-<time>, with a suffix if two runs start within one second. Under torchrun the
    ranks start at different moments, so they share the job's run id instead (`--nproc` names the
    directory once, before launching them)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if job == "none":
            # torchrun's default --rdzv-id (every multi-node job started without one): each such job would
            # land in runs/train-none, and a later job's --resume would continue an earlier job's run.
            from dflash.train.config import ConfigError

            raise ConfigError("under torchrun without --rdzv-id every job's run id is 'none': give --run-dir "
                              "(the same on every node), or a job id with torchrun --rdzv-id")
        return str(root / f"train-{job}")
    base = root / time.strftime("train-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)
