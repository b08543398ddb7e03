"""The in-process target: any local Hugging Face causal LM, frozen, run by the trainer's target workers.

Anything but ``tiny`` (tiny.py) must be a local directory that ``transformers`` can load with
``AutoModelForCausalLM`` (no downloads: dflash runs where there is no network, and a silent multi-GB
download is never what the user meant).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
import json
import threading
from pathlib import Path

import torch
from torch import nn

from dflash.model.drafter import default_target_layer_ids
from dflash.targets.base import Target, TargetError, TokenBatch, hidden_states_index

_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def _listing(path: Path, limit: int = 8) -> str:
    names = sorted(p.name for p in path.iterdir())
    more = f", ... ({len(names)} entries)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more if names else "an empty directory"


def model_dir(spec: str | Path) -> Path:
    """The model directory ``spec`` names, checked: it exists and holds a config.json."""
    path = Path(spec).expanduser()
    if not path.exists():
        raise TargetError(f"target {str(spec)!r}: no such file or directory (give a local model directory or 'tiny')")
    if not path.is_dir():
        raise TargetError(f"target {str(spec)!r}: is a file, not a model directory with config.json")
    if not (path / "config.json").is_file():
        raise TargetError(f"target {str(spec)!r}: no config.json (found {_listing(path)})")
    return path


# Kinds of layer transformers runs on a slow PyTorch fallback unless an optional kernel package is there:
# layer type -> (import name, distribution, dflash-trainer extra).
_KERNELS = {"linear_attention": ("fla", "flash-linear-attention", "linear-attention")}


def slow_kernel_note(config) -> str | None:
    """One line naming the extra to install when this target has layers transformers runs slowly
    without it (Gated DeltaNet without flash-linear-attention), else None."""
    kinds = set(getattr(config, "layer_types", None) or ())
    for kind, (module, package, extra) in _KERNELS.items():
        if kind in kinds and importlib.util.find_spec(module) is None:
            return (f"its {kind} layers run transformers' slow PyTorch fallback without {package} "
                    f"(CUDA: pip install 'dflash-trainer[{extra}]')")
    return None


def cache_kwarg(module: nn.Module) -> str:
    """The name ``module``'s forward takes the cache by: transformers 5 renamed ``past_key_values``
    (models) and ``cache_params`` (Gated DeltaNet mixers, through 5.17 at least) to ``cache``."""
    params = inspect.signature(module.forward).parameters
    return next((name for name in ("cache", "cache_params") if name in params), "past_key_values")


class HFTarget(Target):
    """A frozen transformers causal LM run in-process: it computes hidden states and, being the whole
    model, is its own verifier. Build with ``load_hf_target``."""

    def __init__(self, model: nn.Module, tokenizer, layer_ids: list[int], path: Path | None = None):
        super().__init__(tokenizer, model.config, layer_ids, model.get_input_embeddings(),
                         model.get_output_embeddings(), path, getattr(model, "generation_config", None))
        self.model = model
        # The decoder stack without the LM head: computing hidden states should not pay for logits.
        self._decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        # transformers 5 puts the *final-normed* states last in output_hidden_states; a tap is every
        # layer's own output, the last one included (its input to the final norm), in every family.
        self._decoder.config.tie_last_hidden_states = False
        self._untie_last_hidden_state()
        self._tapped = self._tap_hooks()
        self.cache_kwarg = cache_kwarg(model)
        self._causal_only = self._probe_causal_only()

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def verifier(self) -> HFTarget:
        return self

    def frozen_embedding(self, device: str | torch.device) -> nn.Module:
        """The model's own embedding module (Gemma's scales by sqrt(hidden) in its forward)."""
        embed = self.embed_tokens
        return embed if torch.device(device) == self.device else copy.deepcopy(embed).to(device)

    def describe(self) -> str:
        note = slow_kernel_note(self.config)
        return super().describe() + (f"; {note}" if note else "")

    def replica(self, device: str | torch.device) -> HFTarget:
        """Loaded again from its directory onto ``device`` (in that device's default dtype); a target
        built from a model in memory is copied."""
        device = torch.device(device)
        if device == self.device:
            return self
        if self.path is None:
            return HFTarget(copy.deepcopy(self.model).to(device), self.tokenizer, self.layer_ids)
        return load_hf_target(self.path, device, layer_ids=self.layer_ids)

    def taps(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Concatenate the tap layers from an ``output_hidden_states`` tuple (see base.hidden_states_index)."""
        return torch.cat([hidden_states[hidden_states_index(i)] for i in self.layer_ids], dim=-1)

    def hidden_states(self, batch: TokenBatch, final: bool = False) -> torch.Tensor:
        """Tap states for a right-padded batch (and, with ``final``, the final normed state: the head's
        input, from the same forward), computed without its attention mask.

        No mask: in a causal LM no real token of a right-padded row attends to padding, and nothing
        downstream reads the padded positions' states (every anchor and its context lie in the real
        tokens). A mask would also make transformers' mask helpers read it back to the host
        (`if mask.all()`), which blocks the calling thread until the GPU drains.
        """
        return self.tap_states(batch.input_ids.to(self.device, non_blocking=True), final=final)

    def final_norm(self, device: str | torch.device) -> nn.Module:
        """Nothing: the state ``hidden_states(final=True)`` appends is the decoder's output, normed."""
        return nn.Identity()

    @torch.no_grad()
    def tap_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   final: bool = False) -> torch.Tensor:
        """[B, T, len(layer_ids) * hidden] tap-layer hidden states for token ids (right-padded), and
        with ``final`` the decoder's normed output appended.

        Without ``attention_mask`` the forward reads nothing back from the device where the model allows
        it (see _probe_causal_only).
        """
        if attention_mask is None:
            mask = dict(self._causal_only) if self._causal_only is not None else None
        else:
            mask = attention_mask.to(self.device)
        ids = input_ids.to(self.device)
        if self._tapped is None:  # a decoder without a layer list: every layer's output, then the taps
            out = self._decoder(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
            taps = self.taps(out.hidden_states)
        else:
            self._tapped.states = {}
            try:
                out = self._decoder(input_ids=ids, attention_mask=mask, use_cache=False)
                taps = torch.cat([self._tapped.states[i] for i in self.layer_ids], dim=-1)
            finally:
                self._tapped.states = None
        return torch.cat([taps, out.last_hidden_state], dim=-1) if final else taps

    def _tap_hooks(self) -> threading.local | None:
        """Forward hooks that keep the tap layers' outputs of a ``tap_states`` forward, and nothing else.

        ``output_hidden_states`` would keep every layer's output until the forward ends (an 8B target at
        4,096 tokens: 37 states of 32 MiB per sample, where the taps are 5), on the GPU the drafter shares.
        A layer's output is what transformers records for it (index ``layer + 1``; the last layer's own
        output, not the normed one). Thread-local: one target serves several threads (target workers,
        evaluation), and only a ``tap_states`` forward keeps anything. None for a decoder without a
        ``layers`` list."""
        layers = getattr(self._decoder, "layers", None)
        if not isinstance(layers, nn.ModuleList) or not all(0 <= i < len(layers) for i in self.layer_ids):
            return None
        tapped = threading.local()

        def keep(layer: int, module: nn.Module, args: tuple, output) -> None:  # noqa: ANN001 - a layer's own type
            states = getattr(tapped, "states", None)
            if states is not None:
                states[layer] = output[0] if isinstance(output, tuple) else output

        for i in sorted(set(self.layer_ids)):
            layers[i].register_forward_hook(functools.partial(keep, i))
        return tapped

    @torch.no_grad()
    def _untie_last_hidden_state(self) -> None:
        """Where transformers ignores ``tie_last_hidden_states`` (5.17 does: the lent GPU machine's), put
        the last layer's own output (the final norm's input) back in place of the normed states, for
        every reader of ``output_hidden_states`` (taps, verifier, eval): the final norm's pre-hook keeps
        its input for this thread, the decoder's hook swaps it in. A 4-token forward at load tells."""
        norm = getattr(self._decoder, "norm", None)
        if not isinstance(norm, nn.Module):
            return
        kept = threading.local()  # (one target serves several threads: target workers, eval)

        def keep_input(module: nn.Module, args: tuple) -> None:
            kept.pre_norm = args[0] if args else None

        def put_back(module: nn.Module, args: tuple, output):  # noqa: ANN202 - the model's own output type
            pre_norm, kept.pre_norm = getattr(kept, "pre_norm", None), None
            states = getattr(output, "hidden_states", None)
            if pre_norm is not None and states:
                output["hidden_states"] = (*states[:-1], pre_norm)

        probe = norm.register_forward_pre_hook(keep_input)
        try:
            ids = torch.arange(4, device=self.device)[None] % self.vocab_size
            states = self._decoder(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        finally:
            probe.remove()
        pre_norm = getattr(kept, "pre_norm", None)
        if pre_norm is None or torch.equal(states[-1], pre_norm):
            return  # honoured (or no final norm seen): nothing to put back
        norm.register_forward_pre_hook(keep_input)
        self._decoder.register_forward_hook(put_back)

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


def load_hf_target(
    spec: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    layer_ids: list[int] | None = None,
    num_draft_layers: int = 5,
) -> HFTarget:
    """Load a frozen target (eval mode, no grads): bf16 on CUDA and fp32 on CPU unless ``dtype`` says.

    ``layer_ids`` are the tap layers; by default the reference's rule with one tap per drafter layer
    (``default_target_layer_ids(num_layers, num_draft_layers)``).
    """
    path = model_dir(spec)
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise TargetError(f"target {str(spec)!r}: unreadable config.json ({_one_line(e)})") from e
    if not any(any(path.glob(p)) for p in _WEIGHT_PATTERNS):
        raise TargetError(f"target {str(spec)!r}: config.json but no weights (*.safetensors or *.bin; "
                          f"found {_listing(path)})")

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
    return HFTarget(model, tokenizer, ids, path)
