"""The offline hidden-states cache as a target: `dflash train --hidden-states DIR` reads the states an
engine (vLLM, speculators) or `dflash data cache` wrote instead of running the target.

What still comes from ``--target`` is what the drafter applies itself: the tokenizer, the config, and the
frozen embedding and LM head. Only those two tensors are read from its safetensors files (a 120B target
is never loaded to train from its cache). The states are read ahead, a few batches in advance, on the
reader's own threads (dflash/data/cache_reader.py) into page-locked buffers when CUDA is in use; this
stage's time is ``cache_read``, and, when ``--follow`` waits for files not yet written, ``cache_wait``.

A sample file that does not read (truncated, a garbled header, another shape than the cache's, token ids
of another row, NaN/inf) is a bad sample, not the end of a run hours in: its row is skipped (zeros here,
masked out of the batch by the stage: ``skipped_rows``), said once in one line, counted, and the run
stops only past ``--max-bad-samples`` of them (BadSamples). What is wrong with the cache as a whole (another
target, tokenizer or hidden size, missing taps, rows without files) is found when it is opened and stops
the run before it starts.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash.data.cache_format import REWRITE, CacheError, MixedCache, rows_ready, sample_path
from dflash.data.cache_reader import CacheLayout, CacheReader, open_cache
from dflash.data.formats import Sample
from dflash.targets.base import Target, TargetError, TokenBatch
from dflash.targets.heads import ScaledEmbedding

#: batches whose files are read ahead of the one being assembled
READ_AHEAD = 4
#: files tried before "more bad than good" says the cache itself is broken (a batch or two of them: a few bad
#: files that happen to share the first batch are not the cache's fault)
SHARE_AFTER = 16


class BadSamples:
    """The cache's sample files that did not read, each counted once (a row met again in a later epoch is
    skipped without reading it again) and told in one line to ``report`` (the run's warning event and
    counter). Past ``limit`` of them the run stops; it stops too when they outnumber the files that read
    well (once SHARE_AFTER were tried): then the cache itself is wrong or broken (a failed copy, another
    target's files), and skipping would train on a few leftovers."""

    def __init__(self, root: Path, limit: int):
        self.root, self.limit = root, limit
        self.lines: dict[int, str] = {}  # data-set row -> why its file was skipped
        self.good = 0  # files read well
        self.report: Callable[[str], None] = lambda line: None
        self._lock = threading.Lock()  # target workers share one cache

    def __contains__(self, row: int) -> bool:
        return row in self.lines

    def __len__(self) -> int:
        return len(self.lines)

    def read_well(self) -> None:
        with self._lock:
            self.good += 1

    def found(self, row: int, why: str) -> None:
        """Row ``row``'s file did not read (``why``: one line naming the file): skip it, or stop the run with
        a CacheError once there are more than ``limit``."""
        with self._lock:
            if row in self.lines:  # two workers read the same row
                return
            self.lines[row] = why
            n = len(self.lines)
        if n > self.limit:
            if self.limit == 0:
                raise CacheError(f"{why}; or let --max-bad-samples N skip up to N such files")
            raise CacheError(f"--hidden-states {self.root}: {n} bad sample files, more than --max-bad-samples "
                             f"{self.limit}; the latest: {why}")
        self.report(f"bad sample skipped ({n} of at most {self.limit}, --max-bad-samples): {why}")

    def check_share(self) -> None:
        """Stop when the bad files outnumber the good ones read so far (called after a batch that found one)."""
        with self._lock:
            bad, good, latest = len(self.lines), self.good, next(reversed(self.lines.values()), "")
        if bad > good and bad + good >= SHARE_AFTER:
            raise CacheError(f"--hidden-states {self.root}: {bad} of the {bad + good} sample files read so far do "
                             f"not read (the latest: {latest}): the cache as a whole is broken or not the one "
                             "written for --target; check it, or write it again with `dflash data cache`")


class CacheTarget(Target):
    """Tap-layer states read from a cache; no verifier (evaluation needs --eval-target)."""

    span_category = "cache_read"
    computes = False

    def __init__(self, layout: CacheLayout, tokenizer: Any, config: Any, embed_tokens: nn.Embedding,
                 lm_head: nn.Linear, path: Path | None, reader: CacheReader, max_bad: int = 0):
        super().__init__(tokenizer, config, layout.layer_ids, embed_tokens, lm_head, path=path)
        self.layout, self.reader = layout, reader
        self.bad = BadSamples(layout.root, max_bad)
        self._closed = False  # a read the closing reader stops is no bad sample
        # the data set's row of each training sample (rows too short to train on are left out)
        self.file_rows: list[int] = list(range(len(layout.rows)))
        self._rows_of: Callable[[int], list[int]] | None = None
        self._scheduled = -1
        self.waits_for_inputs = reader.follow

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")  # the states land in host memory; the pipeline copies them onward

    def training_samples(self, min_loss_tokens: int, max_len: int) -> list[Sample]:
        """The cache's rows as training samples (cut to ``max_len``; rows with fewer than
        ``min_loss_tokens`` trainable tokens left out), remembering which file each one reads."""
        kept, self.file_rows = [], []
        for i, s in enumerate(self.layout.rows):
            s = Sample(s.input_ids[:max_len], s.loss_mask[:max_len])
            if sum(s.loss_mask) >= min_loss_tokens:
                kept.append(s)
                self.file_rows.append(i)
        if not kept:
            raise CacheError(f"--hidden-states {self.layout.root}: no row has {min_loss_tokens} trainable tokens")
        return kept

    def read_ahead(self, rows_of: Callable[[int], list[int]]) -> None:
        """Give the batch order (batch index -> sample positions) so files are read before they are needed."""
        self._rows_of = rows_of

    def replica(self, device: str | torch.device) -> CacheTarget:
        return self  # one reader in host memory serves every target worker

    def frozen_embedding(self, device: str | torch.device) -> nn.Module:
        """From the config alone (the target's modules are not loaded): Gemma's embedding is scaled by
        sqrt(hidden) in its forward."""
        embed = super().frozen_embedding(device)
        if str(getattr(self.config, "model_type", "")).startswith("gemma"):
            return ScaledEmbedding(embed, self.hidden_size ** 0.5)
        return embed

    def own_samples(self, max_len: int, min_loss_tokens: int) -> list[Sample]:
        return self.training_samples(min_loss_tokens, max_len)

    def on_bad_sample(self, report: Callable[[str], None]) -> None:
        self.bad.report = report

    def skipped_rows(self, batch: TokenBatch) -> list[int]:
        return [r for r, p in enumerate(batch.sample_ids) if self.file_rows[p] in self.bad]

    def wait_ready(self, batch: TokenBatch) -> None:
        for p in batch.sample_ids:
            self.reader.wait_for(self.file_rows[p])

    @property
    def final_slot(self) -> int | None:
        """Where a file holds the final (pre-norm) layer: its last slot, unless dflash's sidecar says the
        cache was written without it."""
        lay = self.layout
        if lay.meta is not None and not lay.meta.final_layer:
            return None
        return lay.file_slots - 1

    def hidden_states(self, batch: TokenBatch, final: bool = False) -> torch.Tensor:
        slots = list(self.layout.slots)
        if final:
            if self.final_slot is None:
                raise TargetError(f"--hidden-states {self.layout.root}: the cache holds no final layer, which "
                                  "--loss kl needs (write it again with `dflash data cache`, or use --loss ce)")
            slots.append(self.final_slot)
        index = getattr(batch, "index", None)
        if self._rows_of is not None and index is not None:
            for ahead in range(max(index, self._scheduled + 1), index + READ_AHEAD + 1):
                self.reader.schedule([row for p in self._rows_of(ahead) if (row := self.file_rows[p]) not in self.bad])
            self._scheduled = index + READ_AHEAD
        rows = [self.file_rows[p] for p in batch.sample_ids]
        b, t = batch.input_ids.shape
        h = self.hidden_size
        out = torch.zeros((b, t, len(slots) * h), dtype=self.dtype, pin_memory=self.reader.pin)
        bad_before = len(self.bad)
        for r, row in enumerate(rows):
            states = self._take(row)
            if states is None:  # a bad sample: its row stays zeros, and the stage masks it out (skipped_rows)
                continue
            n = min(t, states.shape[0])
            for k, s in enumerate(slots):  # slot by slot: no temporary copy of the page-locked buffer
                out[r, :n, k * h:(k + 1) * h].copy_(states[:n, s])
        if len(self.bad) > bad_before:
            self.bad.check_share()
        return out

    def _take(self, row: int) -> torch.Tensor | None:
        """Row ``row``'s states, or None when its file does not read (counted in ``self.bad``, which stops the
        run past its limit). A file found bad is not read again; a read scheduled just before it was found
        is left unclaimed (one at most per bad file)."""
        if row in self.bad:
            return None
        try:
            states = self.reader.take(row)
        except MixedCache:
            raise  # the cache as a whole, not this file: skipping would train on part of it
        except (CacheError, OSError) as e:
            if self._closed:  # the run is ending: the reader stopped waiting for this file
                raise
            why = str(e) if isinstance(e, CacheError) else \
                f"{sample_path(self.layout.root, row)}: {e.strerror or e}; {REWRITE}"
            self.bad.found(row, why)
            return None
        self.bad.read_well()
        return states

    def final_norm(self, device: str | torch.device) -> nn.Module:
        """The target's final norm (the cache's final slot is taken before it, as the engines write it),
        read alone from its safetensors files; the module is transformers' own for the family."""
        if self.path is None:
            return super().final_norm(device)
        return _final_norm(self.path, self.config, self.dtype, torch.device(device))

    def close(self) -> None:
        self._closed = True
        self.reader.close()


def _weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file of ``path`` holding it."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TargetError(f"target {str(path)!r}: no *.safetensors files (the cache reads the embedding and "
                          "LM head from them)")
    weight_map = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            weight_map.update({k: f.name for k in st.keys()})  # noqa: SIM118 - safe_open has no __iter__
    return weight_map


def _load(path: Path, weight_map: dict[str, str], name: str, dtype: torch.dtype) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path / weight_map[name]), "pt") as st:
        return st.get_tensor(name).to(dtype)


def _final_norm(path: Path, config: Any, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The decoder's final norm of the model at ``path``: the module built on the meta device from the
    config (no weights allocated), then its own tensors read from the files by their names."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    norm = getattr(decoder, "norm", None)
    if norm is None:
        raise TargetError(f"target {str(path)!r}: {type(decoder).__name__} has no final norm (`norm`) to apply to "
                          "the cache's final layer")
    prefix = next(n for n, m in model.named_modules() if m is norm)
    weight_map = _weight_map(path)
    state = {}
    for name, p in norm.named_parameters():
        full = f"{prefix}.{name}"
        # a checkpoint saved from the bare decoder has no `model.` in front
        found = full if full in weight_map else next((k for k in sorted(weight_map, key=len)
                                                      if k.endswith(f"{prefix.split('.')[-1]}.{name}")
                                                      and "layers." not in k), None)
        if found is None:
            raise TargetError(f"target {str(path)!r}: no {full!r} tensor (the final norm) in its safetensors files")
        state[name] = _load(path, weight_map, found, p.dtype if p.dtype.is_floating_point else dtype)
    norm = norm.to_empty(device=device)
    norm.load_state_dict(state, strict=False)
    return norm.to(dtype).requires_grad_(False)


def _head_tensors(path: Path, config: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The input embedding and LM head weights, read alone from the target's safetensors files."""
    weight_map = _weight_map(path)

    def pick(suffix: str) -> str | None:
        names = sorted((k for k in weight_map if k.endswith(suffix)), key=len)
        return names[0] if names else None

    embed_name = pick("embed_tokens.weight")
    head_name = pick("lm_head.weight")
    if embed_name is None:
        raise TargetError(f"target {str(path)!r}: no '*embed_tokens.weight' tensor in its safetensors files")
    if head_name is None and not getattr(config, "tie_word_embeddings", False):
        raise TargetError(f"target {str(path)!r}: no 'lm_head.weight' tensor and the embeddings are not tied")
    embed = _load(path, weight_map, embed_name, dtype)
    return embed, (_load(path, weight_map, head_name, dtype) if head_name is not None else embed)


def load_cache_target(root: Path, spec: str, layer_ids: list[int] | None, num_draft_layers: int | None,
                      device: torch.device, follow: bool = False, threads: int = 2,
                      log: Callable[[str], None] = print, max_bad_samples: int = 0) -> CacheTarget:
    """The cache at ``root`` checked against target ``spec`` (its tokenizer, config, embedding, head);
    ``max_bad_samples``: sample files that do not read skipped before a read raises (BadSamples; a run
    passes its --max-bad-samples, 0 here: the first bad file raises)."""
    from transformers import AutoConfig, AutoTokenizer

    from dflash.model.drafter import default_target_layer_ids
    from dflash.targets.hf import model_dir
    from dflash.targets.tiny import tiny_target_dir

    path = tiny_target_dir() if spec == "tiny" else model_dir(spec)
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        config = getattr(config, "text_config", None) or config
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types; the user needs the one line
        raise TargetError(
            f"target {spec!r}: config or tokenizer does not load ({str(e).splitlines()[0][:200]})"
        ) from None
    n_layers = int(config.num_hidden_layers)
    info = _Info(tokenizer, config, n_layers, int(config.hidden_size), path)
    defaults = default_target_layer_ids(n_layers, num_draft_layers or 5)
    if follow and not rows_ready(root):
        log(f"--follow: waiting for the data set in {root} (its state.json)")
    try:
        layout = open_cache(root, info, layer_ids, defaults, follow=follow)
    except CacheError as e:
        raise TargetError(str(e)) from None
    if layout.assumed:
        log(layout.assumed)
    cuda = device.type == "cuda"
    # bf16 beside a CUDA drafter (the engines' dtype), fp32 on the CPU, as an in-process target would be
    dtype = torch.bfloat16 if cuda else torch.float32
    embed_w, head_w = _head_tensors(path, config, dtype)
    embed = nn.Embedding.from_pretrained(embed_w, freeze=True)
    head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(head_w, requires_grad=False)
    # FP8 files are dequantised by the reader threads straight into the dtype the batches are built in
    reader = CacheReader(layout, threads=threads, pin=cuda, follow=follow, dtype=dtype)
    return CacheTarget(layout, tokenizer, config, embed, head, path, reader, max_bad=max_bad_samples)


class _Info:
    """What open_cache compares a cache with, before the target object exists."""

    def __init__(self, tokenizer: Any, config: Any, num_layers: int, hidden_size: int, path: Path):
        self.tokenizer, self.config, self.num_layers, self.hidden_size = tokenizer, config, num_layers, hidden_size
        self.path = path


