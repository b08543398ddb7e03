"""ProfileStats: per-worker, per-category timing that is cheap enough to leave on.

Design (why it is shaped like this):

* The hot path is a worker handle bound once per thread. `add` appends a `(category, seconds)`
  tuple to the handle's plain list and checks its length: no lock, no dict update. A list append is
  atomic under the GIL (and under the per-object lock of free-threaded builds).
* `drain()` takes what is there with `n = len(buf); items = buf[:n]; del buf[:n]`. Each of those is
  one C-level list operation; appends that land between them go past index n and survive the `del`,
  so no sample is lost or counted twice, and the list object never changes under a worker that
  holds a reference to it (a swap of the attribute would race with a worker that had already loaded
  the old list).
* Memory stays bounded when nobody drains: once a buffer holds `fold_at` samples the worker folds it
  into exact running n/total/max plus a fixed-size reservoir (for percentiles) under the lock.
* CUDA spans record start/end events and queue them; `drain()` resolves them with `event.query()`
  and never synchronizes (the worker never waits on the GPU for telemetry).
* Open spans are visible to `drain()` without any extra work on the hot path: a host span's start
  already sits on its reused span object's stack (the worker's `_spans`), and a CUDA span puts itself
  on the worker's `_open_cuda` list for its duration (an append and a remove). `drain()` reads them to
  publish what each worker is doing now and to book a span that crosses windows in each window for the
  time it spent there (so a worker inside one 10 s call reads 100% busy in every window, not 0% nine
  times and 1000% once).
* A step's totals (`Worker.step()`): a category timed in several spans within one step of a worker
  (the drafter's pass, then its LM head chunk by chunk) is recorded as one sample per step, its spans'
  sum, so n counts steps and p50/p95/max describe steps. Until the step ends its spans' time is
  *held* on the worker, and a drain books the time held so far in its window (as it books an open
  span), so the window shares stay where the time was spent.
"""

from __future__ import annotations

import math
import random
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflash.telemetry.reservoir import RESERVOIR, Reservoir
from dflash.telemetry.summary import MetricValue, Summary, untracked_of
from dflash.telemetry.wire.protocol import CategoryStats, OpenSpan
from dflash.telemetry.wire.vocab import Role

_perf = time.perf_counter

#: raw samples a worker buffers before folding them itself (only reached when nobody drains often)
FOLD_AT = 16384
#: reservoir behind cumulative percentiles (p95 rank error ~0.7%; re-sorted at most every 5% of growth)
CUM_RESERVOIR = 1024
#: unresolved CUDA span pairs kept per worker before the oldest are dropped
CUDA_BACKLOG = 4096


def _take(buf: list) -> list:
    """Remove and return the items present now, leaving any appended concurrently (see module doc)."""
    n = len(buf)
    if not n:
        return []
    items = buf[:n]
    del buf[:n]
    return items


def _group(items: list[tuple[str, float]]) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    get = groups.get
    for cat, dt in items:
        lst = get(cat)
        if lst is None:
            groups[cat] = [dt]
        else:
            lst.append(dt)
    return groups


def _finite(values: list[float]) -> tuple[list[float], int]:
    """Drop NaN/inf samples (they would poison totals and cannot travel as JSON); cheap when clean."""
    if math.isfinite(sum(values)):
        return values, 0
    kept = [v for v in values if math.isfinite(v)]
    return kept, len(values) - len(kept)


def _cuda_torch() -> Any:
    """torch, if CUDA is initialised in this process; otherwise None (CUDA spans fall back to host
    timing). torch is only looked up in sys.modules: if nobody imported it, CUDA cannot be in use,
    and importing it here would cost seconds and break the torch-free promise."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch.cuda.is_initialized() else None
    except Exception:
        return None


class _Span:
    """Host-timed span, reused: one per (worker, category), so `with w.span(c)` allocates nothing.

    Start times live on a small stack, which makes nesting the same category work, and keeps the
    category's total exact even if two threads share one handle (pairing of starts and ends may
    then cross threads, but the sum of end - start does not depend on the pairing).
    """

    __slots__ = ("_w", "_cat", "_t0")

    def __init__(self, w: Worker, cat: str) -> None:
        self._w = w
        self._cat = cat
        self._t0: list[float] = []

    def __enter__(self) -> _Span:
        self._t0.append(_perf())
        return self

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        dt = _perf() - self._t0.pop()
        # Worker.add, inlined here and in _CudaSpan: one more Python call would cost every span
        w = self._w
        held = w._held
        if held is not None:
            held[self._cat] = held.get(self._cat, 0.0) + dt
            return
        buf = w._buf
        buf.append((self._cat, dt))
        if len(buf) >= w._fold_at:
            w._stats._fold(w)


class _CudaSpan:
    """Host time always; device time from a pair of CUDA events when CUDA is in use.

    Host time of a CUDA span is the CPU side (kernel launches, allocator work); device time is what
    the stream spent between the two events, resolved later by the publisher.
    """

    __slots__ = ("_w", "_cat", "_stream", "_t0", "_ev")

    def __init__(self, w: Worker, cat: str, stream: Any) -> None:
        self._w = w
        self._cat = cat
        self._stream = stream
        self._ev: tuple[Any, Any] | None = None

    def __enter__(self) -> _CudaSpan:
        torch = _cuda_torch()
        # Timing events cannot be recorded while a CUDA graph is being captured; host time only then.
        if torch is not None and not torch.cuda.is_current_stream_capturing():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            # Event.record(None) records on the current stream of the current device.
            start.record(self._stream)
            self._ev = (start, end)
        self._t0 = _perf()
        self._w._open_cuda.append(self)
        return self

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        dt = _perf() - self._t0
        w = self._w
        w._open_cuda.remove(self)
        pair = self._ev
        held = w._held
        if pair is not None:
            pair[1].record(self._stream)
            if held is None:
                w._cuda.append((self._cat, (pair,)))
            else:
                w._held_cuda.setdefault(self._cat, []).append(pair)
            self._ev = None
        if held is not None:
            held[self._cat] = held.get(self._cat, 0.0) + dt
            return
        buf = w._buf
        buf.append((self._cat, dt))
        if len(buf) >= w._fold_at:
            w._stats._fold(w)


class _Step:
    """A worker's step (`Worker.step()`): its spans' times are summed per category and recorded as one
    sample each when it ends (device time likewise, from all the step's event pairs of the category)."""

    __slots__ = ("_w",)

    def __init__(self, w: Worker) -> None:
        self._w = w

    def __enter__(self) -> _Step:
        w = self._w
        if w._held is not None:
            raise RuntimeError(f"worker {w.name!r}: steps do not nest")
        w._held_cuda = {}
        w._held_start = _perf()
        w._held = {}  # last: a span ending from here on is held
        return self

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        w = self._w
        held, cuda = w._held, w._held_cuda
        # First, so that a drain from here on sees no held time: what it has booked of this step it then
        # carries to the samples below, whichever window they land in (the order of an ended span).
        w._held = None
        for cat, pairs in cuda.items():
            w._cuda.append((cat, tuple(pairs)))
        buf = w._buf
        buf.extend((held or {}).items())
        if len(buf) >= w._fold_at:
            w._stats._fold(w)


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> _NullSpan:
        return self

    def __exit__(self, et: object, ev: object, tb: object) -> None:
        return None


_NULL_SPAN = _NullSpan()


class Worker:
    """A named worker's fast-path handle. Get it once per thread with `ProfileStats.worker(name)`.

    Several threads may share one handle (appends are atomic), but per-thread names give per-thread
    shares, which is what the bottleneck analysis reads.
    """

    __slots__ = ("name", "_buf", "_cuda", "_stats", "_fold_at", "created", "_spans", "_open_cuda", "_held",
                 "_held_cuda", "_held_start", "_step")

    def __init__(self, name: str, stats: ProfileStats, fold_at: int) -> None:
        self.name = name
        self._buf: list[tuple[str, float]] = []
        # (category, its event pairs): one pair per span, all of a category's pairs for a step
        self._cuda: list[tuple[str, tuple[tuple[Any, Any], ...]]] = []
        self._stats = stats
        self._fold_at = fold_at
        self.created = _perf()
        self._spans: dict[str, _Span] = {}
        self._open_cuda: list[_CudaSpan] = []
        # within a step: category -> seconds of its ended spans, and their CUDA event pairs (None: no step)
        self._held: dict[str, float] | None = None
        self._held_cuda: dict[str, list[tuple[Any, Any]]] = {}
        self._held_start = 0.0
        self._step = _Step(self)

    def held(self) -> tuple[float, dict[str, float]] | None:
        """(start, category -> seconds) of the step under way: the time its ended spans hold until it ends;
        None between steps. Safe from any thread (a dict copy is one atomic operation)."""
        held = self._held
        return None if held is None else (self._held_start, dict(held))

    def step(self) -> _Step:
        """One step: `with w.step(): ...` records each category timed inside it once, as the sum of its
        spans there (steps do not nest)."""
        return self._step

    def open_spans(self) -> list[tuple[str, float]]:
        """(category, perf_counter start) of every span open now, oldest first. Safe from any thread:
        each read is one atomic list operation, and a span that ends meanwhile is simply not listed."""
        out = []
        for sp in list(self._spans.values()):
            t0 = sp._t0[:1]  # empty once the span has ended
            if t0:
                out.append((sp._cat, t0[0]))
        out.extend((sp._cat, sp._t0) for sp in list(self._open_cuda))
        out.sort(key=lambda o: o[1])
        return out

    def add(self, category: str, seconds: float) -> None:
        """Record `seconds` spent in `category` (the one call every timing site makes)."""
        buf = self._buf
        buf.append((category, seconds))
        if len(buf) >= self._fold_at:
            self._stats._fold(self)

    def span(self, category: str) -> _Span:
        """Time a block on the host clock: `with w.span("pack_hidden"): ...`."""
        sp = self._spans.get(category)
        if sp is None:
            sp = self._spans[category] = _Span(self, category)
        return sp

    def cuda_span(self, category: str, stream: Any = None) -> _CudaSpan:
        """Time a block on the host and, when CUDA is in use, on `stream` (default: current stream)."""
        return _CudaSpan(self, category, stream)


class _NullWorker:
    """What a disabled ProfileStats hands out: every method does nothing."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def add(self, category: str, seconds: float) -> None:
        pass

    def span(self, category: str) -> _NullSpan:
        return _NULL_SPAN

    def cuda_span(self, category: str, stream: Any = None) -> _NullSpan:
        return _NULL_SPAN

    def step(self) -> _NullSpan:
        return _NULL_SPAN


@dataclass
class _Window:
    """What one drain took from the workers: their raw samples, open spans and parked CUDA events, and
    the run's counters, gauges and metrics at that instant; `dropped` grows as the drain discards
    non-finite or unresolvable samples."""

    workers: list[Worker]
    raw: dict[str, list]
    opened: dict[str, list[tuple[str, float]]]
    held: dict[str, tuple[float, dict[str, float]] | None]
    pending: dict[str, dict[str, Reservoir]]
    unresolved: dict[str, list]
    counters: dict[str, float]
    gauges: dict[str, float]
    metrics: dict[str, MetricValue]
    dropped: int
    start: float
    seconds: float


class ProfileStats:
    """Thread-safe per-worker/per-category timing, counters, gauges and metrics.

    `enabled=False` turns every method into a no-op (profiling off), so call sites
    never need an `if profiling:` guard. `drain()` returns a Summary of the window since the previous
    drain and keeps cumulative stats inside.
    """

    def __init__(self, enabled: bool = True, *, fold_at: int = FOLD_AT, reservoir: int = RESERVOIR) -> None:
        self.enabled = enabled
        self._fold_at = max(1, fold_at)
        self._reservoir = reservoir
        # _lock guards the worker registry, folded-but-undrained state and counters;
        # _drain_lock serialises drains (cumulative state is touched only while holding it).
        self._lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._workers: dict[str, Worker] = {}
        self._roles: dict[str, Role] = {}
        self._devices: dict[str, int] = {}
        self._pending: dict[str, dict[str, Reservoir]] = {}
        self._unresolved: dict[str, list[tuple[str, tuple[tuple[Any, Any], ...]]]] = {}
        self._device_counts: list[tuple[str, tuple[tuple[Any, Any], ...]]] = []  # see count_device
        self._dropped = 0
        self._cum: dict[str, dict[str, Reservoir]] = {}
        self._cum_dev: dict[str, dict[str, Reservoir]] = {}
        self._counters: dict[str, float] = {}
        self._last_counters: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        self._metrics: dict[str, MetricValue] = {}
        # one generator per side: folds run on worker threads while a drain may be running
        self._rng = random.Random(0x5EED)
        self._fold_rng = random.Random(0xF01D)
        self._window_start = _perf()
        # open spans seen at the previous drain: (worker, category, start) -> seconds booked so far
        self._booked: dict[tuple[str, str, float, bool], float] = {}
        # (worker, category) -> booked seconds of spans that have ended but whose sample has not been
        # drained yet: taken off the window share of the sample when it arrives, so no time counts twice
        self._carry: dict[tuple[str, str], float] = {}
        # worker -> perf_counter time of the drain that last saw it complete a span (or its creation)
        self._last_done: dict[str, float] = {}

    # --- recording ------------------------------------------------------------------------------------

    def worker(self, name: str, role: Role | None = None, device: int | None = None) -> Worker | _NullWorker:
        """The handle for `name` (the same object for the same name). A pipeline worker names its
        `role` the first time: the verdict groups workers by it, never by their names; and, when it
        computes on a GPU, that GPU's CUDA ordinal (`device`), so the verdict can read the GPU its
        kernels run on (launch-bound)."""
        if not self.enabled:
            return _NullWorker(name)
        if role is not None:
            self._roles[name] = Role(role)
        if device is not None:
            self._devices[name] = int(device)
        w = self._workers.get(name)
        if w is None:
            with self._lock:
                w = self._workers.get(name)
                if w is None:
                    w = self._workers[name] = Worker(name, self, self._fold_at)
        return w

    def _current(self) -> Worker:
        return self.worker(threading.current_thread().name)  # type: ignore[return-value]

    def add(self, category: str, seconds: float) -> None:
        """`add` attributed to the calling thread's name (slower than a bound handle)."""
        if self.enabled:
            self._current().add(category, seconds)

    def span(self, category: str) -> _Span | _NullSpan:
        """`span` attributed to the calling thread's name."""
        if not self.enabled:
            return _NULL_SPAN
        return self._current().span(category)

    def cuda_span(self, category: str, stream: Any = None) -> _CudaSpan | _NullSpan:
        """`cuda_span` attributed to the calling thread's name."""
        if not self.enabled:
            return _NULL_SPAN
        return _CudaSpan(self._current(), category, stream)

    def count(self, name: str, n: float = 1) -> None:
        """Add to a monotonically increasing counter (tokens, samples, steps); rates come per window."""
        if self.enabled:
            with self._lock:
                self._counters[name] = self._counters.get(name, 0) + n

    def count_device(self, name: str, start: Any, end: Any) -> None:
        """Add the device time between two recorded CUDA events to counter ``name`` once both have
        completed (``drain`` resolves them with query(), never waiting): for work whose host side returns
        before the device has done it, such as an NCCL all-reduce."""
        if self.enabled:
            with self._lock:
                self._device_counts.append((name, ((start, end),)))
                over = len(self._device_counts) - CUDA_BACKLOG
                if over > 0:
                    del self._device_counts[:over]
                    self._dropped += over

    def _resolve_device_counts(self) -> None:
        """Fold completed count_device pairs into their counters; keep the rest for the next drain."""
        with self._lock:
            pairs, self._device_counts = self._device_counts, []
        if not pairs:
            return
        done, still, bad = self._resolve_cuda({"": pairs})
        with self._lock:
            for name, secs in done.get("", {}).items():
                self._counters[name] = self._counters.get(name, 0) + sum(secs)
            self._device_counts[:0] = still.get("", [])
            self._dropped += bad

    def gauge(self, name: str, value: float) -> None:
        """Set a last-value gauge (loss, lr, queue depth).

        Pass a Python number: float() of a CUDA tensor synchronises the calling worker.
        """
        if self.enabled:
            self._gauges[name] = float(value)

    def metric(self, name: str, value: float | Sequence[float]) -> None:
        """Set a training metric: a number (simulated tau) or a list (per-position accuracy)."""
        if self.enabled:
            try:
                self._metrics[name] = float(value)  # type: ignore[arg-type]
            except TypeError:
                self._metrics[name] = [float(v) for v in value]  # type: ignore[union-attr]

    def worker_names(self) -> list[str]:
        return list(self._workers)

    # --- folding and draining -----------------------------------------------------------------------

    def _fold(self, w: Worker) -> None:
        """Called by a worker whose buffer reached fold_at: compress it so memory stays bounded."""
        with self._lock:
            items = _take(w._buf)
            pend = self._pending.setdefault(w.name, {})
            for cat, values in _group(items).items():
                values, bad = _finite(values)
                self._dropped += bad
                acc = pend.get(cat)
                if acc is None:
                    acc = pend[cat] = Reservoir(self._reservoir)
                acc.extend(values, self._fold_rng)
            self._park_cuda(w.name, _take(w._cuda))

    def _park_cuda(self, name: str, pairs: list) -> None:
        """Keep unresolved CUDA pairs (oldest first), dropping the oldest past the backlog. Lock held."""
        if not pairs:
            return
        lst = self._unresolved.setdefault(name, [])
        lst.extend(pairs)
        over = len(lst) - CUDA_BACKLOG
        if over > 0:
            del lst[:over]
            self._dropped += over

    def drain(self) -> Summary:
        """Summarise and reset the window since the previous drain (cumulative stats are kept).

        Called by the publisher thread. It resolves finished CUDA events with query() and leaves the
        rest for the next drain; it never waits for the GPU.
        """
        now = _perf()
        t = time.time()
        if not self.enabled:
            return Summary(t=t, window_s=0.0)
        with self._drain_lock:
            self._resolve_device_counts()
            win = self._take_window(now)
            device = self._resolve_window_cuda(win)
            inflight, since_done, held = self._book_open(win, now, t)
            out_workers = {w.name: self._window_stats(w, win, device.get(w.name, {}), held.get(w.name, {}), now)
                           for w in win.workers}
            out_cum = {w.name: self._cumulative_stats(w.name, now - w.created) for w in win.workers}
            rates = {k: (v - self._last_counters.get(k, 0)) / win.seconds if win.seconds > 0 else 0.0
                     for k, v in win.counters.items()}
            self._last_counters = win.counters
        return Summary(
            t=t,
            window_s=win.seconds,
            workers=out_workers,
            untracked=untracked_of(out_workers),
            cumulative=out_cum,
            counters=win.counters,
            rates=rates,
            gauges=win.gauges,
            metrics=win.metrics,
            dropped=win.dropped,
            inflight=inflight,
            since_done=since_done,
            roles={w: str(r) for w, r in self._roles.items()},
            devices=dict(self._devices),
        )

    def _take_window(self, now: float) -> _Window:
        """Everything the workers recorded since the last drain, taken from them at one instant (their
        buffers emptied), with the counters, gauges and metrics as they stand then."""
        with self._lock:
            workers = list(self._workers.values())
            raw = {w.name: _take(w._buf) for w in workers}
            # after the buffers: a span that ends in between is then "ended" here and its sample
            # arrives in a later window, which the carry handles (the other order would book it twice)
            opened = {w.name: w.open_spans() for w in workers}
            held = {w.name: w.held() for w in workers}
            for w in workers:
                self._park_cuda(w.name, _take(w._cuda))
            pending, self._pending = self._pending, {}
            unresolved, self._unresolved = self._unresolved, {}
            counters = dict(self._counters)
            dropped, self._dropped = self._dropped, 0
        gauges = dict(self._gauges)
        metrics = {k: (list(v) if isinstance(v, list) else v) for k, v in self._metrics.items()}
        start, self._window_start = self._window_start, now
        return _Window(workers=workers, raw=raw, opened=opened, held=held, pending=pending, unresolved=unresolved,
                       counters=counters, gauges=gauges, metrics=metrics, dropped=dropped, start=start,
                       seconds=now - start)

    def _resolve_window_cuda(self, win: _Window) -> dict[str, dict[str, list[float]]]:
        """Device seconds per worker and category of the CUDA events that have completed; the others are
        parked again for the next drain."""
        device, still, dev_dropped = self._resolve_cuda(win.unresolved)
        win.dropped += dev_dropped
        if still:
            with self._lock:
                for name, pairs in still.items():
                    # older pairs go first: a concurrent fold may already have parked newer ones
                    newer = self._unresolved.get(name, [])
                    self._unresolved[name] = []
                    self._park_cuda(name, pairs + newer)
        return device

    def _window_stats(self, w: Worker, win: _Window, dev: dict[str, list[float]], held: dict[str, float],
                      now: float) -> dict[str, CategoryStats]:
        """One worker's categories over the window (host time, device time, share of its wall time),
        folded into its cumulative reservoirs as they go. ``held``: seconds a step under way came to hold
        in this window, per category (booked as ended time: its spans did end)."""
        name, rng = w.name, self._rng
        wall = now - max(win.start, w.created)
        accs: dict[str, Reservoir] = win.pending.get(name, {})
        cats: dict[str, CategoryStats] = {}
        groups = _group(win.raw[name])
        open_part: dict[str, float] = {}
        for cat, t0 in win.opened[name]:
            open_part[cat] = open_part.get(cat, 0.0) + now - max(t0, win.start, w.created)
        cum = self._cum.setdefault(name, {})
        cum_dev = self._cum_dev.setdefault(name, {})
        for cat in dict.fromkeys([*groups, *accs, *dev]):  # ordered union: stable output
            values, bad = _finite(groups.get(cat, []))
            win.dropped += bad
            acc = accs.get(cat)
            if acc is not None:
                acc.extend(values, rng)
            elif values:
                acc = Reservoir.of(values)
            dstats = None
            dvals = dev.get(cat)
            if dvals:
                dstats = Reservoir.of(dvals).device_stats(wall)
                cum_dev.setdefault(cat, Reservoir(CUM_RESERVOIR)).extend(dvals, rng)
            if acc is None:
                # device times resolved for spans whose host time fell in an earlier window
                cats[cat] = CategoryStats(n=0, total=0.0, mean=0.0, p50=0.0, p95=0.0, max=0.0, device=dstats)
                continue
            cats[cat] = acc.stats(wall, dstats)
            cats[cat].share = self._window_share(name, cat, acc.total + held.pop(cat, 0.0),
                                                 open_part.pop(cat, 0.0), wall)
            cum.setdefault(cat, Reservoir(CUM_RESERVOIR)).merge(acc, rng)
        # open all window long, ended without a sample yet, or held by a step under way
        for cat in dict.fromkeys([*open_part, *held]):
            share = self._window_share(name, cat, held.get(cat, 0.0), open_part.get(cat, 0.0), wall)
            if cat in cats:
                cats[cat].share = share
            else:
                cats[cat] = CategoryStats(n=0, total=0.0, mean=0.0, p50=0.0, p95=0.0, max=0.0, share=share)
        return cats

    def _cumulative_stats(self, name: str, life: float) -> dict[str, CategoryStats]:
        """One worker's categories over its whole life, device time included."""
        cum, cum_dev = self._cum.get(name, {}), self._cum_dev.get(name, {})
        out = {}
        for cat, a in cum.items():
            d = cum_dev.get(cat)
            out[cat] = a.stats(life, d.device_stats(life) if d is not None and d.n else None)
        # device-only categories (all host time recorded before the first drain saw them)
        for cat, d in cum_dev.items():
            if cat not in cum and d.n:
                out[cat] = CategoryStats(n=0, total=0.0, mean=0.0, p50=0.0, p95=0.0, max=0.0,
                                         device=d.device_stats(life))
        return out

    def _book_open(self, win: _Window, now: float, t: float
                   ) -> tuple[dict[str, OpenSpan], dict[str, float], dict[str, dict[str, float]]]:
        """What each worker is doing now, how long since it last completed a span, the carry of spans and
        steps that ended since the previous drain (their booked time comes off their sample's window),
        and per worker and category the seconds a step under way came to hold since then. Drain lock held."""
        # (worker, category, start, held): an open span by its start, or the time a step holds
        booked: dict[tuple[str, str, float, bool], float] = {}
        inflight: dict[str, OpenSpan] = {}
        since_done: dict[str, float] = {}
        held_now: dict[str, dict[str, float]] = {}
        for w in win.workers:
            name = w.name
            spans = win.opened[name]
            for cat, t0 in spans:
                booked[(name, cat, t0, False)] = now - max(t0, w.created)
            if spans:
                cat, t0 = spans[-1]  # the innermost: the latest to start
                inflight[name] = OpenSpan(category=cat, start=t - (now - t0), elapsed=now - t0, depth=len(spans))
            step = win.held[name]
            grew = False
            if step is not None:
                start, held = step
                mine = held_now[name] = {}
                for cat, secs in held.items():
                    key = (name, cat, start, True)
                    booked[key] = secs
                    if (more := secs - self._booked.get(key, 0.0)) > 0:
                        mine[cat] = more
                        grew = True
            if win.raw[name] or win.pending.get(name) or grew:
                self._last_done[name] = now
            since_done[name] = now - self._last_done.setdefault(name, w.created)
        for key, secs in self._booked.items():
            if key not in booked:  # ended since the previous drain
                ck = (key[0], key[1])
                self._carry[ck] = self._carry.get(ck, 0.0) + secs
        self._booked = booked
        return inflight, since_done, held_now

    def _window_share(self, name: str, cat: str, ended: float, open_part: float, wall: float) -> float:
        """Share of the window: time of the spans that ended in it, less what earlier windows already
        booked of them while they were open, plus the part of still-open spans that fell in it."""
        busy = ended
        carry = self._carry.get((name, cat))
        if carry:
            used = min(carry, busy)
            busy -= used
            if carry - used > 1e-12:
                self._carry[(name, cat)] = carry - used
            else:
                del self._carry[(name, cat)]
        busy += open_part
        return min(1.0, max(0.0, busy / wall)) if wall > 0 else 0.0

    @staticmethod
    def _resolve_cuda(
        unresolved: dict[str, list[tuple[str, tuple[tuple[Any, Any], ...]]]],
    ) -> tuple[dict[str, dict[str, list[float]]], dict[str, list], int]:
        """Device seconds for finished samples (one event pair, or a step's pairs of one category: their
        sum); unfinished ones are returned to be retried."""
        device: dict[str, dict[str, list[float]]] = {}
        still: dict[str, list] = {}
        dropped = 0
        for name, samples in unresolved.items():
            keep = []
            for sample in samples:
                cat, pairs = sample
                try:
                    if not all(end.query() for _, end in pairs):
                        keep.append(sample)
                        continue
                    ms = sum(start.elapsed_time(end) for start, end in pairs)
                except Exception:
                    # e.g. an event from a context that no longer exists: nothing to report
                    dropped += 1
                    continue
                device.setdefault(name, {}).setdefault(cat, []).append(ms / 1000.0)
            if keep:
                still[name] = keep
        return device, still, dropped

    def pending_cuda(self) -> int:
        """CUDA samples (a span's event pair, or a step's pairs of one category) not yet resolved (for tests
        and the bench)."""
        with self._lock:
            return sum(len(v) for v in self._unresolved.values()) + sum(len(w._cuda) for w in self._workers.values())
