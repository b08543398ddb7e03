"""Writing a drafter's export: ``config.json`` + ``model.safetensors`` in the format its kind is served in,
the reference format (export.py) for DFlash and DFlash2, one of DSpark's three (dspark_formats.py). Apart
from both because it needs both, and dspark_formats builds on export.py's reference format."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dflash.model import dspark_formats
from dflash.model.drafter import DFlashDrafter
from dflash.model.dspark import DSparkConfig
from dflash.model.export import CONFIG_NAME, WEIGHTS_NAME, hf_config


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None,
                   fmt: str | None = None, target_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the reference format; ``dtype`` None keeps the
    drafter's own (exact round trip), the reference releases bfloat16. A DSpark drafter is written in
    ``fmt`` (dspark_formats.FORMATS; None: the default), the DeepSpec format with the target's embedding
    and LM head (``target_tensors``, by their names there). A format a drafter has no such file in, or a
    DeepSpec file without the target's tensors, is refused in one line (ValueError) before anything is
    written."""
    from safetensors.torch import save_file

    state = dict(drafter.state_dict())
    dtype = dtype or next(iter(state.values())).dtype
    if isinstance(drafter.config, DSparkConfig):
        fmt = fmt or dspark_formats.DEFAULT_FORMAT
        config = dspark_formats.config_json(drafter.config, fmt, dtype)
        if fmt == dspark_formats.DEEPSPEC:
            missing = [k for k in dspark_formats.TARGET_TENSORS if k not in (target_tensors or {})]
            if missing:
                raise ValueError(f"--format deepspec carries the target's {' and '.join(missing)} (SGLang's loader "
                                 "requires them): give the target (--target MODEL_DIR), or another --format")
            state.update({k: target_tensors[k] for k in dspark_formats.TARGET_TENSORS})
    elif fmt is not None:
        raise ValueError(f"--format {fmt} is for DSpark drafters; a {drafter.config.drafter_type} drafter is "
                         "written in the reference format (leave --format out)")
    else:
        config = hf_config(drafter.config, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    # safetensors creates its file 0600; the pair is meant to be copied and served together, so the
    # weights get the same permissions as config.json (the user's umask)
    os.chmod(out / WEIGHTS_NAME, (out / CONFIG_NAME).stat().st_mode & 0o777)
    return out
