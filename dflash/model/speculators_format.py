"""speculators' DFlash and DFlash2 checkpoints (what `speculators train` saves), read as dflash drafters.

The other direction needs no code here: speculators' own `convert --algorithm dflash` reads our
`dflash export` directory (the reference format), as it reads z-lab's releases (speculators 0.9.0 has
no DFlash2 converter).

A checkpoint is a directory ``<save_path>/<epoch>/`` (``<save_path>/checkpoint_best`` links to the
best epoch) written by transformers' ``save_pretrained``:

    config.json        a ``DFlashSpeculatorConfig``: ``speculators_model_type: "dflash"``,
                       ``speculators_config`` (``algorithm``, proposal methods, ``verifier.name_or_path``),
                       ``transformer_layer_config`` (the drafter's own decoder layers, a Qwen3 config: sizes,
                       ``layer_types``, ``sliding_window``, ``rope_parameters``), ``draft_vocab_size``,
                       ``block_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id``,
                       ``sample_from_anchor``, ``sliding_window_non_causal``; or a
                       ``DFlash2SpeculatorConfig`` (``"dflash2"``): the same plus ``conv_kernel_size``,
                       ``conv_group_size``, ``selector_rank``, ``selector_top_k``, with
                       ``sliding_window_non_causal`` true unless set (DFlash's default is false)
    model.safetensors  the drafter's tensors under our names (``layers.N...``, ``fc``, ``hidden_norm``,
                       ``norm``; DFlash2's ``layers.N.{attention,mlp}_conv...`` and ``candidate_selector...``
                       too: speculators' DFlash2 modules are the reference's, as ours are); the embedding,
                       verifier head and verifier norm are left out (they are the target's); a pruned draft
                       vocabulary adds ``lm_head.weight`` [draft vocab, H], ``t2d`` [vocab] and ``d2t``
                       [draft vocab]
    config.py, optimizer_state_dict.pt, ...   never read (one is code, the other a pickle)

Either is translated into the reference-format config.json our readers read (export.py: a DFlash2 one
names ``DFlash2DraftModel`` and carries the four settings in ``dflash_config``); the weights load as
they are.

Tap ids: speculators' aux id ``k`` is ``output_hidden_states[k]``, index 0 being the embedding output,
so aux id = our tap id + 1 (``AUX_ID_OFFSET``, as in the hidden-state caches): its DFlash converter
maps a release's ``target_layer_ids`` to ``[i + 1 ...]``, and its default ids ``[2, N/2, N-3]`` are
the reference's ``[1, ..., N-4]`` shifted by one. Aux id 0 (the embedding output) has no tap id.

A DSpark checkpoint (``speculators_model_type: "dspark"``) is dspark_formats.py's, which reuses the checks
here. What dflash cannot use is refused in one line: another algorithm (EAGLE-3, ...); a pruned draft
vocabulary (dflash drafts over the target's whole vocabulary through its own LM head);
``sample_from_anchor`` (the drafter also predicts the anchor's slot, ``block_size`` tokens a round,
where dflash and the engines take the anchor from the target and draft ``block_size - 1``); sliding
layers made bidirectional inside a block (``sliding_window_non_causal``, a DFlash2 checkpoint's default:
dflash and the engines run them causal); a target that scales its embedding (Gemma), which speculators
looks up unscaled. The target's layer count is not in the checkpoint: it is the target's (``with_target``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash.data.cache_format import AUX_ID_OFFSET
from dflash.model.drafter import SLIDING, DrafterConfig
from dflash.model.export import (
    CONFIG_NAME,
    DFLASH,
    DFLASH2,
    DrafterLoadError,
    config_from_hf,
    read_config_json,
)

#: the config.json key that makes a directory a speculators checkpoint
MODEL_TYPE_KEY = "speculators_model_type"
#: the algorithms read, each with the architecture it is in the reference format
ALGORITHMS = {"dflash": DFLASH, "dflash2": DFLASH2}
#: DFlash2SpeculatorConfig's settings with its defaults (for a key its config.json leaves out); each is the
#: ``dflash_config`` key and DFlash2Config field of the same name
_DFLASH2_SETTINGS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
#: where `speculators train` links its best epoch
BEST = "checkpoint_best"
#: tensors a checkpoint may hold that are the target's own (the drafter uses the target's)
_TARGETS_OWN = frozenset({"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight",
                          "verifier_norm.weight"})
_VOCAB_MAPS = ("t2d", "d2t")
#: speculators' DFlashSpeculatorConfig defaults, for a key its config.json leaves out
_DEFAULT_BLOCK, _DEFAULT_DRAFT_VOCAB = 8, 32000


class SpeculatorsRefusal(DrafterLoadError):
    """A speculators checkpoint dflash cannot use; the message says why in one line."""


def is_speculators_config(d: object) -> bool:
    return isinstance(d, dict) and MODEL_TYPE_KEY in d


def speculators_dir(path: str | Path) -> Path | None:
    """The checkpoint directory ``path`` names: itself when its config.json is a speculators one, else,
    for a `speculators train` save path, its ``checkpoint_best`` or its highest epoch; None when ``path``
    holds no speculators checkpoint."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return None
    if (p / CONFIG_NAME).is_file():
        return p if _reads_as_speculators(p) else None
    epochs = sorted((int(c.name), c) for c in p.iterdir() if c.name.isdigit() and c.is_dir())
    for candidate in [p / BEST] + [c for _, c in reversed(epochs)]:
        if (candidate / CONFIG_NAME).is_file() and _reads_as_speculators(candidate):
            return candidate
    return None


def _reads_as_speculators(p: Path) -> bool:
    try:
        return is_speculators_config(read_config_json(p))
    except DrafterLoadError:
        return False


def drafter_config(d: dict) -> DrafterConfig:
    """The DrafterConfig of a speculators config.json (``num_target_layers`` is the least its taps need
    until ``with_target`` says the target's); a SpeculatorsRefusal for what dflash cannot use, the
    readers' KeyError/TypeError/ValueError for a malformed one."""
    cfg = config_from_hf(reference_config(d))
    # DFlash2SpeculatorConfig makes sliding layers bidirectional unless told otherwise, DFlash's does not
    if d.get("sliding_window_non_causal", d.get(MODEL_TYPE_KEY) == "dflash2") and SLIDING in cfg.layer_types:
        raise SpeculatorsRefusal("its sliding layers attend both ways inside a block (sliding_window_non_causal): "
                                 "dflash and the serving engines run them causal")
    return cfg


def reference_config(d: dict) -> dict:
    """The same drafter as a reference-format config.json (what our export writes and the readers
    read): the layers' config with the DFlash fields beside it, the taps as our ids."""
    algorithm, spec = d.get(MODEL_TYPE_KEY), d.get("speculators_config")
    declared = spec.get("algorithm", algorithm) if isinstance(spec, dict) else algorithm
    if algorithm not in ALGORITHMS or declared not in ALGORITHMS:
        name = algorithm if algorithm not in ALGORITHMS else declared
        raise SpeculatorsRefusal(f"a speculators {name!r} checkpoint: dflash reads speculators' "
                                 "'dflash', 'dflash2' and 'dspark' drafters only")
    if declared != algorithm:
        raise SpeculatorsRefusal(f"its {MODEL_TYPE_KEY} {algorithm!r} and speculators_config.algorithm {declared!r} "
                                 "disagree on which drafter it is")
    layers = d.get("transformer_layer_config")
    if not isinstance(layers, dict):
        raise SpeculatorsRefusal("a speculators checkpoint without a transformer_layer_config")
    vocab, draft = layers.get("vocab_size"), d.get("draft_vocab_size", _DEFAULT_DRAFT_VOCAB)
    if not isinstance(vocab, int):
        raise SpeculatorsRefusal(f"its transformer_layer_config has no vocab_size (found {vocab!r})")
    if draft != vocab:
        raise SpeculatorsRefusal(f"its draft vocabulary is pruned to {draft} tokens, the target has {vocab} "
                                 "(d2t/t2d): dflash drafts over the target's whole vocabulary")
    if d.get("sample_from_anchor"):
        raise SpeculatorsRefusal("it predicts the anchor's slot too (sample_from_anchor): dflash takes the anchor "
                                 "from the target and drafts the block's other slots")
    act = layers.get("hidden_act", "silu")
    if act != "silu":
        raise SpeculatorsRefusal(f"its layers use the {act!r} activation: dflash's drafter layers are SiLU")
    aux = d.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(a, int) for a in aux):
        raise SpeculatorsRefusal(f"aux_hidden_state_layer_ids is {aux!r}, not a list of layer ids")
    if min(aux) < AUX_ID_OFFSET:
        raise SpeculatorsRefusal(f"aux_hidden_state_layer_ids {aux} taps the embedding output (id 0), which "
                                 "dflash does not tap")
    if d.get("mask_token_id") is None:
        raise SpeculatorsRefusal("it has no mask_token_id")
    block = d.get("block_size", _DEFAULT_BLOCK)
    dflash = {"mask_token_id": d["mask_token_id"], "block_size": block,
              "target_layer_ids": [a - AUX_ID_OFFSET for a in aux]}
    if algorithm == "dflash2":
        dflash.update({k: d.get(k, default) for k, default in _DFLASH2_SETTINGS.items()})
        # speculators' forward looks the block up in the target's embedding unscaled and takes the target's
        # head uncapped: no embedding scale, no output multiplier, no soft-cap (a target that scales its
        # embedding is refused by with_target)
        dflash.update(input_embedding_scale=1.0, output_multiplier=1.0)
    return {**layers, "architectures": [ALGORITHMS[algorithm]], "block_size": block, "dflash_config": dflash}


def drafter_tensors(tensors: dict, where: str) -> dict:
    """The drafter's own entries of a checkpoint's tensors (or of their shapes): the target's are left
    out, draft-vocabulary maps refused (a config that hides them still has them in its weights)."""
    maps = [k for k in _VOCAB_MAPS if k in tensors]
    if maps:
        raise SpeculatorsRefusal(f"{where}: its weights hold {' and '.join(maps)}: a pruned draft vocabulary, and "
                                 "dflash drafts over the target's whole vocabulary")
    return {k: v for k, v in tensors.items() if k not in _TARGETS_OWN}


def with_target(cfg: DrafterConfig, target: Any) -> DrafterConfig:
    """``cfg`` for ``target`` (its ``num_layers`` and ``frozen_head``). A speculators checkpoint names its
    verifier, not the verifier's layer count, so the taps are checked against the target it is used with.
    And speculators looks a block up in the target's embedding rows as they are (a plain lookup, for every
    target): a target that scales its embedding (Gemma) would give the drafter inputs it never saw, since
    dflash applies the target's embedding as the target does."""
    from dflash.targets.heads import embedding_scale

    deepest = max(cfg.target_layer_ids)
    if deepest >= target.num_layers:
        raise SpeculatorsRefusal(f"made for another target: it taps layer {deepest} (aux id "
                                 f"{deepest + AUX_ID_OFFSET}), the target has {target.num_layers} layers")
    scale = embedding_scale(target.frozen_embedding(target.device))
    if scale != 1.0:
        raise SpeculatorsRefusal(f"speculators trained it on the target's embedding rows unscaled, and this target "
                                 f"scales them by {scale:g}, as dflash applies them: it would draft from inputs it "
                                 "never saw")
    return replace(cfg, num_target_layers=target.num_layers)


def verifier_named(path: str | Path) -> str | None:
    """The verifier a speculators checkpoint was trained against (``speculators_config.verifier``)."""
    spec = read_config_json(Path(path)).get("speculators_config")
    verifier = spec.get("verifier") if isinstance(spec, dict) else None
    name = verifier.get("name_or_path") if isinstance(verifier, dict) else None
    return name if isinstance(name, str) and name else None

