"""DSpark drafters on disk, in the three formats the field writes them in, all with the same tensor names
(``layers.N...``, ``fc``, ``hidden_norm``, ``norm``, ``markov_head.markov_w{1,2}.weight``,
``confidence_head.proj.{weight,bias}``):

* ``deepspec`` (the default: vLLM and SGLang both load it): ``architectures: ["Qwen3DSparkModel"]``, a
  Qwen3 config with DSpark's settings at the top level (``target_layer_ids``, ``num_target_layers``,
  ``block_size``, ``mask_token_id``, ``num_anchors``, ``markov_rank``, ``markov_head_type``,
  ``enable_confidence_head``, ``confidence_head_with_markov``, ``draft_vocab_size``) and in
  ``dflash_config``; the weights carry the target's ``embed_tokens.weight`` and ``lm_head.weight`` beside
  the drafter's (SGLang's loader requires them), so writing one needs the target.
* ``speculators``: ``speculators_model_type: "dspark"`` (speculators' ``DSparkSpeculatorConfig``): the
  layers in ``transformer_layer_config``, taps as ``aux_hidden_state_layer_ids`` (our id + 1),
  ``sample_from_anchor: true`` and the four head settings at the top level; the drafter's tensors only.
* ``specforge``: ``architectures: ["DSparkDraftModel"]``, the settings inside ``dflash_config`` with
  ``projector_type: "dspark"``; the drafter's tensors only.

Tap ids are ours in the first and last (id i is the output of target layer i, as DeepSpec reads
``hidden_states[i + 1]``). Reading any of the three gives a DSparkConfig; the target's tensors a file
carries are left out (the drafter uses the target's own). What a DSpark drafter here cannot be is
refused in one line: a pruned draft vocabulary (``draft_vocab_size`` below the vocabulary, or ``d2t`` /
``t2d`` in the weights), a Markov head other than the vanilla one, a drafter without its Markov or
confidence head, drafting without the anchor slot.
"""

from __future__ import annotations

from typing import Any

from dflash.data.cache_format import AUX_ID_OFFSET
from dflash.model.drafter import DrafterConfig
from dflash.model.dspark import DEFAULT_GAMMA, DSparkConfig, settings_problem
from dflash.model.export import DrafterLoadError, config_from_hf, hf_config

DEEPSPEC, SPECULATORS, SPECFORGE = "deepspec", "speculators", "specforge"
FORMATS = (DEEPSPEC, SPECULATORS, SPECFORGE)
DEFAULT_FORMAT = DEEPSPEC
#: architectures of the two formats that name one
ARCHITECTURES = {DEEPSPEC: "Qwen3DSparkModel", SPECFORGE: "DSparkDraftModel"}
#: the published recipe's anchors per sequence (DeepSpec's config states it)
RECIPE_ANCHORS = 512
#: the target's tensors a DeepSpec file carries (written from the target, left out when read)
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")


class DSparkRefusal(DrafterLoadError):
    """A DSpark file this drafter cannot be; the message says why in one line."""


def _settings(cfg: DSparkConfig) -> dict[str, Any]:
    return {"markov_rank": cfg.markov_rank, "markov_head_type": cfg.markov_head_type,
            "enable_confidence_head": True, "confidence_head_with_markov": True}


def config_json(cfg: DSparkConfig, fmt: str, dtype) -> dict:
    """The config.json of ``cfg`` in ``fmt``."""
    base = hf_config(cfg, dtype)
    taps = list(cfg.target_layer_ids)
    if fmt == DEEPSPEC:
        return {**base, "architectures": [ARCHITECTURES[DEEPSPEC]], "target_layer_ids": taps,
                "mask_token_id": cfg.mask_token_id, "num_anchors": RECIPE_ANCHORS, "draft_vocab_size": cfg.vocab_size,
                **_settings(cfg)}
    if fmt == SPECFORGE:
        return {**base, "architectures": [ARCHITECTURES[SPECFORGE]],
                "dflash_config": {**base["dflash_config"], "projector_type": "dspark", **_settings(cfg)}}
    if fmt == SPECULATORS:
        layers = {k: v for k, v in base.items() if k not in ("architectures", "block_size", "num_target_layers",
                                                               "dflash_config", "dflash_trainer")}
        return {
            "architectures": ["DSparkSpeculator"],
            "speculators_model_type": "dspark",
            "speculators_config": {
                "algorithm": "dspark",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.block_size,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": None, "architectures": []},
            },
            "transformer_layer_config": layers,
            "draft_vocab_size": cfg.vocab_size,
            "block_size": cfg.block_size,
            "target_hidden_size": None,
            "aux_hidden_state_layer_ids": [i + AUX_ID_OFFSET for i in taps],
            "mask_token_id": cfg.mask_token_id,
            "sliding_window_non_causal": False,
            "sample_from_anchor": True,
            **_settings(cfg),
            "dflash_trainer": base["dflash_trainer"],
        }
    raise ValueError(f"--format {fmt!r}: a DSpark drafter is written as {', '.join(FORMATS)}")


def is_dspark_config(d: dict) -> bool:
    arch = (d.get("architectures") or [None])[0]
    return d.get("speculators_model_type") == "dspark" or arch in ARCHITECTURES.values()


def format_of(d: dict) -> str:
    if d.get("speculators_model_type") == "dspark":
        return SPECULATORS
    return DEEPSPEC if (d.get("architectures") or [None])[0] == ARCHITECTURES[DEEPSPEC] else SPECFORGE


def read_config(d: dict) -> DSparkConfig:
    """The DSparkConfig of a config.json in any of the three formats; a DSparkRefusal (one line) for what
    cannot be carried."""
    fmt = format_of(d)
    dc = d.get("dflash_config") or {}

    def pick(name, default=None):
        return dc.get(name, d.get(name, default))

    if pick("sample_from_anchor", True) is False:
        raise DSparkRefusal("it drafts from the masked slots only (sample_from_anchor false): a DSpark drafter "
                            "here drafts from the anchor slot")
    rank = int(pick("markov_rank", 0) or 0)
    problem = settings_problem(rank, str(pick("markov_head_type", "vanilla")),
                               confidence_head=bool(pick("enable_confidence_head", False)),
                               confidence_with_markov=bool(pick("confidence_head_with_markov", False)))
    if problem:
        raise DSparkRefusal(problem)
    if fmt == SPECULATORS:
        from dflash.model.speculators_format import reference_config

        # the same checks as a speculators DFlash checkpoint (vocabulary, activation, taps), on its fields
        spec = dict(d.get("speculators_config") or {}, algorithm="dflash")
        ref = reference_config({**d, "speculators_model_type": "dflash", "speculators_config": spec,
                                "sample_from_anchor": False})
        base = config_from_hf(ref)
    else:
        draft, vocab = pick("draft_vocab_size"), d.get("vocab_size")
        if draft is not None and draft != vocab:
            raise DSparkRefusal(f"its draft vocabulary is pruned to {draft} tokens, the target has {vocab} (d2t): a "
                                "DSpark drafter here drafts over the target's whole vocabulary")
        base = config_from_hf(d)
    trained = (d.get("dflash_trainer") or {}).get("gamma")  # ours say the decay they trained with
    return as_dspark(base, rank, gamma=float(trained) if trained else None)


def as_dspark(cfg: DrafterConfig, rank: int, gamma: float | None = None) -> DSparkConfig:
    """``cfg``'s backbone with DSpark's heads of ``rank`` (``gamma`` None: DSpark's decay)."""
    return DSparkConfig(**{**cfg.__dict__, "gamma": gamma or DEFAULT_GAMMA}, markov_rank=rank)


def drafter_tensors(tensors: dict, where: str) -> dict:
    """The drafter's own entries of a DSpark file's tensors (or their shapes): the target's left out, a
    draft-vocabulary map refused."""
    from dflash.model.speculators_format import drafter_tensors as without_targets

    try:
        return without_targets(tensors, where)
    except DrafterLoadError as e:
        raise DSparkRefusal(str(e)) from None
