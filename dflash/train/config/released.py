"""`--init-from DIR`: the drafter's shape comes from the release unless the user set it.

A release was trained with a number of layers, their kinds and window, a block size and the target
layers its `fc` reads. A run that starts from it takes each of these from it, unless the user set one
on the command line or in a config file; what the hardware recipe or a default filled in yields to the
release (the CPU recipe's one layer must not refuse a two-layer release). Of what the user set, the
layer count and the taps must agree with the release (its weights are made for them), and a
disagreement names where the setting came from; layer kinds, window and block size may differ (no
weight depends on them) and the user's win.
"""

from __future__ import annotations

from dflash.train.config import ConfigError, TrainConfig
from dflash.train.config.schema import explicit, stated

#: setting -> the release's field, for what must agree with the release when the user set it
_MUST_AGREE = {"drafter_layers": "num_layers", "target_layer_ids": "target_layer_ids"}
#: what the user may change, and what is taken from the release otherwise
_MAY_DIFFER = {"drafter_layer_types": "layer_types", "drafter_sliding_window": "sliding_window",
               "block_size": "block_size"}


def take_release_shape(cfg: TrainConfig) -> str | None:
    """Fill `cfg.model` with the shape of the release `cfg.model.init_from` names, where the user did
    not set it; a ConfigError on a conflict (one line, naming the flag or the file and key). Returns
    the line that says what came from where (None without --init-from)."""
    from dflash.model.released import release_config

    m = cfg.model
    if not m.init_from:
        return None
    release = release_config(m.init_from)
    where = f"--init-from {m.init_from}"
    for name, field in _MUST_AGREE.items():
        theirs = getattr(release, field)
        if explicit(cfg, name) and getattr(m, name) != theirs:
            raise ConfigError(f"{where}: the release has {field} {theirs}, but {stated(cfg, name)} asks for "
                              f"{getattr(m, name)}: its weights are made for {theirs}; drop the setting")
    if explicit(cfg, "drafter_layer_types") and len(m.drafter_layer_types) != release.num_layers:
        raise ConfigError(f"{where}: the release has {release.num_layers} layer(s), but "
                          f"{stated(cfg, 'drafter_layer_types')} names {len(m.drafter_layer_types)}: give one "
                          "type per layer of the release")
    taken, kept = [], []
    for name, field in {**_MUST_AGREE, **_MAY_DIFFER}.items():
        if explicit(cfg, name):
            kept.append(stated(cfg, name))
            continue
        value = getattr(release, field)
        setattr(m, name, list(value) if isinstance(value, list) else value)
        taken.append(f"{name} {value}")
    if not explicit(cfg, "gamma") and not explicit(cfg, "block_size"):
        m.gamma = release.gamma  # the loss decay it was trained with, for its block
    if not explicit(cfg, "drafter_sliding_window") and "sliding_attention" not in m.drafter_layer_types:
        m.drafter_sliding_window = None  # the release's window, for layers the user made full
    m.check_layers()
    return (f"{where}: the release's {', '.join(taken) or 'shape: nothing (all set)'}"
            + (f"; the run's own: {', '.join(kept)}" if kept else ""))

