"""What every producer of hidden states is to the trainer: the interface the pipeline's first stage drives.

A drafter needs four things from its target: the tokenizer (to read the data), hidden states at the tap
layers, the frozen embedding and LM head (applied exactly as the target applies them), and, for
evaluation and `dflash data regenerate`, a model that can decode. Where the hidden states come from
differs: a transformers model run in-process (hf.py), the built-in tiny model (tiny.py), or a cache an
engine wrote to disk. Everything downstream sees only this interface.

Tap layers follow the reference's convention: layer id ``i`` is the *output* of decoder layer ``i``,
which is ``output_hidden_states[i + 1]`` (index 0 there is the embedding output). Producers that index
differently (speculators' ``aux_hidden_state_layer_ids`` are these ids + 1) convert at their edge with
``hidden_states_index``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from dflash.model.drafter import mask_token_embedding_ok
from dflash.targets.heads import capped
from dflash.words import plural

#: the reference's tap-layer convention, in words (for sidecars and error lines)
LAYER_ID_CONVENTION = "layer i = output_hidden_states[i + 1]"


def hidden_states_index(layer_id: int) -> int:
    """Where tap layer ``layer_id`` sits in a transformers ``output_hidden_states`` tuple."""
    return layer_id + 1


class TargetError(ValueError):
    """The target is missing or unusable; the message is one line saying what to change."""


class TokenBatch(Protocol):
    """What a target is given to produce hidden states for: right-padded token ids with their mask, and
    which samples of the data set the rows are (a cache looks states up by sample, not by tokens)."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T], 1 = real token
    sample_ids: list[int]  # the data set's index of each row


class Target(ABC):
    """A frozen producer of tap-layer hidden states and the parts of the target model a drafter uses.

    Subclasses provide ``hidden_states``, ``device`` and ``replica``, and, if they can decode, a
    ``verifier`` (and ``frozen_embedding`` where the target transforms its embeddings); the rest (sizes,
    dtype, mask token, stop tokens, a soft-capped head) follows from the tokenizer, the
    config and the embedding they hand to ``__init__``.
    """

    #: the span category the pipeline's first stage records this target's work under
    span_category: ClassVar[str] = "target_forward"
    #: whether ``hidden_states`` may have to wait for its inputs to appear (a cache still being written):
    #: the stage then times ``wait_ready`` apart, as ``cache_wait``, so the verdict can name the producer
    waits_for_inputs: ClassVar[bool] = False
    #: whether ``hidden_states`` runs the target's forward here (a transformers model) rather than reading
    #: states an engine computed (a cache): only then do its FLOPs count in the step's (train/device/flops.py)
    computes: ClassVar[bool] = True

    def __init__(self, tokenizer: Any, config: Any, layer_ids: list[int], embed_tokens: nn.Embedding,
                 lm_head: nn.Linear, path: Path | None = None, generation_config: Any = None):
        self.tokenizer = tokenizer
        self.config = config  # the target's transformers config (what the drafter's shape is read from)
        self.path = path
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.generation_config = generation_config
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad or not layer_ids:
            raise TargetError(f"target {str(path)!r}: tap layers {list(layer_ids)} invalid for "
                              f"{self.num_layers} layers (ids count from 0: {LAYER_ID_CONVENTION})")
        self.layer_ids = list(layer_ids)

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where ``hidden_states`` computes (or lands) its output."""

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.weight.shape[0])

    @property
    def verifier(self) -> Any:
        """A target that can run the whole model (speculative decoding, regeneration), or None when
        this one only supplies hidden states (a cache). An in-process target is its own verifier."""
        return None

    @abstractmethod
    def replica(self, device: str | torch.device) -> Target:
        """This target on ``device`` (self when it is already there): one per target worker's device."""

    @abstractmethod
    def hidden_states(self, batch: TokenBatch, final: bool = False) -> torch.Tensor:
        """[B, T, len(layer_ids) * hidden_size] tap-layer states for ``batch``, on ``self.device``; with
        ``final``, the target's final state appended ([B, T, (taps + 1) * hidden]: what ``final_norm``
        and the LM head turn into the target's own logits, for an objective that compares with them).
        A target that cannot raises TargetError."""

    def final_norm(self, device: str | torch.device) -> nn.Module:
        """What turns the final state ``hidden_states(batch, final=True)`` appends into the LM head's
        input (the target's final norm, or nothing where the state is normed already), on ``device``."""
        raise TargetError(f"target {str(self.path)!r} cannot supply its final hidden states (--loss kl needs them)")

    def own_samples(self, max_len: int, min_loss_tokens: int) -> list[Any] | None:
        """The training samples, for a target that comes with its data (a cache holds states for its own
        rows only); None: read ``--data`` with the tokenizer."""
        return None

    def read_ahead(self, rows_of: Any) -> None:  # noqa: B027 - optional: most targets compute, not read
        """Told the batch order (``rows_of(batch_index)`` -> sample positions) by whoever builds the batch
        source; a target that reads from disk starts early, one that computes ignores it."""

    def skipped_rows(self, batch: TokenBatch) -> list[int]:
        """Rows of ``batch`` whose states this target could not supply (a cache's sample files that do not
        read): ``hidden_states`` leaves them zeros, and the pipeline's stage masks them out of training."""
        return []

    def on_bad_sample(self, report: Any) -> None:  # noqa: B027 - optional: only a target that reads skips
        """Told whom to tell, in one line each, about the samples it skips (``report(line)``)."""

    def wait_ready(self, batch: TokenBatch) -> None:  # noqa: B027 - optional, see waits_for_inputs
        """Block until ``batch``'s inputs exist (only called when ``waits_for_inputs``)."""

    def close(self) -> None:  # noqa: B027 - optional: only a target with threads or files has work here
        """Release what the target holds (a cache's reading threads) at the end of a run."""

    def frozen_head(self, device: str | torch.device) -> tuple[nn.Module, nn.Module]:
        """The embedding and the LM head as frozen modules on ``device``, applying them as the target
        does: ``embed(ids)`` is what the target's first layer reads, ``head(h)`` its logits (soft-capped
        where the config says: heads.py). A target that transforms its embeddings says how in
        ``frozen_embedding``.

        Kept in the target's own dtype (bf16 on GPUs) rather than float32: under autocast a float32
        frozen weight is cast to bf16 again at every call (it is not a leaf that autocast caches), so
        each LM-head chunk of every step would copy the 152K-row head. On the target's device the
        weights are shared, not copied: nothing ever writes to them.
        """
        head = nn.Linear(self.hidden_size, self.vocab_size, bias=False, device="meta")
        head.weight = nn.Parameter(self.lm_head.weight.detach().to(device), requires_grad=False)
        return self.frozen_embedding(device), capped(head, self.config)

    def frozen_embedding(self, device: str | torch.device) -> nn.Module:
        """The embedding part of ``frozen_head``: a plain lookup unless the target transforms it."""
        return nn.Embedding.from_pretrained(self.embed_tokens.weight.detach().to(device), freeze=True)

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
        for src in (self.tokenizer, self.generation_config, self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        return sorted(ids)

    def describe(self) -> str:
        """One line about the target for the start of a run."""
        return f"{plural(self.num_layers, 'layer')}, hidden {self.hidden_size}, taps {self.layer_ids}"
