"""`dflash data cache`: run the target over a data set once and write its hidden states in the engines'
offline layout (dflash/data/cache_format.py), so training can read them instead of running the target.

The target's forward runs on the calling thread and the disk writes on a writer thread behind a bounded
queue, each timed like a training stage (``target_forward`` on ``target-0``, ``cache_write`` on
``writer-0``) so `dflash-top` shows which of the two the cache is waiting on. A rerun skips the files
already there; under torchrun each rank writes its own contiguous share of the rows.

The files hold the target's dtype, or another (``dtype``): bf16/fp32 as cast, FP8 quantised per token
on the target's device before the copy to the host (half the bytes of bf16 cross it), with the FP8
backend's arithmetic (``quantize_fp8``).
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash.data.cache_format import (
    FP8,
    HIDDEN_DIR,
    CacheError,
    CacheMeta,
    cache_bytes,
    config_digest,
    dtype_name,
    is_ready,
    quantize_fp8,
    sample_path,
    tokenizer_digest,
    write_sample,
)
from dflash.data.formats import Sample
from dflash.telemetry.wire.sockets import pid_alive
from dflash.telemetry.wire.table import clock
from dflash.words import plural


def rank_share(rows: int, max_samples: int | None, world_size: int, rank: int) -> range:
    """The rows rank ``rank`` writes: the first ``max_samples`` rows split into contiguous chunks that
    differ by at most one row (the first ``n % world`` ranks take one more), as speculators splits them,
    so caches written by either tool with the same world size hold the same files on the same rank."""
    n = rows if max_samples is None else min(rows, max_samples)
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def meta_for(target: Any, spec: str, rows: int, dtype: torch.dtype | None = None) -> CacheMeta:
    """The sidecar describing what ``target`` writes, in ``dtype`` (default: the target's)."""
    return CacheMeta(target=spec, num_hidden_layers=target.num_layers, hidden_size=target.hidden_size,
                     config_sha256=config_digest(target), tokenizer_sha256=tokenizer_digest(target.tokenizer),
                     target_layer_ids=list(target.layer_ids), dtype=dtype_name(dtype or target.dtype), rows=rows)


@torch.no_grad()
def engine_states(target: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T, len(layer_ids) + 1, H]``: the tap layers' outputs as the target computes them for
    training, then the last decoder layer's output *before* the final norm, which is what vLLM's final
    layer id holds (caught with a hook on that layer during the same forward)."""
    model = target.model
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    caught: list[torch.Tensor] = []

    def catch(_module, _args, out):
        caught.append(out[0] if isinstance(out, tuple) else out)

    handle = decoder.layers[-1].register_forward_hook(catch)
    try:
        taps = target.tap_states(input_ids)
    finally:
        handle.remove()
    b, t, _ = taps.shape
    return torch.cat([taps.view(b, t, len(target.layer_ids), -1), caught[-1][:, :, None]], dim=2)


@dataclass
class CacheReport:
    written: int
    skipped: int
    bytes: int
    seconds: float


class _Progress:
    """One line every few seconds: how many files, the rate, the bytes and the time left."""

    def __init__(self, total: int, log: Callable[[str], None], every: float):
        self.total, self.log, self.every = total, log, every
        self.done = self.bytes = 0
        self.t0 = self.last = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.done += 1
        self.bytes += nbytes
        now = time.monotonic()
        if now - self.last >= self.every or self.done == self.total:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            self.log(f"cache: {self.done}/{self.total} written ({100 * self.done / max(self.total, 1):.0f}%), "
                     f"{rate:.1f} samples/s, {self.bytes / 1e9:.2f} GB, ETA {clock(eta)}")


def _drop_stale_temporaries(hidden_dir: Path, log: Callable[[str], None]) -> None:
    """Temporaries a killed writer left (``.hs_{i}.safetensors.<pid>.tmp`` of a process that is gone):
    they are never renamed into place, only take disk. A live writer's (another rank's) stay."""
    if not hidden_dir.is_dir():
        return
    dropped = 0
    for p in hidden_dir.glob(".hs_*.tmp"):
        try:
            pid = int(p.name.rsplit(".", 2)[-2])
        except ValueError:
            continue
        if not pid_alive(pid):
            p.unlink(missing_ok=True)
            dropped += 1
    if dropped:
        log(f"cache: removed {plural(dropped, 'temporary file')} a stopped writer left")


def check_disk(out: Path, need: int, how: str, log: Callable[[str], None]) -> None:
    """Print what the files will take (``how``: the arithmetic) and refuse when the disk has less free
    space than that."""
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    log(f"cache: {how} = {need / 1e9:.2f} GB to write, {free / 1e9:.2f} GB free on {probe}")
    if need > free:
        raise CacheError(f"--out {out}: the cache needs {need / 1e9:.2f} GB but {probe} has {free / 1e9:.2f} GB "
                         "free; free space, choose another --out, or lower --max-samples")


def write_cache(target: Any, samples: list[Sample], out: Path, share: range, stats: Any,
                batch_size: int = 8, log: Callable[[str], None] = print, every: float = 5.0,
                dtype: torch.dtype | None = None, per_tap_scales: bool = False) -> CacheReport:
    """Write ``hs_i`` for every row ``i`` in ``share`` that is not on disk yet, in ``dtype`` (default:
    the target's; ``float8_e4m3fn``: FP8 with per-token scales, or per token and tap with
    ``per_tap_scales``). ``stats``: the ProfileStats the two workers report to. The rows and the sidecar
    are the caller's (rank 0's)."""
    dtype = dtype or target.dtype
    _drop_stale_temporaries(out / HIDDEN_DIR, log)
    todo = [i for i in share if not is_ready(sample_path(out, i))]
    skipped = len(share) - len(todo)
    if skipped:
        log(f"cache: {plural(skipped, 'file')} of this share already written, skipped")
    slots = len(target.layer_ids) + 1
    lens = [len(samples[i].input_ids) for i in todo]
    need = cache_bytes(lens, slots, target.hidden_size, dtype, per_tap_scales)
    scale_note = (f" + a 4-byte scale per token{' and layer' if per_tap_scales else ''}" if dtype == FP8 else "")
    check_disk(out, need, f"{plural(len(todo), 'sample')}, {sum(lens):,} tokens x {slots} layers x "
               f"{target.hidden_size} x {dtype.itemsize} bytes ({dtype_name(dtype)}){scale_note}", log)
    progress = _Progress(len(todo), log, every)
    tw, ww = stats.worker("target-0"), stats.worker("writer-0")
    handoff: queue.Queue = queue.Queue(maxsize=2)
    failed: list[BaseException] = []

    def writer() -> None:
        try:
            while (item := _get(handoff, ww)) is not None:
                i, hidden, ids, scales = item
                with ww.span("cache_write"):
                    nbytes = write_sample(sample_path(out, i), hidden, ids, scales)
                progress.add(nbytes)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            failed.append(e)
            while True:  # keep draining so the producer never blocks on a dead writer
                if handoff.get() is None:
                    return

    thread = threading.Thread(target=writer, name="writer-0", daemon=True)
    thread.start()
    t0 = time.monotonic()
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    try:
        for k in range(0, len(todo), batch_size):
            rows = todo[k:k + batch_size]
            with tw.span("target_forward"):
                width = max(len(samples[i].input_ids) for i in rows)
                ids = torch.full((len(rows), width), pad, dtype=torch.long)
                for r, i in enumerate(rows):
                    ids[r, :len(samples[i].input_ids)] = torch.tensor(samples[i].input_ids)
                # Right-padded, no mask: causal attention keeps padding out of every real token's states.
                states = engine_states(target, ids.to(target.device))
                if dtype == FP8:
                    states, scales = (t.cpu() for t in quantize_fp8(states, per_tap_scales))
                else:
                    states, scales = states.to(dtype).cpu(), None
            for r, i in enumerate(rows):
                n = len(samples[i].input_ids)
                with tw.span("hs_queue_put"):
                    handoff.put((i, states[r, :n].clone(), ids[r, :n].clone(),
                                 scales[r, :n].clone() if scales is not None else None))
            if failed:
                break
    finally:
        handoff.put(None)
        thread.join()
    if failed:
        raise failed[0]
    return CacheReport(len(todo), skipped, progress.bytes, time.monotonic() - t0)


def _get(q: queue.Queue, worker: Any) -> Any:
    with worker.span("hs_queue_wait"):
        return q.get()
