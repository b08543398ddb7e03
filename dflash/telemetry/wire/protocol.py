"""The telemetry wire format: the only module the trainer and dflash-top share.

Frames are newline-delimited JSON objects tagged by ``"type"``. They are defined once here as msgspec
Structs so that encoding is fast on the trainer side and decoding validates on the client side. New
optional fields may be added without bumping ``PROTO`` (decoders ignore unknown fields); a change that
breaks old readers must bump it. See docs/protocol.md.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from dflash.telemetry.wire.vocab import PAUSE_CATEGORIES

PROTO = 1
#: A frame longer than this is rejected by readers (a snapshot of 8 workers x 12 categories is ~20 KB).
MAX_FRAME_BYTES = 4 * 1024 * 1024
#: JSON nesting a frame may have. Frames need 6 or so; the decoder recurses once per level, and a
#: frame nested a thousand deep (2 KB of brackets) would raise RecursionError instead of an error.
MAX_DEPTH = 32


class ProtocolError(ValueError):
    """A frame that is not valid telemetry; the message says what was wrong."""


class SpanStats(msgspec.Struct, omit_defaults=True):
    """Timing of a set of spans over a window (seconds): what host and device time have in common."""

    n: int
    total: float
    mean: float
    p50: float
    p95: float
    max: float
    #: fraction of the worker's wall time over the window spent inside these spans
    share: float = 0.0


class DeviceStats(SpanStats, omit_defaults=True):
    """Device-side (CUDA event) time of one category's spans. Its `share` is how long the worker's CUDA
    stream spent inside them (the bottleneck verdict's measure of how busy a GPU stage is; absent from
    recordings made before it existed)."""


class CategoryStats(SpanStats, omit_defaults=True):
    """Timing of one category in one worker over a window (host clock)."""

    #: device-side (CUDA event) time for the same spans, when resolved
    device: DeviceStats | None = None


class ThreadSample(msgspec.Struct):
    tid: int  # native thread id, as `top -H` and py-spy's os_thread_id show it
    name: str
    cpu_percent: float


class MigSample(msgspec.Struct, omit_defaults=True):
    """One MIG instance of a GPU (NVML reads no utilisation for it)."""

    index: int  # MIG device index on its GPU
    name: str
    uuid: str | None = None
    #: its CUDA ordinal in the trainer's process (None: not visible to the trainer)
    cuda_index: int | None = None
    mem_used: int | None = None
    mem_total: int | None = None


class GpuSample(msgspec.Struct, omit_defaults=True):
    index: int  # NVML index (PCI bus order), which need not equal the CUDA ordinal
    name: str
    util_percent: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    power_w: float | None = None
    temp_c: float | None = None
    sm_clock_mhz: float | None = None
    #: memory used on this GPU by the trainer's process
    process_mem: int | None = None
    #: percent of the time the trainer's process had a kernel running on this GPU (NVML's per-process
    #: samples since the last window; None: NVML kept none for it)
    process_util: float | None = None
    uuid: str | None = None
    #: the CUDA ordinal (``cuda:N``) of this GPU in the trainer's process; None: not visible to it
    cuda_index: int | None = None
    #: percent of SMs busy / of time tensor cores were in use, from NVML GPM (Hopper and later)
    sm_active: float | None = None
    tensor_active: float | None = None
    mig: list[MigSample] = []


class MachineSample(msgspec.Struct, omit_defaults=True):
    """The whole machine, as top and btop see it: whether the trainer gets the cores it asks for."""

    #: logical CPUs of the machine
    cores: int = 0
    #: 1-minute load average (runnable and running tasks, all processes)
    load1: float = 0.0
    #: CPU time all processes used over the window, percent of one core (0 .. cores x 100)
    busy_percent: float = 0.0
    #: ... of which processes other than the trainer
    others_percent: float = 0.0
    #: time the hypervisor ran other guests on our virtual CPUs, percent of one core (None: not reported)
    steal_percent: float | None = None


class SystemSample(msgspec.Struct, omit_defaults=True):
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    threads: list[ThreadSample] = []
    gpus: list[GpuSample] = []
    #: why `gpus` is empty (e.g. "no NVIDIA driver"); None when GPUs were read
    gpu_error: str | None = None
    machine: MachineSample | None = None


class Bottleneck(msgspec.Struct, omit_defaults=True):
    #: one of dflash.telemetry.wire.verdicts.VERDICTS
    verdict: str
    reason: str = ""
    #: the figures the verdict was decided from, over the same time as the verdict
    evidence: dict[str, float] = {}
    #: what time the verdict and its evidence cover: "last 10 s (24 steps)", "whole run (training 5:00)";
    #: a held verdict adds why it still stands ("" in recordings from before the field)
    scope: str = ""


class RankFigures(msgspec.Struct, omit_defaults=True):
    """What a rank says about itself in the cluster exchange."""

    rank: int
    host: str = ""
    pid: int = 0
    #: "training", "finished" or "failed", as the rank last said; "silent" if it never reported
    state: str = "training"
    step: int = 0
    tokens_per_s: float = 0.0
    loss: float | None = None
    #: fraction of the rank's wall time its drafter spent in the gradient all-reduce (waiting for the
    #: other ranks, mostly): the rank that waits least is the one the others wait for
    allreduce_share: float = 0.0
    #: the rank's own telemetry socket (attachable when it is on the same machine)
    socket: str | None = None
    #: "worker/category for 42 s" of each of the rank's stalled workers (its own watchdog's verdict,
    #: so a rank whose process is alive and reporting but whose training is stuck is named)
    stalled: list[str] = []


class ClusterRank(RankFigures, omit_defaults=True):
    """One rank as rank 0 last heard of it."""

    #: seconds since rank 0 last received a new report from this rank
    age_s: float = 0.0
    #: True when the rank has stopped reporting (no new report for several intervals while training)
    stale: bool = False


class ClusterCategory(msgspec.Struct, omit_defaults=True):
    """One "worker/category" across ranks: share of that worker's wall time over the last window."""

    key: str
    min: float
    mean: float
    max: float
    min_rank: int
    #: the rank with the highest share: the slowest in a compute category, the one that waits most in
    #: a waiting one (`*_wait`, `*_put`)
    max_rank: int


class Cluster(msgspec.Struct, omit_defaults=True):
    """The cross-rank view rank 0 publishes in its snapshots (min/max of each figure across ranks)."""

    world_size: int
    ranks: list[ClusterRank] = []
    #: sorted by spread (max - min), widest first
    categories: list[ClusterCategory] = []
    #: the rank the others wait for, when the all-reduce waits differ enough to tell
    straggler: int | None = None
    straggler_reason: str = ""
    #: ranks that stopped reporting
    stale: list[int] = []
    #: ranks whose own watchdog reports a stalled worker
    stalled: list[int] = []
    #: why the exchange itself is not working (e.g. the store is unreachable); None when it is
    error: str | None = None


class OpenSpan(msgspec.Struct, omit_defaults=True):
    """A worker's innermost span that has not ended yet: what the worker is doing right now."""

    category: str
    #: unix time the span began
    start: float
    #: seconds it has been open when the snapshot was taken
    elapsed: float
    #: how many spans the worker has open (nested spans: the outer ones are still running too)
    depth: int = 1


class Stall(msgspec.Struct, omit_defaults=True):
    """A worker that has completed no span for longer than its stall timeout (dflash.telemetry.verdict.watchdog)."""

    worker: str
    #: the open span it is stuck in ("" when none is open: it is stuck between spans)
    category: str
    #: seconds without a completed span when this snapshot was taken
    elapsed: float
    #: the timeout it exceeded, and how it was chosen ("history", "first-step grace", "--stall-timeout")
    timeout: float
    basis: str = ""
    #: unix time the stall was detected
    since: float = 0.0
    #: innermost Python frame of the worker's thread, "file:line in function"
    frame: str = ""
    #: where the stacks of every thread were written (None when there is no run directory)
    stack_file: str | None = None


class Anomaly(msgspec.Struct, omit_defaults=True):
    """A sustained deviation of one worker/category from its own robust baseline."""

    worker: str
    category: str
    #: "p95" or "mean"
    stat: str
    value: float
    baseline: float
    #: value / baseline
    ratio: float
    #: unix time the deviation began (its first deviating window)
    since: float
    message: str = ""


class Hello(msgspec.Struct, tag_field="type", tag="hello", omit_defaults=True):
    proto: int
    run: str
    pid: int
    host: str
    rank: int = 0
    world_size: int = 1
    workers: list[str] = []
    #: native thread id (as a string, JSON keys are strings) -> Python thread name
    threads: dict[str, str] = {}
    started: float = 0.0
    interval_s: float = 1.0
    run_dir: str | None = None


class Sampling(msgspec.Struct, omit_defaults=True):
    """How a sampled snapshot was measured: dflash-top read the process's stacks from outside (`dflash-top
    --pid`, any PyTorch trainer) instead of the trainer timing its own spans. A share is then the fraction
    of a thread's samples its stacks put in a category (docs/sampling.md), known within `margin`."""

    #: the sampler and its mode: "py-spy --nonblocking" (the process runs on) or "py-spy --native"
    tool: str
    rate_hz: float
    #: samples per thread in this window, and since sampling began (the cumulative stats')
    samples: int
    total_samples: int = 0
    #: half-width of the 95% interval of a share at those counts, at its widest (a share of 50%)
    margin: float = 0.0
    total_margin: float = 0.0
    native: bool = False
    #: percent of one core the sampler (py-spy) used over the window, and what sampling costs in words
    sampler_cpu_percent: float | None = None
    cost: str = ""
    #: share of samples some thread held the GIL, and each worker's own share (None: not sampled)
    gil_held: float | None = None
    gil: dict[str, float] = {}


class Snapshot(msgspec.Struct, tag_field="type", tag="snapshot", omit_defaults=True):
    seq: int
    t: float
    interval_s: float
    #: measured length of this window in seconds (interval_s is only the target); 0 when unknown
    window_s: float = 0.0
    #: worker -> category -> stats over this window
    workers: dict[str, dict[str, CategoryStats]] = {}
    #: worker -> fraction of the window not covered by any category
    untracked: dict[str, float] = {}
    #: worker -> category -> stats since the start of the run
    cumulative: dict[str, dict[str, CategoryStats]] = {}
    #: monotonically increasing totals (tokens, samples, steps, ...)
    counters: dict[str, float] = {}
    #: per-second rates of the counters over this window
    rates: dict[str, float] = {}
    #: last values (loss, lr, queue depths, ...)
    gauges: dict[str, float] = {}
    #: training metrics (per-position accuracy as a list, simulated tau, ...)
    metrics: dict[str, float | list[float]] = {}
    #: "<map>.<name>" -> "nan"/"inf"/... for counters, rates, gauges or metrics whose value was not
    #: finite: JSON cannot carry NaN, so such values leave their map and are named here instead
    nonfinite: dict[str, str] = {}
    system: SystemSample | None = None
    bottleneck: Bottleneck | None = None
    #: cross-rank view, published by rank 0 in multi-rank runs
    cluster: Cluster | None = None
    #: worker -> its innermost open span (absent: the worker is between spans)
    inflight: dict[str, OpenSpan] = {}
    #: workers that are stalled now (empty when none is, or the watchdog is off)
    stalls: list[Stall] = []
    #: worker/category timings that deviate from their baseline now
    anomalies: list[Anomaly] = []
    #: worker -> its pipeline role ("target", "drafter", "data": dflash.telemetry.wire.vocab.Role); empty in
    #: recordings written before roles were on the wire
    roles: dict[str, str] = {}
    #: worker -> the CUDA ordinal (`cuda:N`) its stage computes on, as it registered it; workers on the host
    #: are absent. With the GPUs' `cuda_index` it says whose GPU a stage's kernels run on (launch-bound)
    devices: dict[str, int] = {}
    #: set when the figures were sampled from outside (`dflash-top --pid`), not timed by a trainer
    sampling: Sampling | None = None


class Event(msgspec.Struct, tag_field="type", tag="event", omit_defaults=True):
    t: float
    #: "checkpoint", "eval", "phase" (e.g. the final evaluation begins), "warning", "error", "info"
    kind: str
    message: str
    data: dict[str, Any] = {}


class Request(msgspec.Struct, tag_field="type", tag="request", omit_defaults=True):
    id: int
    #: "stacks" or "ptrace_allow"
    op: str
    args: dict[str, Any] = {}


class Reply(msgspec.Struct, tag_field="type", tag="reply", omit_defaults=True):
    id: int
    op: str
    ok: bool
    error: str | None = None
    data: Any = None


class StackEntry(msgspec.Struct):
    """One Python frame of a thread's stack."""

    file: str
    line: int
    function: str


class ThreadStacks(msgspec.Struct):
    """One Python thread of the trainer and its stack."""

    #: native thread id (as `top -H` and py-spy show it); 0 when the trainer could not tell
    tid: int
    name: str
    ident: int = 0
    daemon: bool = False
    #: innermost frame first, as py-spy prints them
    frames: list[StackEntry] = []


class Stacks(msgspec.Struct):
    """The ``data`` of a successful ``stacks`` reply: every Python thread of the trainer, at time ``t``."""

    pid: int
    t: float = 0.0
    threads: list[ThreadStacks] = []


def stacks_of(reply: Reply) -> Stacks:
    """The typed ``data`` of a ``stacks`` reply, or ProtocolError saying what is wrong with it. The
    envelope stays a plain ``reply`` (its ``data`` depends on ``op``), so the wire is unchanged."""
    try:
        return msgspec.convert(reply.data, Stacks)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid stacks reply: {e}") from None


class Bye(msgspec.Struct, tag_field="type", tag="bye", omit_defaults=True):
    t: float
    reason: str = "shutdown"


Frame = Hello | Snapshot | Event | Request | Reply | Bye

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Frame)


def encode(frame: Frame) -> bytes:
    """One frame as a JSON line (with the trailing newline)."""
    return _encoder.encode(frame) + b"\n"


# A JSON string (escapes included), and every byte that is not a bracket (or a quote): what the nesting
# scan drops.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_NOT_BRACKET_OR_QUOTE = bytes(b for b in range(256) if b not in b'[]{}"')
_FOLD_BRACKETS = bytes.maketrans(b"{}", b"[]")


def check_bounds(line: bytes, limit: int = MAX_FRAME_BYTES) -> None:
    """Raise ProtocolError for a line longer than ``limit`` or nested deeper than MAX_DEPTH, before any
    decoder sees it.

    The nesting scan runs at C speed (about 75 us for a 40 KB snapshot): drop the strings (brackets inside
    them do not count), keep only the brackets, then strip innermost ``[]`` pairs one level per pass.
    Valid JSON empties in as many passes as it is deep; what is left after MAX_DEPTH passes is too
    deep, and what stops shrinking before it is empty is unbalanced (not JSON at all).
    """
    if len(line) > limit:
        raise ProtocolError(f"frame of {len(line)} bytes exceeds the {limit}-byte limit")
    if line.count(b"[") + line.count(b"{") <= MAX_DEPTH:
        return  # too few brackets to nest deeper: the common case for small frames costs two counts
    if b"\\" in line:
        brackets = _JSON_STRING.sub(b"", line).translate(_FOLD_BRACKETS, _NOT_BRACKET)
    else:
        # No quote is escaped, so every other piece between quotes is a string. Keep only brackets and
        # quotes, then drop each pair of adjacent quotes: an empty string, or a gap between two strings
        # with no bracket in it. No bracket changes side and the quotes left still alternate; only the
        # strings holding a bracket keep theirs, so the split makes a few pieces, not one per string
        # (a 40 KB snapshot: 140 us -> 40 us).
        marks = line.translate(_FOLD_BRACKETS, _NOT_BRACKET_OR_QUOTE).replace(b'""', b"")
        brackets = b"".join(marks.split(b'"')[0::2])
    for _ in range(MAX_DEPTH):
        if not brackets:
            return
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            raise ProtocolError("malformed frame (not JSON): unbalanced brackets")
        brackets = shorter
    if brackets:
        raise ProtocolError(f"frame nested deeper than {MAX_DEPTH} levels")


def decode(line: bytes | str, limit: int = MAX_FRAME_BYTES) -> Frame:
    """Parse one line into a frame, or raise ProtocolError saying what is wrong with it (never anything
    else: size and nesting are bounded first)."""
    if isinstance(line, str):
        line = line.encode()
    check_bounds(line, limit)
    line = line.strip()
    if not line:
        raise ProtocolError("empty frame")
    try:
        return _decoder.decode(line)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid frame: {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"malformed frame (not JSON): {e}") from None


def hello_proto(line: bytes) -> Any:
    """The ``proto`` of a raw hello line, even one our structs cannot decode (a newer trainer's); None
    for any other line. Bounded like ``decode``."""
    try:
        check_bounds(line)
        raw = msgspec.json.decode(line)
    except (ProtocolError, msgspec.DecodeError):
        return None
    if not isinstance(raw, dict) or raw.get("type") != "hello":
        return None
    return raw.get("proto", "?")


class SegmentGate:
    """Follows the hellos of a recording so that a reader skips only what it cannot read.

    A recording is a run of segments, each opened by a hello (a resumed run appends a new one). A
    segment written by a trainer speaking another protocol version may decode into our structs with
    another meaning, or not at all: its frames are skipped, up to the next hello in our version, with
    one note at its start. Shared by ``dflash stats`` and dflash-top's replay.
    """

    def __init__(self) -> None:
        #: the protocol version of the segment being skipped (None: reading normally)
        self.foreign: Any = None
        #: frames skipped in foreign segments so far
        self.skipped = 0

    def admit(self, line: bytes, frame: Frame | None) -> tuple[bool, str | None]:
        """Whether to use this line's frame (``frame`` None: it did not decode), and a note to show."""
        proto = frame.proto if isinstance(frame, Hello) else hello_proto(line) if frame is None else None
        if proto is not None:
            if proto == PROTO:
                self.foreign = None
                return frame is not None, None
            self.foreign = proto
            self.skipped += 1
            return False, (f"hello of telemetry protocol v{proto} (this reader speaks v{PROTO}): its frames are "
                           f"skipped up to the next v{PROTO} hello")
        if self.foreign is not None:
            self.skipped += 1
            return False, None
        return frame is not None, None


def to_builtins(frame: Frame) -> dict[str, Any]:
    """A frame as plain dicts/lists (for --json output and tests)."""
    return msgspec.to_builtins(frame)


def recording_filename(rank: int = 0) -> str:
    """The recording in a run directory: rank 0 (and single-process runs) write telemetry.jsonl,
    every other rank telemetry-r<rank>.jsonl, so ranks sharing a run directory never share a file."""
    return "telemetry.jsonl" if rank == 0 else f"telemetry-r{rank}.jsonl"


# --- reading a whole run (shared so that `dflash stats` and `dflash-top --once` agree) ---------------


def training_shares(workers: dict[str, dict[str, CategoryStats]]) -> tuple[dict[str, dict[str, CategoryStats]], float]:
    """Whole-run stats with evaluation taken out: an evaluation pauses the whole pipeline, so every
    worker's shares are re-based on its time minus the longest evaluation any worker recorded (a final
    evaluation of minutes would otherwise dilute every training share); and that time, in seconds."""
    paused_s = max((sum(cats[c].total for c in PAUSE_CATEGORIES if c in cats) for cats in workers.values()),
                   default=0.0)
    out: dict[str, dict[str, CategoryStats]] = {}
    for worker, cats in workers.items():
        lived = next((st.total / st.share for st in cats.values() if st.share > 0 and st.total > 0), 0.0)
        wall = lived - paused_s
        out[worker] = {c: msgspec.structs.replace(st, share=min(1.0, st.total / wall) if wall > 0 else 0.0)
                       for c, st in cats.items() if c not in PAUSE_CATEGORIES}
    return out, paused_s
