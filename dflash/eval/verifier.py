"""The target's side of speculative decoding: verify a block in one forward, then keep only the accepted
part of it in the target's cache — for every kind of layer a target family has.

After a verify forward the cache holds the whole block; a round keeps only the anchor and the accepted
drafts. How the rest is taken back depends on the layer:

* full attention, MLA: drop the last keys/values (``crop``);
* sliding window: the window has already slid past positions a rollback needs again, so transformers
  must keep them until the crop (``activate_past_recording``, on for each verify forward); then ``crop``;
* linear attention (Gated DeltaNet: Qwen3.5, Qwen3-Next): the convolution state is recorded as above,
  but the recurrent state is one matrix per head that the block's forward overwrote with its state
  *after the whole block*. From transformers 5.25 a recording linear layer also keeps the state after
  each of the forward's last ``recurrent_states_to_keep`` tokens, and ``crop`` takes the one it needs;
  before 5.25 it keeps only the last, and the state cannot be cropped.

For the recurrent state four ways were measured (``scripts/bench_rollback.py``):

``record``     transformers' recording alone: right for attention and windows; for linear layers only
               where transformers keeps the intermediate recurrent states (refused before 5.25).
``mixers``     keep a copy of the recurrent states and catch each Gated DeltaNet mixer's input during the
               verify forward; after a partial acceptance the attention layers drop the rejected
               positions, each linear-attention layer goes back to the start of the block (convolution
               cropped, recurrent state copied back) and its mixer alone reads the kept positions'
               inputs again. By causality those inputs are what a forward of the kept tokens would give
               it, so the state is exact, and no MLP (MoE), attention layer or LM head runs twice.
``rerun``      the same copy, but the kept tokens run again through the whole model: one extra forward
               of at most a block, in rounds that did not accept everything. For linear-attention
               layers whose mixer is not transformers' ``linear_attn``.
``reprefill``  drop the cache and run the whole committed sequence again: a cost that grows with it.

A fifth, prepending the kept tokens to the next verify forward instead of an extra forward, was
rejected: when that round is partial too, the state after the prepended tokens exists only inside the
forward, so the tokens to replay pile up over every partial round (with a good drafter, nearly all).

The default is ``record`` where it is exact (every layer can crop: free for attention and windows; for
linear layers the verify forward walks its tokens one by one to keep their states), else ``mixers`` (the
least recomputed), else ``rerun`` (bounded by a block; reprefill's cost grows with the sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.targets.hf import cache_kwarg

ROLLBACKS = ("record", "mixers", "rerun", "reprefill")


def new_cache(model):
    """A cache shaped by the model's config: one layer kind per layer (window, linear, dummy...)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # transformers 4.x
        return DynamicCache()


def _recurrent_states(cache) -> list[tuple[int, dict, int]]:
    """(layer, state dict, index) of every recurrent state the cache holds: the part no crop can take back."""
    found = []
    for n, layer in enumerate(getattr(cache, "layers", [])):
        states = getattr(layer, "recurrent_states", None)
        if isinstance(states, dict):
            found += [(n, states, i) for i, s in states.items() if isinstance(s, torch.Tensor)]
    return found


def records_recurrent_states(cache) -> bool:
    """Whether this transformers keeps a recording linear layer's intermediate recurrent states (5.25+), so
    that ``crop`` restores them. A cache of an older release records only the convolution states."""
    return hasattr(cache, "get_recurrent_states_to_keep")


def _mixers(model, layers: set[int]) -> dict[int, torch.nn.Module] | None:
    """The linear-attention module of each layer in ``layers`` (transformers' Gated DeltaNet layers call
    it ``linear_attn``), or None when one is not found."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    found = {i: getattr(decoder.layers[i], "linear_attn", None) for i in layers}
    return found if all(m is not None for m in found.values()) else None


@dataclass
class Verified:
    """A verify forward's results for the block just sent: logits [n, vocab] and the hidden states tuple
    (index 0 = embeddings, i + 1 = layer i's output), each [1, n, hidden]."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None


class CachedVerifier:
    """Greedy verification against an in-process transformers target, one sequence at a time.

    ``prefill(prompt)``, then per round ``verify(block)`` and ``commit(n)``: keep the first ``n`` tokens
    of the block just verified (the anchor and the accepted drafts). ``forwards`` counts target forwards.
    """

    def __init__(self, target, rollback: str | None = None, hidden: bool = True) -> None:
        if rollback is not None and rollback not in ROLLBACKS:
            raise ValueError(f"unknown rollback {rollback!r} (choose from {', '.join(ROLLBACKS)})")
        self.target = target
        self.model = target.model
        self.hidden = hidden
        self._requested = rollback
        self.rollback: str | None = None  # decided at prefill, when the cache's layers exist
        self.cache = new_cache(self.model)
        self.ids: list[int] = []  # committed tokens, all in the cache
        self.forwards = 0
        self._block: torch.Tensor | None = None
        self._saved: list[torch.Tensor] = []
        self._mixer_inputs: dict[int, torch.Tensor] = {}

    def _forward(self, ids: torch.Tensor, start: int, keep: int | None, hidden: bool = True) -> Verified:
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        kwargs = {self.target.cache_kwarg: self.cache}
        if keep is not None:
            kwargs["logits_to_keep"] = keep
        hidden = hidden and self.hidden
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, output_hidden_states=hidden,
                         **kwargs)
        self.forwards += 1
        n = keep if keep is not None else ids.shape[1]
        hs = tuple(h[:, -n:] for h in out.hidden_states) if hidden else None
        return Verified(out.logits[0, -n:], hs)

    def _record(self, tokens: int) -> None:
        """Keep what windows and convolutions would drop until the next crop (transformers 5; a 4.x
        cache has no such layers and keeps everything anyway), and, where transformers can, the recurrent
        state after each of the next forward's ``tokens`` tokens: every position a crop may go back to.
        Asked before each verify forward, since only then is its length known (5.25's linear layers fail
        a forward while recording with no count); never for a prefill, whose window and convolution
        states would all be kept until the first crop."""
        if not hasattr(self.cache, "activate_past_recording"):
            return
        if records_recurrent_states(self.cache):
            self.cache.activate_past_recording(recurrent_states_to_keep=tokens)
        else:
            self.cache.activate_past_recording()

    def _crop(self, drop: int) -> None:
        """Drop the last ``drop`` positions. ``crop(0)`` still trims recorded windows back to their size
        in transformers 5; in 4.x it would empty the cache, so it is skipped there."""
        if drop or hasattr(self.cache, "activate_past_recording"):
            self.cache.crop(-drop)

    def _restore(self) -> None:
        for (_, states, i), saved in zip(_recurrent_states(self.cache), self._saved, strict=True):
            states[i].copy_(saved)

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> Verified:
        """Run the prompt; returns the last position's logits and the prompt's hidden states (all positions)."""
        ids = torch.tensor([prompt_ids], device=self.target.device)
        out = self._forward(ids, 0, None)
        self.ids = list(prompt_ids)
        linear = {n for n, _, _ in _recurrent_states(self.cache)}  # layers with a recurrent state
        exact = getattr(self.cache, "is_croppable", True) and (not linear or records_recurrent_states(self.cache))
        # mixers only for layers that hold nothing but the linear state: their crop back to the block's
        # start must not take attention keys/values with it
        is_linear = getattr(self.cache, "is_linear", None) or []
        pure = all(n < len(is_linear) and is_linear[n] for n in linear)
        self.mixers = _mixers(self.model, linear) if pure else None
        self.rollback = self._requested or ("record" if exact else "mixers" if self.mixers else "rerun")
        if self.rollback == "record" and not exact:
            raise ValueError("rollback 'record' cannot restore this target's recurrent (linear-attention) state "
                             "before transformers 5.25; use mixers, rerun or reprefill")
        if self.rollback == "mixers" and not self.mixers:
            raise ValueError("rollback 'mixers' needs Gated DeltaNet layers (linear_attn); use rerun or reprefill")
        return Verified(out.logits[-1:], out.hidden_states)

    @torch.inference_mode()
    def verify(self, block: torch.Tensor) -> Verified:
        """One forward over ``block`` (1-D: the anchor, then the drafts) after the committed tokens."""
        if self.rollback is None:
            raise RuntimeError("prefill before verify")
        self._record(block.shape[0])
        if self.rollback in ("mixers", "rerun"):
            self._saved = [states[i].clone() for _, states, i in _recurrent_states(self.cache)]
        hooks = []
        if self.rollback == "mixers":  # each mixer's input: what it must read again to advance its state
            hooks = [m.register_forward_pre_hook(
                lambda _m, args, kw, i=i: self._mixer_inputs.__setitem__(i, kw.get("hidden_states", args[0] if args
                                                                               else None)), with_kwargs=True)
                for i, m in self.mixers.items()]
        try:
            out = self._forward(block[None], len(self.ids), None)
        finally:
            for h in hooks:
                h.remove()
        self._block = block
        return out

    @torch.inference_mode()
    def commit(self, n: int) -> None:
        """Keep the first ``n`` (>= 1) tokens of the block just verified and forget the rest."""
        block, self._block = self._block, None
        if block is None or not 1 <= n <= block.shape[0]:
            raise ValueError(f"commit({n}) needs a verified block of at least {n} tokens")
        drop = block.shape[0] - n
        start = len(self.ids)
        self.ids += block[:n].tolist()
        if self.rollback == "record" or drop == 0:
            self._crop(drop)
        elif self.rollback == "rerun":
            self._crop(block.shape[0])  # back to the start of the block
            self._restore()
            self._forward(block[None, :n], start, 1, hidden=False)
            self._crop(0)
        elif self.rollback == "mixers":
            # Attention layers just drop the rejected positions; each linear-attention layer goes back to
            # the start of the block and its mixer alone reads the kept positions' inputs again (by
            # causality the same as in the verify forward), so no MLP, attention or head runs twice.
            for i, layer in enumerate(self.cache.layers):
                layer.crop(-(block.shape[0] if i in self.mixers else drop))
            self._restore()
            for i, mixer in self.mixers.items():
                mixer(hidden_states=self._mixer_inputs[i][:, :n], attention_mask=None,
                      **{cache_kwarg(mixer): self.cache})
            self._mixer_inputs = {}
            self._crop(0)
        else:  # reprefill
            self.cache = new_cache(self.model)
            self._forward(torch.tensor([self.ids], device=block.device), 0, 1, hidden=False)
