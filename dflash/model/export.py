"""Drafters on disk: the reference (z-lab) export format, and our training checkpoints.

Export directory (what SGLang/vLLM and z-lab's ``DFlashDraftModel.from_pretrained`` read):

    config.json        a Qwen3 config (the drafter's own layers) plus ``architectures:
                       ["DFlashDraftModel"]``, ``block_size``, ``num_target_layers`` and
                       ``dflash_config: {mask_token_id, target_layer_ids, block_size}``; the layers'
                       ``layer_types`` with ``sliding_window`` / ``use_sliding_window`` /
                       ``max_window_layers``, and the target's RoPE scaling (``rope_parameters``, and
                       ``rope_scaling`` for transformers 4.x readers); training-only settings (gamma)
                       go under ``dflash_trainer``, which other readers ignore.
    model.safetensors  the drafter's state_dict as is: ``layers.N.self_attn.q_proj.weight``, ...,
                       ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` (no embedding, no LM
                       head: those are the target's).

A DFlash2 drafter (dflash2.py) is the same plus ``architectures: ["DFlash2DraftModel"]``, a top-level
``is_causal`` (what the layers' attention is when every layer is of one kind; left out for a mix, which
only the readers' default expresses), ``dflash_config`` keys ``conv_kernel_size``, ``conv_group_size``,
``selector_rank``, ``selector_top_k``, ``input_embedding_scale``, ``output_multiplier``,
``final_logit_softcapping``, and the weights ``layers.N.{attention,mlp}_conv.base_kernel`` /
``.kernel_projection.weight`` and ``candidate_selector.{predecessor,successor}_codebook`` (no
``.weight``: the reference's loader maps them) / ``.hidden_projection.weight``.

A speculators DFlash checkpoint (what `speculators train` saves) is read wherever an export is
(``load_exported``, ``load_drafter``); its format and what is refused are speculators_format.py's.

Training checkpoints (written by dflash/checkpoint_files.py) are ``torch.save``d dicts holding
``drafter_config`` (``dataclasses.asdict`` of the config, with its ``drafter_type``) and ``drafter``
(the state_dict).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict
from pathlib import Path

import torch

from dflash.model.dflash2 import DFlash2Config, build_drafter, config_from_dict
from dflash.model.drafter import FULL, SLIDING, DFlashDrafter, DrafterConfig, default_gamma, rope_scaling_of

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class DrafterLoadError(ValueError):
    """A drafter path that is neither a checkpoint nor an export; the message is one line."""


def hf_config(cfg: DrafterConfig, dtype: torch.dtype) -> dict:
    """The reference's config.json for a drafter (Qwen3 fields + DFlash fields).

    ``block_size`` is written at the top level (the reference's model.py reads it there) and inside
    ``dflash_config`` (where newer releases put it). ``max_window_layers`` counts the leading
    full-attention layers, so a reader that derives layer types from it (Qwen3's rule: layers from
    that index on slide) gets the usual full-then-sliding pattern right; ``layer_types`` says it exactly.
    """
    sliding = SLIDING in cfg.layer_types
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default", **(cfg.rope_scaling or {})}
    out = {
        "architectures": [DFLASH],
        "model_type": "qwen3",
        "attention_bias": cfg.attention_bias,
        "attention_dropout": 0.0,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "initializer_range": cfg.initializer_range,
        "intermediate_size": cfg.intermediate_size,
        "layer_types": list(cfg.layer_types),
        "max_position_embeddings": cfg.max_position_embeddings,
        "max_window_layers": cfg.layer_types.index(SLIDING) if sliding else cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,  # transformers 4.x readers
        "sliding_window": cfg.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids),
                          "block_size": cfg.block_size},
        "dflash_trainer": {"gamma": cfg.gamma},
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)  # transformers 4.x readers
    if isinstance(cfg, DFlash2Config):
        out["architectures"] = [DFLASH2]
        kinds = set(cfg.layer_types)
        if len(kinds) == 1:  # one kind of layer: say it (sliding layers are causal, full ones not)
            out["is_causal"] = kinds == {SLIDING}
        out["dflash_config"].update({name: getattr(cfg, name) for name in DFLASH2_KEYS})
    return out


DFLASH, DFLASH2 = "DFlashDraftModel", "DFlash2DraftModel"
#: DFlash2's ``dflash_config`` keys beyond DFlash's, each a DFlash2Config field of the same name, with
#: its type; the first four are required (the readers have no default for them)
DFLASH2_KEYS = {"conv_kernel_size": int, "conv_group_size": int, "selector_rank": int, "selector_top_k": int,
                "input_embedding_scale": float, "output_multiplier": float, "final_logit_softcapping": float}


def layer_types_from_hf(d: dict, num_layers: int) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) as a reference-format config.json states them, read as vLLM does.

    ``layer_types`` when present; else Qwen3's older rule, where ``use_sliding_window`` with a
    ``sliding_window`` makes the layers from ``max_window_layers`` on slide; else all full attention.
    ``dflash_config.swa_window_size`` names the window before ``sliding_window``, and
    ``dflash_config.use_swa`` makes every layer slide when none does. A config that sets the layers'
    causality (``is_causal``, ``dflash_config.causal``) against the engines' default (sliding layers
    causal, full ones bidirectional: the only attention dflash trains) is refused.
    """
    dc = d.get("dflash_config") or {}
    window = dc.get("swa_window_size", d.get("sliding_window"))
    window = int(window) if window else None
    types = d.get("layer_types")
    if types is not None and not isinstance(types, list):
        raise DrafterLoadError("config.json: layer_types is not a list")
    if types is not None:
        types = [str(t) for t in types]
    elif d.get("use_sliding_window") and window:
        first = int(d.get("max_window_layers", 28))  # Qwen3Config's default
        types = [FULL if i < first else SLIDING for i in range(num_layers)]
    else:
        types = [FULL] * num_layers
    if dc.get("use_swa") and SLIDING not in types:
        types = [SLIDING] * num_layers
    causal = d.get("is_causal", dc.get("causal"))
    if causal is not None and any((t == SLIDING) != bool(causal) for t in types):
        raise DrafterLoadError(f"config.json makes every layer {'causal' if causal else 'bidirectional'} "
                               "(is_causal / dflash_config.causal): dflash trains sliding layers causal and full "
                               "layers bidirectional only")
    return types, window


def config_from_hf(d: dict) -> DrafterConfig:
    """DrafterConfig from a reference-format config.json (ours or z-lab's released drafters).

    DFlash fields are read from ``dflash_config`` first, then the top level, as the reference does;
    ``block_size`` too (newer releases keep it only inside ``dflash_config``).
    """
    dc = d.get("dflash_config") or {}

    def pick(name, default=None):
        return dc.get(name, d.get(name, default))

    block = int(pick("block_size", 16))
    heads = int(d["num_attention_heads"])
    layer_ids = pick("target_layer_ids")
    if layer_ids is None:
        raise DrafterLoadError("config.json has no dflash_config.target_layer_ids")
    num_layers = int(d["num_hidden_layers"])
    layer_types, window = layer_types_from_hf(d, num_layers)
    rope = d.get("rope_parameters") or {}
    arch = (d.get("architectures") or [DFLASH])[0]
    extra = {}
    if arch == DFLASH2:
        missing = [k for k in list(DFLASH2_KEYS)[:4] if pick(k) is None]
        if missing:
            raise KeyError(f"a {DFLASH2} config needs dflash_config.{missing[0]}")
        extra = {k: cast(pick(k)) for k, cast in DFLASH2_KEYS.items() if pick(k) is not None}
    return (DFlash2Config if arch == DFLASH2 else DrafterConfig)(
        **extra,
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        vocab_size=int(d["vocab_size"]),
        num_target_layers=int(pick("num_target_layers", max(layer_ids) + 1)),
        target_layer_ids=list(layer_ids),
        mask_token_id=int(pick("mask_token_id", 0)),
        block_size=block,
        gamma=float((d.get("dflash_trainer") or {}).get("gamma") or default_gamma(block)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or d.get("rope_theta") or 10000.0),
        max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
        attention_bias=bool(d.get("attention_bias", False)),
        initializer_range=float(d.get("initializer_range", 0.02)),
        layer_types=layer_types,
        sliding_window=window if SLIDING in layer_types else None,
        rope_scaling=rope_scaling_of(d),
    )


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the reference format; ``dtype`` None keeps the
    drafter's own (exact round trip), the reference releases bfloat16."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = drafter.state_dict()
    dtype = dtype or next(iter(state.values())).dtype
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(hf_config(drafter.config, dtype), indent=2) + "\n")
    # safetensors creates its file 0600; the pair is meant to be copied and served together, so the
    # weights get the same permissions as config.json (the user's umask)
    os.chmod(out / WEIGHTS_NAME, (out / CONFIG_NAME).stat().st_mode & 0o777)
    return out


#: a drafter's config.json is a few KB; a far larger one is not a drafter's, and is not decoded
MAX_CONFIG_BYTES = 1 << 20


def read_config_json(path: Path) -> dict:
    """The config.json of a drafter directory as a dict, bounded in size before it is decoded."""
    f = Path(path) / CONFIG_NAME
    try:
        size = f.stat().st_size
        if size <= MAX_CONFIG_BYTES:
            d = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise DrafterLoadError(f"{path}: unreadable {CONFIG_NAME} ({e})") from e
    if size > MAX_CONFIG_BYTES:
        raise DrafterLoadError(f"{path}: {CONFIG_NAME} is {size:,} bytes, far more than a drafter's config")
    if not isinstance(d, dict):
        raise DrafterLoadError(f"{path}: {CONFIG_NAME} is not a JSON object")
    return d


def config_of_export(d: dict, where: str) -> DrafterConfig:
    """The DrafterConfig of an export directory's config.json: the reference format (ours, z-lab's), or
    a speculators DFlash checkpoint (speculators_format.py); anything else refused in one line."""
    # imported here: the speculators reader builds on this module's config reading
    from dflash.model import speculators_format

    try:
        if speculators_format.is_speculators_config(d):
            return speculators_format.drafter_config(d)
        arch = (d.get("architectures") or [DFLASH])[0]
        if arch not in (DFLASH, DFLASH2):
            raise DrafterLoadError(f"architecture {arch!r} is neither a {DFLASH} nor a {DFLASH2}")
        return config_from_hf(d)
    except DrafterLoadError as e:
        raise type(e)(f"{where}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise DrafterLoadError(f"{where}: {CONFIG_NAME} is not a drafter config ({type(e).__name__}: {e})") from None


def load_exported(path: str | Path, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Load an export directory (ours, a z-lab DFlash/DFlash2 drafter, or a speculators DFlash
    checkpoint) back into its drafter."""
    from safetensors.torch import load_file

    from dflash.model import speculators_format

    path = Path(path)
    d = read_config_json(path)
    cfg = config_of_export(d, str(path))
    # a speculators checkpoint may hold the target's tensors too (embedding, heads): the drafter's are kept
    own = speculators_format.drafter_tensors if speculators_format.is_speculators_config(d) else None
    shapes = _safetensors_shapes(path / WEIGHTS_NAME)
    shapes = own(shapes, str(path)) if own else shapes
    check_shapes(cfg, shapes, str(path))
    state = load_file(str(path / WEIGHTS_NAME))
    state = own(state, str(path)) if own else state
    return _build(cfg, state, str(path), dtype)


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header, without reading the tensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - not a dict
    except Exception as e:
        raise DrafterLoadError(f"{path}: not a readable safetensors file ({str(e).splitlines()[0][:120]})") from None


_LAYER_KEY = re.compile(r"^layers\.(\d+)\.")


def check_shapes(cfg: DrafterConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """Refuse a config that does not describe these weights before anything is allocated.

    A config.json (or a checkpoint's drafter_config) with absurd sizes would otherwise allocate the
    whole model first. The expected shapes come from the drafter itself, built on the meta device
    (no memory); the layer count is compared first, since even a meta build of a billion layers takes
    long.
    """
    layers = {int(m.group(1)) for k in shapes if (m := _LAYER_KEY.match(k))}
    if cfg.num_layers != len(layers):
        raise DrafterLoadError(f"{where}: weights do not match the config: it says {cfg.num_layers} layer(s), "
                               f"the weights hold {len(layers)}")
    try:
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in build_drafter(cfg).state_dict().items()}
    except Exception as e:
        raise DrafterLoadError(f"{where}: the config's sizes are invalid ({str(e).splitlines()[0][:120]})") from None
    missing, extra = sorted(expected.keys() - shapes.keys()), sorted(shapes.keys() - expected.keys())
    if missing or extra:
        raise DrafterLoadError(
            f"{where}: weights do not match the config (missing {missing[:3]}, unexpected {extra[:3]})")
    wrong = [k for k in expected if expected[k] != tuple(shapes[k])]
    if wrong:
        k = wrong[0]
        raise DrafterLoadError(f"{where}: weights do not match the config: {k} is {list(shapes[k])} in the "
                               f"weights, the config makes it {list(expected[k])} ({len(wrong)} tensor(s) disagree)")


def _build(cfg: DrafterConfig, state: dict, where: str, dtype: torch.dtype | None) -> DFlashDrafter:
    drafter = build_drafter(cfg)
    result = drafter.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        missing, extra = result.missing_keys[:3], result.unexpected_keys[:3]
        raise DrafterLoadError(f"{where}: weights do not match the config (missing {missing}, unexpected {extra})")
    dtype = dtype or next(iter(state.values())).dtype
    drafter.loaded_from = where  # the file or export a run directory resolved to: commands name it
    return drafter.to(dtype)


def find_checkpoint(directory: Path) -> Path | None:
    """The checkpoint to use in a run directory: ``latest.pt``, else the ``step-<n>.pt`` (the trainer's
    naming) or ``checkpoint-<n>.pt`` with the highest n, else the newest ``*.pt`` — searched in the
    directory itself, then in its ``checkpoints/``."""
    for d in (directory, directory / "checkpoints"):
        if not d.is_dir():
            continue
        if (d / "latest.pt").is_file():
            return d / "latest.pt"
        stepped = [(int(m.group(1)), p) for p in d.glob("*.pt")
                   if (m := re.fullmatch(r"(?:checkpoint|step)-(\d+)\.pt", p.name))]
        if stepped:
            return max(stepped)[1]
        any_pt = sorted(d.glob("*.pt"), key=lambda p: p.stat().st_mtime)
        if any_pt:
            return any_pt[-1]
    return None


def load_checkpoint_drafter(path: str | Path, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """The drafter inside a training checkpoint file."""
    from dflash.checkpoint_files import CheckpointError, safe_load

    path = Path(path)
    try:
        ckpt = safe_load(path)  # tensors and plain types only: a checkpoint never runs code
    except CheckpointError as e:
        raise DrafterLoadError(str(e)) from None
    return _drafter_from_checkpoint(ckpt, path, dtype)


def _newest_verified_drafter(run_dir: Path, dtype: torch.dtype | None) -> DFlashDrafter | None:
    """A trainer's run directory: the newest checkpoint that verifies against its manifest, as
    ``--resume`` picks it (skipped ones are named on stderr); None when there are none."""
    import sys

    from dflash.checkpoint_files import MANIFEST, CheckpointError, checkpoint_dir, load_latest

    if not (checkpoint_dir(run_dir) / MANIFEST).is_file():
        return None  # not written by the trainer (or by an older one): plain newest-file rules
    try:
        found = load_latest(run_dir, note=lambda s: print(f"dflash: {s}", file=sys.stderr))
    except CheckpointError as e:
        raise DrafterLoadError(str(e)) from None
    return None if found is None else _drafter_from_checkpoint(found[1], found[0], dtype)


def _drafter_from_checkpoint(ckpt: object, path: Path, dtype: torch.dtype | None) -> DFlashDrafter:
    if not isinstance(ckpt, dict) or "drafter_config" not in ckpt or "drafter" not in ckpt:
        raise DrafterLoadError(f"{path}: not a dflash checkpoint (no 'drafter_config'/'drafter' entries)")
    state = ckpt["drafter"]
    try:
        cfg = config_from_dict(ckpt["drafter_config"])
        shapes = {k: tuple(v.shape) for k, v in state.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise DrafterLoadError(f"{path}: not a dflash checkpoint ({type(e).__name__}: {e})") from None
    check_shapes(cfg, shapes, str(path))
    return _build(cfg, state, str(path), dtype)


def load_drafter(path: str | Path, dtype: torch.dtype | None = None) -> DFlashDrafter:
    """A drafter from any of: an export directory, a checkpoint file, or a run directory holding
    checkpoints (see ``find_checkpoint``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DrafterLoadError(f"drafter {str(path)!r}: no such file or directory")
    if p.is_file():
        return load_checkpoint_drafter(p, dtype)
    if (p / CONFIG_NAME).is_file() and (p / WEIGHTS_NAME).is_file():
        return load_exported(p, dtype)
    from dflash.model.speculators_format import speculators_dir

    saved = speculators_dir(p)  # a `speculators train` save path: its best (else last) epoch
    if saved is not None:
        return load_exported(saved, dtype)
    drafter = _newest_verified_drafter(p, dtype)
    if drafter is not None:
        return drafter
    ckpt = find_checkpoint(p)
    if ckpt is None:
        found = ", ".join(sorted(x.name for x in p.iterdir())[:8]) or "nothing"
        raise DrafterLoadError(
            f"drafter {str(path)!r}: neither an export ({CONFIG_NAME} + {WEIGHTS_NAME}) nor a directory with "
            f"*.pt checkpoints (found {found})"
        )
    return load_checkpoint_drafter(ckpt, dtype)


def checkpoint_dict(drafter: DFlashDrafter) -> dict:
    """The two entries a training checkpoint must hold for ``load_drafter`` to read it (the
    checkpointer writes them through this, so the two cannot drift apart)."""
    return {"drafter_config": {**asdict(drafter.config), "drafter_type": drafter.config.drafter_type},
            "drafter": drafter.state_dict()}
