"""Who produces the hidden states a drafter trains on (base.py: the interface every producer implements).

``load_target`` names a target the way the command line does (``tiny`` or a model directory);
``make_target`` builds the one a training run's settings ask for. Implementations are imported lazily,
so naming this package costs nothing until a target is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dflash.targets.base import LAYER_ID_CONVENTION, Target, TargetError, TokenBatch, hidden_states_index

if TYPE_CHECKING:
    import torch

    from dflash.targets.hf import HFTarget
    from dflash.train.config import TrainConfig

__all__ = ["LAYER_ID_CONVENTION", "Target", "TargetError", "TokenBatch", "hidden_states_index", "load_target",
           "make_target"]


def load_target(spec: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                layer_ids: list[int] | None = None, num_draft_layers: int = 5) -> HFTarget:
    """An in-process target: ``"tiny"`` (the built-in one) or a local transformers model directory.

    ``layer_ids`` are the tap layers; by default the reference's rule with one tap per drafter layer.
    bf16 on CUDA and fp32 on CPU unless ``dtype`` says otherwise.
    """
    if str(spec) == "tiny":
        from dflash.targets.tiny import load_tiny_target

        return load_tiny_target(device, dtype, layer_ids, num_draft_layers)
    from dflash.targets.hf import load_hf_target

    return load_hf_target(spec, device, dtype, layer_ids, num_draft_layers)


def make_target(cfg: TrainConfig, device: str | torch.device) -> Target:
    """The target a training run's settings name, with its tap layers, on ``device``: a hidden-states
    cache when ``--hidden-states`` is given (``--target`` then supplies only the tokenizer, config,
    embedding and LM head), else the model itself."""
    n_taps = cfg.model.drafter_layers
    if cfg.run.hidden_states is not None:
        import torch

        from dflash.targets.cache import load_cache_target

        return load_cache_target(Path(cfg.run.hidden_states), cfg.run.target, cfg.model.target_layer_ids, n_taps,
                                 torch.device(device), follow=cfg.run.follow,
                                 max_bad_samples=cfg.health.max_bad_samples)
    return load_target(cfg.run.target, device=device, layer_ids=cfg.model.target_layer_ids,
                       **({"num_draft_layers": n_taps} if n_taps else {}))
