"""The frozen target: any local Hugging Face causal LM, plus the three things a DFlash drafter needs
from it — hidden states at the tap layers, the input embedding and the LM head.

``load_target("tiny")`` is the built-in default (dflash/model/tiny.py); anything else must be a local
directory that ``transformers`` can load with ``AutoModelForCausalLM`` (no downloads: dflash runs where
there is no network, and a silent multi-GB download is never what the user meant).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
from torch import nn

from dflash.model.drafter import default_target_layer_ids, mask_token_embedding_ok

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TargetError(ValueError):
    """The target path is missing or is not a loadable causal LM; the message is one line."""


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def _listing(path: Path, limit: int = 8) -> str:
    names = sorted(p.name for p in path.iterdir())
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "an empty directory"


def resolve_target_path(spec: str | Path) -> Path:
    """``"tiny"`` -> the built-in target's directory; otherwise the path itself, checked."""
    if str(spec) == "tiny":
        try:
            from dflash.model.tiny import tiny_target_dir

            return tiny_target_dir()
        except ImportError as e:
            raise TargetError(f"target 'tiny': the built-in tiny target is unavailable ({_one_line(e)})") from e
        except FileNotFoundError as e:
            raise TargetError(f"target 'tiny': {e}") from None
    path = Path(spec).expanduser()
    if not path.exists():
        raise TargetError(f"target {str(spec)!r}: no such file or directory (give a local model directory or 'tiny')")
    if not path.is_dir():
        raise TargetError(f"target {str(spec)!r}: is a file, not a model directory with config.json")
    if not (path / "config.json").is_file():
        raise TargetError(f"target {str(spec)!r}: no config.json (found {_listing(path)})")
    return path


class Target:
    """A frozen causal LM and the pieces of it a drafter uses. Build with ``load_target``."""

    def __init__(self, model: nn.Module, tokenizer, layer_ids: list[int], path: Path | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.path = path
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad or not layer_ids:
            raise TargetError(f"target {str(path)!r}: tap layers {layer_ids} invalid for {self.num_layers} layers")
        self.layer_ids = list(layer_ids)
        self.embed_tokens: nn.Embedding = model.get_input_embeddings()
        self.lm_head: nn.Linear = model.get_output_embeddings()
        # The decoder stack without the LM head: computing hidden states should not pay for logits.
        self._decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        # transformers 5 renamed the cache argument `past_key_values` -> `cache`.
        params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._causal_only = self._probe_causal_only()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.weight.shape[0])

    def frozen_head(self, device: str | torch.device) -> tuple[nn.Embedding, nn.Linear]:
        """The embedding and LM head as frozen modules on ``device``, in the target's own dtype.

        Kept in that dtype (bf16 on GPUs) rather than float32: under autocast a float32 frozen weight is
        cast to bf16 again at every call (it is not a leaf that autocast caches), so each LM-head chunk
        of every step would copy the 152K-row head. On the target's device the weights are shared, not
        copied: nothing ever writes to them.
        """
        embed = nn.Embedding.from_pretrained(self.embed_tokens.weight.detach().to(device), freeze=True)
        head = nn.Linear(self.hidden_size, self.vocab_size, bias=False, device="meta")
        head.weight = nn.Parameter(self.lm_head.weight.detach().to(device), requires_grad=False)
        return embed, head

    def taps(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Concatenate the tap layers from a ``hidden_states`` tuple (index 0 = embeddings, so layer i
        is ``hidden_states[i + 1]``, the reference's convention)."""
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, len(layer_ids) * hidden] tap-layer hidden states for a (right-padded) batch.

        Without ``attention_mask`` (what training passes: see TargetStage) the forward reads nothing back
        from the device where the model allows it (see _causal_only_masks).
        """
        if attention_mask is None:
            mask = dict(self._causal_only) if self._causal_only is not None else None
        else:
            mask = attention_mask.to(self.device)
        out = self._decoder(input_ids=input_ids.to(self.device), attention_mask=mask, output_hidden_states=True,
                            use_cache=False)
        return self.taps(out.hidden_states)

    @torch.no_grad()
    def _probe_causal_only(self) -> dict[str, None] | None:
        """Prepared masks that say "plain causal", if this model takes them and computes the same states.

        Given no mask, transformers still checks the position ids for packed sequences with a tensor
        read (`if (...).all()`), which blocks the calling thread until the GPU has drained. A mapping of
        already-prepared masks (what `generate` passes) skips mask preparation, and None in it makes SDPA
        and flash attention run causally. Whether a model accepts the mapping, and whether it has
        sliding-window or non-causal layers that None would not express, differs between models and
        transformers versions; so this runs a 4-token forward both ways at load time and uses the mapping
        only when the states agree.
        """
        ids = torch.arange(4, device=self.device)[None] % self.vocab_size
        causal_only = {"full_attention": None}
        try:
            plain = self._decoder(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            fast = self._decoder(input_ids=ids, attention_mask=dict(causal_only), output_hidden_states=True,
                                 use_cache=False).hidden_states
        except Exception:  # noqa: BLE001 - a model that rejects the mapping simply keeps the plain path
            return None
        same = len(plain) == len(fast) and all(torch.equal(a, b) for a, b in zip(plain, fast, strict=True))
        return causal_only if same else None

    def default_mask_token_id(self) -> int:
        """The token id whose embedding fills the masked block slots.

        In order: the tokenizer's own mask token (the tiny target has ``<|mask|>``); an added token
        named like a mask; the first embedding row past the tokenizer's vocabulary (the reference's
        choice for Qwen3: id 151669 = len(tokenizer), a padding row of the 151936-row embedding that no
        text ever produces); a ``reserved``-named special token (Llama 3); the pad token if distinct from
        EOS; else the last row. Candidates whose embedding row is zero are skipped (see
        drafter.mask_token_embedding_ok). Any fixed id works in principle: the drafter learns what it
        means; a row no real token uses just avoids ambiguity.
        """
        weight = self.embed_tokens.weight
        rows = weight.shape[0]
        tok = self.tokenizer
        candidates: list[int | None] = []
        if tok is not None:
            candidates.append(getattr(tok, "mask_token_id", None))
            added = {}
            try:
                added = {t.content if hasattr(t, "content") else str(t): i
                         for i, t in tok.added_tokens_decoder.items()}
            except AttributeError:
                pass
            candidates += [i for name, i in sorted(added.items(), key=lambda x: x[1]) if "mask" in name.lower()]
            candidates += list(range(len(tok), min(rows, len(tok) + 16)))
            candidates += [i for name, i in sorted(added.items(), key=lambda x: x[1]) if "reserved" in name.lower()]
            pad, eos = getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)
            if pad is not None and pad != eos:
                candidates.append(pad)
        candidates += list(range(rows - 1, max(-1, rows - 17), -1))
        for c in candidates:
            if c is not None and 0 <= c < rows and mask_token_embedding_ok(weight, c):
                return int(c)
        return rows - 1

    def stop_token_ids(self) -> list[int]:
        """EOS ids from the tokenizer and the generation/model config (greedy decoding stops there)."""
        ids: set[int] = set()
        for src in (self.tokenizer, getattr(self.model, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        return sorted(ids)


def load_target(
    spec: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    layer_ids: list[int] | None = None,
    num_draft_layers: int = 5,
) -> Target:
    """Load a frozen target (eval mode, no grads): bf16 on CUDA and fp32 on CPU unless ``dtype`` says.

    ``layer_ids`` are the tap layers; by default the reference's rule with one tap per drafter layer
    (``default_target_layer_ids(num_layers, num_draft_layers)``).
    """
    path = resolve_target_path(spec)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise TargetError(f"target {str(spec)!r}: unreadable config.json ({_one_line(e)})") from e
    if not any(any(path.glob(p)) for p in _WEIGHT_PATTERNS):
        raise TargetError(f"target {str(spec)!r}: config.json but no weights (*.safetensors or *.bin; found {_listing(path)})")

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **{dtype_kw: dtype})
    except Exception as e:  # transformers raises many types; the user needs the one line
        kind = cfg.get("model_type", "?")
        raise TargetError(
            f"target {str(spec)!r}: model_type {kind!r} did not load as a causal LM ({_one_line(e)})"
        ) from e
    if getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise TargetError(f"target {str(spec)!r}: {type(model).__name__} has no LM head")
    model.to(device).eval().requires_grad_(False)

    tokenizer = None
    if any((path / f).exists() for f in _TOKENIZER_FILES):
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:
            raise TargetError(f"target {str(spec)!r}: tokenizer files present but unloadable ({_one_line(e)})") from e

    n = int(model.config.num_hidden_layers)
    ids = list(layer_ids) if layer_ids is not None else default_target_layer_ids(n, num_draft_layers)
    return Target(model, tokenizer, ids, path)
