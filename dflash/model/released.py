"""Starting a run from a released drafter (``--init-from DIR``): the reference format or a speculators
DFlash/DFlash2 checkpoint (speculators_format.py), checked against the target before any training step.

A released drafter (z-lab's, speculators', another trainer's, or our own ``dflash export``) only makes
sense on the target it was trained for: its ``fc`` reads that target's tap layers, its output feeds that
target's LM head, its masked slots hold that target's mask-token embedding. A mismatch would train without an
error and produce nonsense, so each of these is compared first and the first disagreement is refused
in one line. Which of the release's shape a run takes (all of it, unless the user set some) is the
run's config's to decide (dflash/train/config/released.py); here the layer types, window and block
size given replace the release's (no weight depends on them).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash.model.dflash2 import DFlash2Config
from dflash.model.drafter import DFlashDrafter, DrafterConfig, mask_token_embedding_ok
from dflash.model.export import CONFIG_NAME, WEIGHTS_NAME, DrafterLoadError, read_config_json
from dflash.model.loading import config_of_export, load_exported


class ReleaseMismatch(DrafterLoadError):
    """The released drafter was made for another target; the message names the first difference."""


def release_dir(path: str | Path) -> Path:
    """The directory holding the release ``path`` names: ``path`` itself, or for a `speculators train`
    save path its best (else last) epoch."""
    from dflash.model.speculators_format import speculators_dir

    p = Path(path).expanduser()
    if (p / CONFIG_NAME).is_file():
        return p
    return speculators_dir(p) or p


def release_config(path: str | Path) -> DrafterConfig:
    """The DrafterConfig of a release directory, read from its config.json alone (no weights): the
    reference format, or a speculators DFlash or DFlash2 checkpoint (whose target layer count is the least its
    taps need: ``start_from_release`` takes the target's)."""
    p = release_dir(path)
    if not (p / CONFIG_NAME).is_file() or not (p / WEIGHTS_NAME).is_file():
        raise DrafterLoadError(f"--init-from {str(path)!r}: not a drafter in the reference format nor a speculators "
                               f"checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME}; `dflash export` writes one from "
                               "a run)")
    return config_of_export(read_config_json(p), f"--init-from {str(path)!r}")


def check_against_target(cfg: DrafterConfig, target: Any, where: str) -> None:
    """Refuse a drafter made for another target: taps, hidden size, vocabulary, mask token, in that order.

    ``target`` is the run's target (``layer_ids``, ``num_layers``, ``hidden_size``, ``vocab_size``,
    ``embed_tokens``); the mask token must be a row of its embedding that is not zero.
    """
    checks = [
        ("target layer count", cfg.num_target_layers, target.num_layers),
        ("target_layer_ids (taps)", list(cfg.target_layer_ids), list(target.layer_ids)),
        ("hidden_size", cfg.hidden_size, target.hidden_size),
        ("vocab_size", cfg.vocab_size, target.vocab_size),
    ]
    for name, theirs, ours in checks:
        if theirs != ours:
            hint = (f"; pass --target-layer-ids {','.join(map(str, theirs))}"
                    if name.startswith("target_layer_ids") else "")
            raise ReleaseMismatch(f"{where}: made for another target: its {name} is {theirs}, the target's "
                                  f"is {ours}{hint}")
    if not mask_token_embedding_ok(target.embed_tokens.weight, cfg.mask_token_id):
        raise ReleaseMismatch(f"{where}: its mask_token_id {cfg.mask_token_id} has a zero embedding row in the "
                              "target: made for another target or tokenizer")
    if isinstance(cfg, DFlash2Config):
        from dflash.targets.heads import applied

        # the trainer applies the target's own embedding scale and soft-cap (its frozen head); a release
        # that asks the engines for others was made for a target that applies them otherwise
        scale, cap = applied(*target.frozen_head(target.device))
        for name, theirs, ours in (("input_embedding_scale", cfg.input_embedding_scale, scale),
                                   ("output_multiplier", cfg.output_multiplier, 1.0),
                                   ("final_logit_softcapping", cfg.final_logit_softcapping, cap)):
            if not _same(theirs, ours):
                raise ReleaseMismatch(f"{where}: its {name} is {theirs}, the target applies {ours}: made for "
                                      "another target")


def _same(a: float | None, b: float | None) -> bool:
    """Two settings agree: both absent (None or 0, which also means no soft-cap), or equal to rounding."""
    if not a or not b:
        return not a and not b
    return math.isclose(a, b, rel_tol=1e-6)


def start_from_release(
    path: str | Path,
    target: Any,
    *,
    block_size: int,
    gamma: float | None = None,
    num_layers: int | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    drafter_type: str = "dflash",
) -> tuple[DrafterConfig, dict]:
    """(config, state_dict) for a run starting from the released drafter at ``path``.

    ``num_layers`` (the run's --drafter-layers, if given) must match the release; ``layer_types`` and
    ``sliding_window`` replace the release's when given. The release says which drafter it is: a
    DFlash2 release trains as DFlash2 whatever ``drafter_type`` says, a DFlash one cannot become
    DFlash2 (its convolutions and selector would start from nothing). A DFlash2 release's own
    convolution and selector settings are kept (the weights are shaped by them).
    """
    from dflash.model import speculators_format

    where = f"--init-from {str(path)!r}"
    release = release_dir(path)  # a `speculators train` save path resolved to its epoch once
    cfg = release_config(release)  # (a resolved directory resolves to itself)
    if speculators_format.speculators_dir(release) is not None:
        try:  # it states no target layer count of its own
            cfg = speculators_format.with_target(cfg, target)
        except DrafterLoadError as e:
            raise ReleaseMismatch(f"{where}: {e}") from None
    if drafter_type == DFlash2Config.drafter_type and not isinstance(cfg, DFlash2Config):
        raise ReleaseMismatch(f"{where}: a DFlash drafter, not a DFlash2 one: drop --drafter-type dflash2 to "
                              "train it as it is")
    if drafter_type == "dspark" and cfg.drafter_type != "dspark":
        raise ReleaseMismatch(f"{where}: a {cfg.drafter_type} drafter, not a DSpark one (its Markov and confidence "
                              "heads would start from nothing): drop --drafter-type dspark to train it as it is")
    if num_layers is not None and num_layers != cfg.num_layers:
        raise ReleaseMismatch(f"{where}: it has {cfg.num_layers} layer(s), the run asks for {num_layers}")
    check_against_target(cfg, target, where)
    try:
        cfg = replace(cfg, block_size=block_size, gamma=gamma,
                      layer_types=layer_types or cfg.layer_types,
                      sliding_window=sliding_window if sliding_window is not None else cfg.sliding_window)
    except ValueError as e:
        raise DrafterLoadError(f"{where}: {e}") from None
    drafter: DFlashDrafter = load_exported(release)
    return cfg, drafter.state_dict()  # load_state_dict casts to the run's dtype
