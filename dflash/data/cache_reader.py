"""Reading an offline hidden-states cache for training: what it holds checked against the target once at
the start, then sample files read ahead on a small thread pool into page-locked buffers.

``open_cache`` decides which slots of each file are the drafter's taps. With dflash's sidecar it knows
(and refuses another tokenizer, another target, taps the cache lacks); without one (vLLM / speculators
wrote the cache) it accepts the cache when the shapes of its first file that reads agree with the target
and the taps, and says in one line what it assumed. Every file is checked as it is read (shape, its token
ids against the row, finite states, the cache's dtype): a bad file raises one line naming it, which the
cache target counts as a bad sample (dflash/targets/cache.py).

FP8 files (float8_e4m3fn with per-token scales, from `dflash data cache --dtype fp8` or speculators' FP8
backend) are dequantised here, on the reader threads, into the dtype training uses (a page-locked
buffer on CUDA): the stage that assembles batches and the drafter see plain states and pay nothing.

``follow``: files may not exist yet (an engine or `dflash data cache` is still writing); a read waits
until the file is complete (``is_ready``: renamed into place, or its writer's lock released), and the
time it waits is the reader's ``cache_wait``, which the verdict reports as waiting for hidden states.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.data.cache_format import (
    AUX_ID_OFFSET,
    FP8,
    HIDDEN_DIR,
    REWRITE,
    SIDECAR,
    CacheError,
    CacheMeta,
    MixedCache,
    check_finite,
    config_digest,
    dequantize_fp8,
    dtype_name,
    is_ready,
    read_rows,
    read_stored,
    rows_ready,
    sample_path,
    tokenizer_digest,
)
from dflash.data.formats import Sample

#: how long a following reader sleeps between looks at a file not yet written (grows to the maximum)
FOLLOW_POLL = (0.01, 0.5)
#: files a cache without sidecar is opened by at most: the first that reads gives the shapes; the ones
#: before it are bad samples, skipped when training reaches them, but a cache none of whose first files
#: read is not a cache to start on (the cache target's "more bad than good" rule, at the start)
PROBE_FILES = 16


@dataclass
class CacheLayout:
    """What ``open_cache`` settled: the rows, which file slots are the taps, and what was assumed."""

    root: Path
    rows: list[Sample]
    layer_ids: list[int]  # the taps, the reference's convention
    slots: list[int]  # where each tap sits in a file's layer dimension
    file_slots: int  # layers per token in a file (taps + final, or more)
    hidden_size: int
    dtype: torch.dtype  # what every file holds (float8_e4m3fn: an FP8 cache, with per-token scales)
    meta: CacheMeta | None
    #: what the shapes and dtype were read from: the sidecar, or the first sample file that reads
    shapes_from: str = SIDECAR
    assumed: str | None = None  # the one line said about a cache without sidecar


def _wait(cond: Callable[[], bool], stop: threading.Event | None) -> None:
    delay = FOLLOW_POLL[0]
    while not cond():
        if stop is not None and stop.wait(delay):
            raise CacheError("stopped while waiting for hidden states")
        if stop is None:
            time.sleep(delay)
        delay = min(delay * 2, FOLLOW_POLL[1])


def open_cache(root: Path, target_info: Any, layer_ids: list[int] | None, default_layer_ids: list[int],
               follow: bool = False, stop: threading.Event | None = None) -> CacheLayout:
    """Check the cache at ``root`` against the target (``target_info``: its tokenizer, config,
    num_layers, hidden_size) and pick the tap slots: ``layer_ids`` as the user gave them, else the
    sidecar's, else ``default_layer_ids`` (the target's rule), which a sidecar-less cache must match."""
    root = Path(root)
    where = f"--hidden-states {root}"
    if follow:
        _wait(lambda: rows_ready(root), stop)
    rows = read_rows(root)
    if not follow:
        _check_complete(root, len(rows), where)
    meta = CacheMeta.read(root)
    if meta is not None:
        return _with_sidecar(root, rows, meta, target_info, layer_ids, where)
    # vLLM / speculators wrote it: a file tells the shapes
    first, hs, unread = _first_readable(root, len(rows), follow, stop, where)
    seq, file_slots, hidden = hs.shape
    if hidden != target_info.hidden_size:
        raise CacheError(f"{where}: {first.name} has hidden size {hidden}, --target has "
                         f"{target_info.hidden_size}: give the --target the cache was written with")
    taps = list(layer_ids) if layer_ids is not None else list(default_layer_ids)
    aux = file_slots - 1
    if aux != len(taps):
        raise CacheError(
            f"{where}: {first.name} holds {file_slots} layers per token ({aux} aux + final) but the drafter "
            f"taps {len(taps)} ({taps}); pass --target-layer-ids with the {aux} layers the engine was given, "
            f"each minus {AUX_ID_OFFSET} (its aux_hidden_state_layer_ids)")
    assumed = (f"{where}: no {SIDECAR} (an engine wrote this cache): assuming its {aux} aux slots are taps "
               f"{taps} (engine ids {[i + AUX_ID_OFFSET for i in taps]}), the last slot the final layer, "
               f"{_dtype_words(hs.dtype)}, the tokenizer of --target")
    if unread:
        assumed += (f" (shapes from {first.name}: the {len(unread)} before it do not read, and training skips "
                    "them as bad samples)")
    return CacheLayout(root, rows, taps, list(range(aux)), file_slots, hidden, hs.dtype, None, first.name, assumed)


def _first_readable(root: Path, rows: int, follow: bool, stop: threading.Event | None, where: str
                    ) -> tuple[Path, torch.Tensor, list[str]]:
    """The first of the first PROBE_FILES sample files that reads, its states, and why each before it did not."""
    unread: list[str] = []
    for row in range(min(rows, PROBE_FILES)):
        path = sample_path(root, row)
        if follow:
            _wait(lambda p=path: is_ready(p), stop)
        try:
            hs, _, _ = read_stored(path)
        except (CacheError, OSError) as e:
            unread.append(str(e))
            continue
        return path, hs, unread
    if not unread:
        raise CacheError(f"{where}: the data set has no rows")
    raise CacheError(f"{where}: none of its first {len(unread)} sample files reads, so the cache's shapes are unknown "
                     f"(the first: {unread[0]})")


def _dtype_words(dtype: torch.dtype) -> str:
    return f"{dtype_name(dtype)} with per-token scales (FP8)" if dtype == FP8 else dtype_name(dtype)


def _check_complete(root: Path, rows: int, where: str) -> None:
    """Every row has its file (one directory listing): a cache cut short is refused before training,
    not at the first missing file hours in."""
    names = {p.name for p in (root / HIDDEN_DIR).iterdir()} if (root / HIDDEN_DIR).is_dir() else set()
    missing = [i for i in range(rows) if f"hs_{i}.safetensors" not in names]
    if missing:
        raise CacheError(f"{where}: {len(missing)} of {rows} rows have no file (the first: hs_{missing[0]}."
                         "safetensors); finish it with `dflash data cache` (same --out), or train with --follow "
                         "while it is written")


def _with_sidecar(root: Path, rows: list[Sample], meta: CacheMeta, target: Any, layer_ids: list[int] | None,
                  where: str) -> CacheLayout:
    if target.tokenizer is not None and meta.tokenizer_sha256 != tokenizer_digest(target.tokenizer):
        raise CacheError(f"{where}: written with another tokenizer than --target's (the cache's target was "
                         f"{meta.target!r}); give that --target, or rewrite the cache with this one")
    if (meta.num_hidden_layers, meta.hidden_size) != (target.num_layers, target.hidden_size):
        raise CacheError(f"{where}: written for a target with {meta.num_hidden_layers} layers and hidden size "
                         f"{meta.hidden_size} ({meta.target!r}), --target has {target.num_layers} and "
                         f"{target.hidden_size}")
    if meta.config_sha256 != config_digest(target):
        raise CacheError(f"{where}: written for another target config ({meta.target!r}); give that --target, "
                         "or rewrite the cache with this one")
    if meta.rows != len(rows):
        raise CacheError(f"{where}: the sidecar counts {meta.rows} rows, the data set has {len(rows)}; "
                         "the cache is incomplete or mixed, rewrite it")
    taps = list(layer_ids) if layer_ids is not None else list(meta.target_layer_ids)
    missing = [i for i in taps if i not in meta.target_layer_ids]
    if missing:
        raise CacheError(f"{where}: taps {missing} are not in the cache (it holds layers "
                         f"{meta.target_layer_ids}); drop --target-layer-ids or rewrite the cache with them")
    slots = [meta.target_layer_ids.index(i) for i in taps]
    return CacheLayout(root, rows, taps, slots, meta.slots, meta.hidden_size, getattr(torch, meta.dtype), meta)


class CacheReader:
    """Sample files read on ``threads`` threads ahead of use, each into a page-locked buffer when
    ``pin`` (a CUDA run), checked, and an FP8 file dequantised into ``dtype`` (the dtype training uses).
    ``schedule(rows)`` starts reads, ``take(row)`` returns one (waiting for it). Rows are the data set's
    (= file) indices."""

    def __init__(self, layout: CacheLayout, threads: int = 2, pin: bool = False, follow: bool = False,
                 on_wait: Callable[[float], None] | None = None, dtype: torch.dtype = torch.float32):
        self.layout, self.pin, self.follow, self.on_wait, self.dtype = layout, pin, follow, on_wait, dtype
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="cache-read")
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: rows whose file a read is waiting for (``follow``): what the producer has not written yet
        self.waiting: set[int] = set()

    def schedule(self, rows: list[int]) -> None:
        with self._lock:
            for r in rows:
                if r not in self._pending:
                    self._pending[r] = self._pool.submit(self._read, r)

    @property
    def queued(self) -> set[int]:
        """Rows whose read has started (or finished) and that nobody has taken yet."""
        with self._lock:
            return set(self._pending)

    def take(self, row: int) -> torch.Tensor:
        """Row ``row``'s states, ``[seq, file_slots, H]``, as the file holds them (dequantised if FP8;
        ``layout.slots`` says which are the taps: cutting them here would copy out of the page-locked buffer)."""
        self.schedule([row])
        with self._lock:
            future = self._pending.pop(row)
        return future.result()

    def wait_for(self, row: int) -> None:
        """Block until row ``row``'s file is complete (a followed cache)."""
        path = sample_path(self.layout.root, row)
        if not is_ready(path):
            _wait(lambda: is_ready(path), self._stop)

    def _read(self, row: int) -> torch.Tensor:
        lay = self.layout
        path = sample_path(lay.root, row)
        if self.follow and not is_ready(path):
            t0 = time.perf_counter()
            self.waiting.add(row)
            try:
                _wait(lambda: is_ready(path), self._stop)
            finally:
                self.waiting.discard(row)
            if self.on_wait is not None:
                self.on_wait(time.perf_counter() - t0)
        hs, ids, scales = read_stored(path, pin=self.pin)
        expect = lay.rows[row].input_ids
        if hs.shape[1] != lay.file_slots or hs.shape[2] != lay.hidden_size:
            raise CacheError(f"{path}: hidden_states {list(hs.shape)}, the cache's others are "
                             f"[seq, {lay.file_slots}, {lay.hidden_size}]; {REWRITE}")
        if hs.dtype != lay.dtype:
            raise MixedCache(f"{path}: {_dtype_words(hs.dtype)}, but the cache is {_dtype_words(lay.dtype)} "
                             f"(its {lay.shapes_from}): a mixed cache; rewrite it in one dtype (`dflash data cache "
                             "--dtype`)")
        if ids.tolist() != expect:
            raise CacheError(f"{path}: its token_ids differ from row {row} of the data set "
                             f"({len(ids)} vs {len(expect)} tokens): it belongs to other data; {REWRITE}")
        if scales is not None:
            hs = dequantize_fp8(hs, scales, self.dtype, self.pin)
        check_finite(hs, path)
        return hs

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
