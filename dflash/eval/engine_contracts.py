"""What vLLM and SGLang make of an exported drafter's config.json, beside what the drafter trained on.

A drafter that trained well and accepts little when served is most often read differently by the engine
than the trainer meant it: a tap layer off by one, a block size the converter did not carry, a layer
that is causal in one and bidirectional in the other, a mask token looked up by name. The engines do
not report any of this; they load and serve. So ``dflash export`` resolves its own config.json the way
each engine's loader does (the rules below, read from the engines' code; docs/interop.md names the
commits) and says every disagreement in one line.

Everything is stated in dflash's own terms, so the two sides compare directly:

* tap layers as 0-based target layers whose *output* is tapped (Hugging Face ``hidden_states[i + 1]``);
  vLLM's aux-layer ids count the other way (the *input* of layer ``i``), so a vLLM id is one more;
* the block as the number of query slots per round (anchor + drafts);
* each drafter layer as (kind, window, causal).

vLLM (``qwen3_dflash.py``, ``qwen3_dflash2.py``, ``eagle3_utils.get_eagle3_aux_layers_from_config``):
aux layers from ``eagle_aux_hidden_state_layer_ids`` as they are, else ``dflash_config.target_layer_ids``
+ 1, else ``dspark_target_layer_ids`` + 1, else the top-level ``target_layer_ids`` + 1, else
``dflash_config.layer_ids`` / ``eagle_config.layer_ids`` as they are, else the target model's own default;
the block is ``num_speculative_tokens`` + 1 from the command line; a layer slides where ``layer_types``
says so (every layer when ``dflash_config.use_swa`` and none does, or when there is no ``layer_types``),
its window ``dflash_config.swa_window_size`` else ``sliding_window``; causality from the top-level
``is_causal``, else ``dflash_config.causal``, else a ``sliding_attention`` layer is causal (a layer with
no ``layer_types`` is not); mixed sliding/full layers need the V2 model runner; the mask id from
``dflash_config`` then the top level; ``is_neox_style`` (default true) and ``use_aux_hidden_state``
(default true); DFlash2's conv and selector keys from ``dflash_config`` only (required), with
``input_embedding_scale`` and ``output_multiplier`` (default 1) and ``final_logit_softcapping`` (0 or
absent: none).

SGLang (``dflash_utils.parse_dflash_draft_config``): every key from ``dflash_config`` first, then the top
level; tap layers as dflash counts them (SGLang adds the 1 itself), and without them
``build_target_layer_ids(num_target_layers, num_hidden_layers)``; ``--speculative-num-draft-tokens`` is
the block itself; a ``sliding_attention`` layer needs the top-level ``sliding_window``; the mask id, else
the token named ``mask_token`` (default ``<|MASK|>``) looked up in the tokenizer; conv and selector keys
from ``dflash_config`` only, each pair together or neither (absent: 0, no convolution / no selector);
``output_multiplier`` and ``final_logit_softcapping`` from ``dflash_config``. SGLang's parser does not
read ``input_embedding_scale`` or layer causality, so neither is compared for it.

A DSpark drafter's backbone is read by the same rules with these changes. vLLM (``qwen3_dspark.py``)
builds its Qwen3 DSpark model on its DFlash Qwen3 model, so taps, layer attention, mask and switches are
read as above (``dspark_target_layer_ids`` is in the tap order above); its block is the command line's,
so no config key is compared for it. A speculators-convention file reaches it through vLLM's
speculators adapter: the layers from ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` as the
aux ids as given, ``dflash_config`` holding ``mask_token_id`` and those ids - 1. SGLang (``models/dspark.py``
through ``dspark_config.parse_dspark_draft_config``, which starts from the DFlash parser above): the
top-level ``dspark_target_layer_ids`` (dflash's count, a non-empty list) before every other tap key,
``dspark_block_size`` before ``block_size`` (DSpark's block is the drafts per round, which is what
SGLang's gamma counts; ``--speculative-num-draft-tokens`` is that + 1 and a difference only warns), and
the mask id from ``dspark_noise_token_id``, then ``dspark_config``, ``text_config``, the top level, and
only then ``dflash_config``; without one the drafter is refused (no token is looked up by name).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from dflash.model.drafter import FULL, SLIDING, DrafterConfig, default_target_layer_ids

ENGINES = ("vllm", "sglang")
#: the mask token SGLang looks up by name when a config gives no mask id
SGLANG_MASK_TOKEN = "<|MASK|>"
#: DFlash2's keys an engine reads, in the order they are reported
DFLASH2_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k",
                    "input_embedding_scale", "output_multiplier", "final_logit_softcapping")


@dataclass
class Contract:
    """A drafter as one side means it, in dflash's terms (see the module docstring); None: not stated
    there (the engine falls back on something of its own, said in ``notes``)."""

    architecture: str | None = None
    target_layer_ids: list[int] | None = None
    num_target_layers: int | None = None
    block_size: int | None = None
    layers: list[tuple[str, int | None, bool | None]] | None = None  # (kind, window, causal) per layer
    mask_token: int | str | None = None  # an id, or a token name the engine looks up
    dflash2: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # engine-only switches, each with the value training implies
    refused: str | None = None  # what the engine's loader raises on this config
    needs: list[str] = field(default_factory=list)  # what launching it needs (an environment variable, ...)


@dataclass
class Disagreement:
    """One key the engine reads otherwise than the drafter trained on."""

    key: str
    engine: str
    served: object
    trained: object

    def __str__(self) -> str:
        return f"{self.engine}: {self.key} is {_show(self.served)} as served, {_show(self.trained)} as trained"


def _show(v: object) -> str:
    if isinstance(v, str):
        return v
    return json.dumps(v) if isinstance(v, (list, dict)) else str(v)


def trained_contract(cfg: DrafterConfig) -> Contract:
    """What the drafter trained on: the truth an engine's reading is held against."""
    from dflash.model.dflash2 import DFlash2Config
    from dflash.model.export import DFLASH, DFLASH2

    is2 = isinstance(cfg, DFlash2Config)
    return Contract(
        architecture=DFLASH2 if is2 else DFLASH,
        target_layer_ids=list(cfg.target_layer_ids),
        num_target_layers=cfg.num_target_layers,
        block_size=cfg.block_size,
        layers=[(t, cfg.sliding_window if t == SLIDING else None, t == SLIDING) for t in cfg.layer_types],
        mask_token=cfg.mask_token_id,
        dflash2={k: _norm2(k, getattr(cfg, k)) for k in DFLASH2_SETTINGS} if is2 else {},
        extra={"is_neox_style": True, "use_aux_hidden_state": True},
    )


def _norm2(key: str, value):
    """DFlash2 settings as the engines hold them: no soft-capping is None however it is written."""
    if key == "final_logit_softcapping":
        return float(value) if value else None
    return float(value) if key in ("input_embedding_scale", "output_multiplier") else int(value)


def _int_list(v) -> list[int] | None:
    return [int(x) for x in v] if isinstance(v, (list, tuple)) and v else None


def vllm_contract(d: dict, num_speculative_tokens: int | None) -> Contract:
    """config.json as vLLM's DFlash loader reads it, served with ``num_speculative_tokens``."""
    from dflash.model.export import DFLASH2

    dc = d.get("dflash_config") or {}
    c = Contract(architecture=(d.get("architectures") or [None])[0])
    c.block_size = None if num_speculative_tokens is None else num_speculative_tokens + 1
    aux = _int_list(d.get("eagle_aux_hidden_state_layer_ids"))
    for shifted in (dc.get("target_layer_ids"), d.get("dspark_target_layer_ids"), d.get("target_layer_ids")):
        if aux is None and _int_list(shifted):
            aux = [i + 1 for i in _int_list(shifted)]
    for name in ("dflash_config", "eagle_config"):
        sub = d.get(name)
        if aux is None and isinstance(sub, dict):
            aux = _int_list(sub.get("layer_ids"))
    c.target_layer_ids = None if aux is None else [i - 1 for i in aux]  # vLLM's id is the layer's input
    c.mask_token = dc.get("mask_token_id", d.get("mask_token_id"))
    c.layers, c.refused, c.needs = _vllm_layers(d, dc)
    c.extra = {"is_neox_style": bool(d.get("is_neox_style", True)),
               "use_aux_hidden_state": bool(dc.get("use_aux_hidden_state", d.get("use_aux_hidden_state", True)))}
    if c.architecture == DFLASH2:
        missing = [k for k in DFLASH2_SETTINGS[:4] if k not in dc]
        if missing and c.refused is None:
            c.refused = f"KeyError: dflash_config[{missing[0]!r}] (DFlash2 reads it from dflash_config only)"
        c.dflash2 = {k: _norm2(k, dc[k]) for k in DFLASH2_SETTINGS[:4] if k in dc}
        c.dflash2.update(input_embedding_scale=float(dc.get("input_embedding_scale", 1.0)),
                         output_multiplier=float(dc.get("output_multiplier", 1.0)),
                         final_logit_softcapping=_norm2("final_logit_softcapping",
                                                        dc.get("final_logit_softcapping")))
    return c


def _vllm_layers(d: dict, dc: dict) -> tuple[list | None, str | None, list[str]]:
    n = int(d.get("num_hidden_layers") or 0)
    types = d.get("layer_types")
    use_swa = bool(dc.get("use_swa", False))
    needs = []
    any_sliding = bool(types) and SLIDING in types
    if types and 0 < sum(t == SLIDING for t in types) < len(types):
        needs.append("VLLM_USE_V2_MODEL_RUNNER=1 (mixed sliding/full drafter layers)")
    window = dc.get("swa_window_size", d.get("sliding_window"))
    layers = []
    for i in range(n):
        sliding = use_swa if types is None or (use_swa and not any_sliding) else types[i] == SLIDING
        causal = d.get("is_causal")
        if causal is None:
            causal = dc.get("causal")
        if causal is None:
            causal = bool(types) and types[i] == SLIDING
        if sliding and window is None:
            return None, ("ValueError: sliding attention needs dflash_config.swa_window_size or the top-level "
                          "sliding_window"), needs
        layers.append((SLIDING if sliding else FULL, int(window) if sliding else None, bool(causal)))
    return layers, None, needs


def sglang_contract(d: dict) -> Contract:
    """config.json as SGLang's ``parse_dflash_draft_config`` (and its window helper) reads it."""
    dc = d.get("dflash_config") or {}
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else d

    def pick(name):
        return dc.get(name, d.get(name))

    c = Contract(architecture=(d.get("architectures") or [None])[0])
    c.num_target_layers = None if pick("num_target_layers") is None else int(pick("num_target_layers"))
    c.block_size = None if pick("block_size") is None else int(pick("block_size"))
    ids = pick("target_layer_ids")
    n = int(text.get("num_hidden_layers") or 0)
    if ids is not None:
        c.target_layer_ids = [int(x) for x in ids]
    elif c.num_target_layers:
        c.target_layer_ids = default_target_layer_ids(c.num_target_layers, n)
    mask_id = pick("mask_token_id")
    name = pick("mask_token") or SGLANG_MASK_TOKEN
    c.mask_token = int(mask_id) if mask_id is not None else f"the token named {name!r}"
    types = text.get("layer_types", d.get("layer_types"))
    window = text.get("sliding_window", d.get("sliding_window"))
    if types is not None:
        if SLIDING in types and window is None:
            c.refused = "ValueError: DFLASH sliding_attention layers require config.sliding_window"
        c.layers = [(str(t), int(window) if t == SLIDING and window is not None else None, None) for t in types]
    else:
        c.layers = [(FULL, None, None)] * n
    conv = (int(dc.get("conv_kernel_size", 0) or 0), int(dc.get("conv_group_size", 0) or 0))
    sel = (int(dc.get("selector_rank", 0) or 0), int(dc.get("selector_top_k", 0) or 0))
    for what, pair in (("conv_kernel_size and conv_group_size", conv), ("selector_rank and selector_top_k", sel)):
        if bool(pair[0]) != bool(pair[1]) and c.refused is None:
            c.refused = f"ValueError: DFLASH needs {what} together (dflash_config has {pair})"
    from dflash.model.export import DFLASH2

    if c.architecture == DFLASH2:
        c.dflash2 = dict(zip(DFLASH2_SETTINGS[:4], conv + sel, strict=True))
        c.dflash2.update(output_multiplier=float(dc.get("output_multiplier", 1.0)),
                         final_logit_softcapping=_norm2("final_logit_softcapping", dc.get("final_logit_softcapping")))
    return c


def engine_contract(engine: str, d: dict, block_size: int) -> Contract:
    """``engine``'s reading of config ``d``, served as ``serve_commands`` says (``block_size`` the
    trained block: vLLM is given block - 1 draft tokens, SGLang block)."""
    if engine == "vllm":
        return vllm_contract(d, block_size - 1)
    if engine == "sglang":
        return sglang_contract(d)
    raise ValueError(f"unknown engine {engine!r}: one of {', '.join(ENGINES)}")


def compare(engine: str, served: Contract, trained: Contract) -> list[Disagreement]:
    """Every key ``served`` states otherwise than ``trained``; an unstated key counts where the engine
    then falls back on a default of its own (tap layers, block, mask)."""
    if served.refused:  # nothing else matters until it loads
        return [Disagreement("loading", engine, f"refused ({served.refused})", "a drafter that loads")]
    out: list[Disagreement] = []
    for key in ("architecture", "target_layer_ids", "block_size", "mask_token", "num_target_layers"):
        s, t = getattr(served, key), getattr(trained, key)
        if key == "num_target_layers" and s is None:
            continue  # only SGLang reads it, and only to default the taps (compared themselves)
        if s != t:
            out.append(Disagreement(_KEY_NAMES[key], engine, "not stated (the engine's default)" if s is None else s,
                                    t))
    if served.layers is not None:
        bad = [i for i, (s, t) in enumerate(zip(served.layers, trained.layers, strict=False))
               if s[0] != t[0] or s[1] != t[1] or (s[2] is not None and s[2] != t[2])]
        if len(served.layers) != len(trained.layers):
            out.append(Disagreement("num_hidden_layers", engine, len(served.layers), len(trained.layers)))
        elif bad:
            out.append(Disagreement(f"layer attention (layers {bad})", engine,
                                    [_layer_text(served.layers[i]) for i in bad],
                                    [_layer_text(trained.layers[i]) for i in bad]))
    for k, s in served.dflash2.items():
        if s != trained.dflash2.get(k):
            out.append(Disagreement(f"dflash_config.{k}", engine, s, trained.dflash2.get(k)))
    for k, s in served.extra.items():
        if s != trained.extra.get(k):
            out.append(Disagreement(k, engine, s, trained.extra.get(k)))
    return out


_KEY_NAMES = {"architecture": "architectures", "target_layer_ids": "tap layers (target_layer_ids)",
              "block_size": "block size", "mask_token": "mask token", "num_target_layers": "num_target_layers"}


def _layer_text(layer: tuple) -> str:
    kind, window, causal = layer
    text = f"sliding {window}" if kind == SLIDING else "full" if kind == FULL else str(kind)
    return text if causal is None else f"{text}, {'causal' if causal else 'bidirectional'}"


def check_config(d: dict, trained: DrafterConfig, engines: tuple[str, ...] = ENGINES) -> list[Disagreement]:
    """The disagreements between an export's config.json ``d`` and the drafter it should describe."""
    truth = trained_contract(trained)
    return [x for e in engines for x in compare(e, engine_contract(e, d, trained.block_size), truth)]


def launch_needs(d: dict, engine: str) -> list[str]:
    """What serving config ``d`` on ``engine`` needs beyond the command (vLLM's V2 runner for mixed layers)."""
    return engine_contract(engine, d, 2).needs if engine == "vllm" else []


def serve_commands(export_dir: str | Path, cfg: DrafterConfig, target: str, d: dict | None = None) -> dict[str, str]:
    """The commands that serve the export with the block it trained on (vLLM counts the drafts, block - 1;
    SGLang the block itself)."""
    path = shlex.quote(str(export_dir))
    spec = json.dumps({"method": "dflash", "model": str(export_dir), "num_speculative_tokens": cfg.block_size - 1})
    env = " ".join(n.split()[0] + " " for n in launch_needs(d or {}, "vllm"))
    return {
        "vllm": f"{env}vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(spec)}",
        "sglang": (f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm DFLASH "
                   f"--speculative-draft-model-path {path} --speculative-num-draft-tokens {cfg.block_size}"),
    }


# --------------------------------------------------------------------------------------------------
# DSpark's heads
# --------------------------------------------------------------------------------------------------
#: the DSpark settings vLLM's Qwen3 DSpark model reads from the config's top level, in report order
DSPARK_SETTINGS = ("markov_rank", "draft_vocab_size", "enable_confidence_head", "confidence_head_with_markov",
                   "dspark_draft_topk")


def dspark_trained(cfg) -> dict:
    """DSpark's head settings as the drafter trained them: a full-vocabulary Markov head of its rank, a
    confidence head on [h ; Markov embedding], the Markov bias over the whole vocabulary (no top-k)."""
    return {"markov_rank": cfg.markov_rank, "draft_vocab_size": cfg.vocab_size, "enable_confidence_head": True,
            "confidence_head_with_markov": True, "dspark_draft_topk": None}


def vllm_dspark(d: dict) -> tuple[dict, str | None]:
    """(the head settings, what loading raises) as vLLM's ``qwen3_dspark.py`` reads config ``d``:
    ``markov_rank`` required; ``draft_vocab_size`` else ``vocab_size``; ``enable_confidence_head`` and
    ``confidence_head_with_markov`` default false (a head without the Markov input is [1, H], which a
    [1, H + r] trained weight does not fit); ``dspark_draft_topk`` default none (set: the Markov bias
    only on the top-k base candidates)."""
    if d.get("markov_rank") is None:
        return {}, "AttributeError: the config has no markov_rank (vLLM reads it from the top level)"
    got = {"markov_rank": int(d["markov_rank"]),
           "draft_vocab_size": int(d.get("draft_vocab_size") or d.get("vocab_size") or 0),
           "enable_confidence_head": bool(d.get("enable_confidence_head", False)),
           "confidence_head_with_markov": bool(d.get("confidence_head_with_markov", False)),
           "dspark_draft_topk": d.get("dspark_draft_topk")}
    if got["enable_confidence_head"] and not got["confidence_head_with_markov"]:
        return got, ("ValueError: confidence_head.proj.weight is [1, hidden + markov_rank] in the file, [1, hidden] "
                     "in vLLM's head (confidence_head_with_markov is false)")
    return got, None


def sglang_dspark(d: dict) -> tuple[dict, str | None]:
    """(the head settings, what loading raises) as SGLang's ``models/dspark.py`` reads config ``d`` (its
    ``dflash_config`` first, then the top level): a speculators-convention file
    (``speculators_model_type: "dspark"``: slot j predicts anchor + j) is refused, as is a
    ``markov_rank`` of 0 or a head type other than vanilla, gated or rnn; the confidence head is on
    unless the config says otherwise, with the Markov input where the rank is above 0."""
    dc = d.get("dflash_config") or {}

    def pick(name, default=None):
        return dc.get(name, d.get(name, default))

    if d.get("speculators_model_type") == "dspark":
        return {}, ("ValueError: a speculators-convention DSpark checkpoint (slot j predicts anchor + j) is refused "
                    "by SGLang's DSpark drafter; export --format deepspec for SGLang")
    rank = int(pick("markov_rank", 0) or 0)
    if rank <= 0:
        return {}, f"ValueError: DSpark requires markov_rank > 0, got {rank}"
    kind = str(pick("markov_head_type", "vanilla")).lower()
    if kind not in ("vanilla", "gated", "rnn"):
        return {}, f"ValueError: unsupported DSpark markov_head_type {kind!r}"
    return {"markov_rank": rank, "enable_confidence_head": bool(pick("enable_confidence_head", True)),
            "confidence_head_with_markov": bool(pick("confidence_head_with_markov", rank > 0))}, None


# --------------------------------------------------------------------------------------------------
# DSpark's backbone
# --------------------------------------------------------------------------------------------------
def speculators_as_vllm(d: dict) -> dict:
    """A speculators-convention DSpark config.json as vLLM's speculators adapter hands it to its DSpark
    model: the layers from ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` as the aux ids
    as given, ``dflash_config`` holding the mask id and those ids - 1, the head settings at the top."""
    out = dict(d.get("transformer_layer_config") or {})
    aux = d.get("aux_hidden_state_layer_ids")
    out.update({k: d[k] for k in (*DSPARK_SETTINGS, "markov_head_type") if k in d})
    out["eagle_aux_hidden_state_layer_ids"] = aux
    out["dflash_config"] = {"mask_token_id": d.get("mask_token_id"),
                            "target_layer_ids": None if aux is None else [int(i) - 1 for i in aux]}
    return out


def vllm_dspark_backbone(d: dict) -> Contract:
    """The backbone as vLLM's Qwen3 DSpark model reads it: its DFlash Qwen3 model's rules, unchanged
    (aux layers, layer attention, mask, switches); the block comes from the command line, so no config
    key is held against it."""
    c = vllm_contract(speculators_as_vllm(d) if d.get("speculators_model_type") == "dspark" else d, None)
    c.architecture = None  # the format's name, checked with the heads
    return c


def sglang_dspark_backbone(d: dict) -> Contract:
    """The backbone as SGLang's DSpark config parser reads it: its DFlash parser's reading, then the
    ``dspark_``-prefixed top-level keys first (``dspark_target_layer_ids`` as dflash counts them,
    ``dspark_block_size``, ``dspark_noise_token_id`` for the mask); the mask id from ``dspark_config``,
    ``text_config``, the top level, and only then ``dflash_config``, and without one the drafter is
    refused (no token is looked up by name); the block is the drafts per round, which DSpark's block is."""
    c = sglang_contract(d)
    c.architecture = None
    taps = d.get("dspark_target_layer_ids")
    if taps is not None:
        if not (isinstance(taps, (list, tuple)) and taps):
            c.refused = c.refused or f"ValueError: dspark_target_layer_ids must be a non-empty list, got {taps!r}"
        else:
            c.target_layer_ids = [int(x) for x in taps]
    if d.get("dspark_block_size") is not None:
        c.block_size = int(d["dspark_block_size"])
    text = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
    ds = d.get("dspark_config") if isinstance(d.get("dspark_config"), dict) else {}
    dc = d.get("dflash_config") or {}
    for where in (d.get("dspark_noise_token_id"), ds.get("mask_token_id"), text.get("mask_token_id"),
                  d.get("mask_token_id"), dc.get("mask_token_id")):
        if where is not None:
            c.mask_token = int(where)
            break
    else:
        c.refused = c.refused or "ValueError: DSpark requires mask_token_id to be set in the draft model config"
    return c


def dspark_backbone_truth(cfg) -> Contract:
    """What a DSpark drafter's backbone trained on, as the engines' DSpark readings state it: no
    architecture (the format's, checked with the heads), no DFlash2 keys."""
    truth = trained_contract(cfg)
    truth.architecture = None
    return truth


def check_dspark(d: dict, trained, engines: tuple[str, ...] = ENGINES) -> list[Disagreement]:
    """The disagreements between a DSpark export's config.json ``d`` and the drafter ``trained`` (a
    DSparkConfig), engine by engine: a refusal alone, else each head setting and then each backbone key
    read otherwise (the backbone through ``compare``, as for DFlash)."""
    truth = dspark_trained(trained)
    out: list[Disagreement] = []
    for engine in engines:
        got, refused = {"vllm": vllm_dspark, "sglang": sglang_dspark}[engine](d)
        if refused:
            out.append(Disagreement("loading", engine, f"refused ({refused})", "a drafter that loads"))
            continue
        out += [Disagreement(k, engine, v, truth[k]) for k, v in got.items() if v != truth[k]]
        backbone = dspark_backbone_truth(trained)
        if engine == "vllm":
            backbone.block_size = None  # vLLM's block is the command line's, not a config key
        served = {"vllm": vllm_dspark_backbone, "sglang": sglang_dspark_backbone}[engine](d)
        out += compare(engine, served, backbone)
    return out
