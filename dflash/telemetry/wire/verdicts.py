"""The bottleneck verdicts, one table: each verdict's name (on the wire, a Prometheus label value, a
tracker key), what it means (the help screen), its style on screen, the rule that decides it from its
evidence and the reason it gives.

`dflash.telemetry.verdict.evidence` gathers the evidence (per-role shares of wall time, device time, the
machine's view) and returns the first stage verdict whose rule holds, then lets the overlays (CPU-starved,
GIL-bound, launch-bound: OVERLAY_ORDER) take over where theirs hold; a check that a shown verdict follows from its own
evidence (`agrees_with_evidence`) evaluates the same rule, so the two can never drift apart. A new verdict
is one entry here plus the evidence it needs. Torch-free: dflash-top reads the names, meanings and
styles; the rules run wherever evidence is (the trainer, `dflash stats`, replays).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: a wait above this share of a worker's wall time counts as starving/blocked
THRESHOLD = 0.20
#: below this much timed work per pipeline worker there is nothing to judge (start-up, eval pauses)
MIN_TRACKED = 0.05
#: the published verdict judges this many seconds of recent windows merged, not one window
VERDICT_SPAN_S = 10.0
#: a new verdict shows once it has won this many judgements (one per window) in a row
HOLD_WINDOWS = 3
#: GIL contention (share of a probe thread's time spent waiting for the GIL, dflash/telemetry/verdict/gil.py)
#: from which the interpreter lock, not compute, limits the stage that bounds throughput
GIL_CONTENTION = 0.5
#: ... provided the process runs on no more than this many cores (CPU percent): threads limited by the
#: GIL run one at a time, so a process using more is computing in parallel, whatever the probe says
#: (a sleep probe on an oversubscribed machine also counts waiting for a core)
GIL_MAX_CPU = 150.0
#: ... and on at least this much of one: one thread holds the GIL and runs, so a process far below one
#: core while its threads "wait" was waiting for a CPU, not for the lock (the probe cannot tell them apart)
GIL_MIN_CPU = 70.0
#: workers that ran on a CPU less than this fraction of the time they were busy were kept off the cores
STARVED_RATIO = 0.5
#: ... while busy at least THRESHOLD of their time (workers that mostly wait are not limited by a CPU),
#: by other processes using at least this many cores, with fewer than this many left idle
STARVED_OTHERS_CORES = 0.5
STARVED_IDLE_CORES = 0.5
#: launch-bound: a stage's thread works (in spans that are not queue waits) at least this share of its wall
#: time - a thread that waits more is fed or drained by another stage, which is then the limit ...
LAUNCH_BUSY = 0.5
#: ... while the GPU it computes on ran the trainer's kernels (NVML's kernel time) at most this fraction of
#: that busy share: the GPU idles at least half the time its thread works for it. Not CUDA events: an
#: event pair times the stream from the span's start to its last kernel's end, idle gaps included, so
#: when the GPU waits on its thread the events follow the thread (the first GPU run: target_forward 3.34 s
#: host and 3.34 s device). A factor of two, because NVML counts a sample period in which any kernel ran
#: (it overstates a stage of tiny kernels, never understates it) and on a GPU the stages share it counts
#: the other stage's kernels too: a GPU that reads idle half the time really was
LAUNCH_GPU_RATIO = 0.5
#: a regenerate job is client-bound from this share of its client thread's time busy (not waiting for answers):
#: its one event loop then runs flat out and answers queue for it, however fast the servers are
CLIENT_BUSY = 0.5
#: the style of a verdict this table does not know (a newer trainer's): plain, and visibly not one of ours
UNRECOGNISED_STYLE = "bold reverse"

Evidence = Mapping[str, float]


def _t(e: Evidence) -> float:
    return e.get("threshold", THRESHOLD)


def _f(e: Evidence, key: str, default: float = 0.0) -> float:
    return e.get(key, default)


def _device(e: Evidence) -> bool:
    """Judged on device time (CUDA events) rather than on the waits, which lie on a GPU."""
    return e.get("device_time") == 1.0


def _gap(e: Evidence) -> float:
    return _f(e, "target.device_busy") - _f(e, "drafter.device_busy")


def _waits(e: Evidence) -> tuple[float, float, float]:
    """(targets wait for batches, targets block on puts, drafters wait for hidden states)."""
    return _f(e, "target.batch_queue_wait"), _f(e, "target.hs_queue_put"), _f(e, "drafter.hs_queue_wait")


def _device_figures(e: Evidence) -> str:
    """What the device time says, in words: each stage's busy share, the time both ran at once (each
    stage's span counts the other's kernels on a shared GPU) and, where known, milliseconds per step."""
    t_busy, d_busy, overlap = _f(e, "target.device_busy"), _f(e, "drafter.device_busy"), _f(e, "device.overlap")
    figures = f"target stage busy {t_busy:.0%} of the time, drafter stage {d_busy:.0%} (device time from CUDA events)"
    if overlap > 0:
        figures += (f", both at once at least {overlap:.0%} of it (on a shared GPU each stage counts that time; "
                    f"apart from it the target ran {t_busy - overlap:.0%}, the drafter {d_busy - overlap:.0%})")
        if "target.device_ms_per_step" in e:
            figures += (f"; per step the target's kernels spanned {e['target.device_ms_per_step']:.1f} ms, "
                        f"the drafter's {_f(e, 'drafter.device_ms_per_step'):.1f} ms")
    return figures


# --- each verdict's rule and reason ----------------------------------------------------------------


def _unknown(e: Evidence) -> bool:
    if _f(e, "endpoints"):  # a regenerate job: judged once its client has timed anything at all
        return _f(e, "client.tracked") <= 0 and _f(e, "endpoints.busy") <= 0
    return not (_f(e, "targets") + _f(e, "drafters")) or _f(e, "pipeline.tracked") < MIN_TRACKED


def _unknown_why(e: Evidence, under: str) -> str:
    if _f(e, "endpoints"):
        return "no request answered and no client work timed yet"
    if not (_f(e, "targets") + _f(e, "drafters")):
        return "no target or drafter workers reported timings"
    return f"too little timed work to judge ({_f(e, 'pipeline.tracked'):.0%} of pipeline workers' time)"


def _data(e: Evidence) -> bool:
    starve, put, _ = _waits(e)
    return _f(e, "targets") > 0 and starve >= _t(e) and starve >= put


def _data_why(e: Evidence, under: str) -> str:
    return (f"targets wait {_waits(e)[0]:.0%} of their time for batches (batch_queue_wait): the data producer "
            "(one thread) limits throughput; make batch building cheaper")


def _input(e: Evidence) -> bool:
    cache = _f(e, "target.cache_wait")
    return _f(e, "targets") > 0 and cache >= _t(e) and cache >= _waits(e)[1]


def _input_why(e: Evidence, under: str) -> str:
    return (f"waiting for hidden states: the cache reader waits {_f(e, 'target.cache_wait'):.0%} of its time for "
            "files not yet written (cache_wait); the engine or `dflash data cache` writing them limits throughput")


def _target(e: Evidence) -> bool:
    if _device(e):
        return _gap(e) >= _t(e)
    _, put, wait = _waits(e)
    return _f(e, "drafters") > 0 and wait >= _t(e) and wait >= put


_MORE_TARGET = "add target workers/GPUs (--target-devices) or batch the target more"


def _target_why(e: Evidence, under: str) -> str:
    if _device(e):
        return f"{_device_figures(e)}: the target forward limits throughput; {_MORE_TARGET}"
    _, put, wait = _waits(e)
    return (f"drafters wait {wait:.0%} of their time for hidden states (hs_queue_wait) while targets block only "
            f"{put:.0%}: the target forward limits throughput; {_MORE_TARGET}")


def _drafter(e: Evidence) -> bool:
    if _device(e):
        return -_gap(e) >= _t(e)
    _, put, wait = _waits(e)
    return max(put, wait) >= _t(e) and not (_f(e, "drafters") > 0 and wait >= put)


_CHEAPER_DRAFTER = "make the drafter step cheaper (fewer anchors or drafter layers) or add ranks (--nproc, torchrun)"


def _drafter_why(e: Evidence, under: str) -> str:
    if _device(e):
        return f"{_device_figures(e)}: drafter training limits throughput; {_CHEAPER_DRAFTER}"
    _, put, wait = _waits(e)
    return (f"targets spend {put:.0%} of their time blocked on a full hidden-state queue (hs_queue_put) while "
            f"drafters wait only {wait:.0%}: drafter training limits throughput; {_CHEAPER_DRAFTER}, each with "
            "its own drafter")


def _balanced(e: Evidence) -> bool:
    return abs(_gap(e)) < _t(e) if _device(e) else max(_waits(e)) < _t(e)


def _balanced_why(e: Evidence, under: str) -> str:
    if _device(e):
        return f"{_device_figures(e)}: within {_t(e):.0%} of each other"
    name, share = max(zip(("batch_queue_wait", "hs_queue_put", "hs_queue_wait"), _waits(e), strict=True),
                      key=lambda kv: kv[1])
    return f"no stage waits more than {_t(e):.0%} of its time (largest: {name} {share:.0%})"


def _gil(e: Evidence) -> bool:
    cpu = e.get("process_cpu_percent")
    return _f(e, "gil_contention") >= GIL_CONTENTION and (cpu is None or GIL_MIN_CPU <= cpu <= GIL_MAX_CPU)


def _gil_why(e: Evidence, under: str) -> str:
    return (f"a thread that wants the GIL waits {_f(e, 'gil_contention'):.0%} of its time for it: Python threads "
            f"queue for the interpreter lock, so the {under.removesuffix('-bound')} stage ({under} by its waits) "
            "is limited by the GIL, not by compute; move Python work out of the step (fewer small ops, CUDA "
            "graphs) or use processes (--nproc)")


def _starved(e: Evidence) -> bool:
    busy = _f(e, "workers.busy")
    return (busy >= _t(e) and _f(e, "workers.cpu", 1.0) < STARVED_RATIO * busy
            and _f(e, "machine.other_cores") >= STARVED_OTHERS_CORES
            and _f(e, "machine.idle_cores", STARVED_IDLE_CORES) < STARVED_IDLE_CORES)


def _starved_why(e: Evidence, under: str) -> str:
    return (f"other processes use {_f(e, 'machine.other_cores'):.1f} of {_f(e, 'machine.cores'):.0f} cores: the "
            f"workers ran on a CPU {_f(e, 'workers.cpu'):.0%} of the time while busy {_f(e, 'workers.busy'):.0%}, "
            f"so the {under.removesuffix('-bound')} stage ({under} by its waits) waits for a core; free cores (stop "
            "other jobs) or use fewer threads (--threads-per-worker)")


#: the stages a device-judged stage verdict names, for launch-bound to explain (data- and input-bound are
#: not explained by the GPU: their stages idle because nothing comes in)
_JUDGED = {"target-bound": ("target",), "drafter-bound": ("drafter",), "balanced": ("target", "drafter")}


def launch_bound_stages(e: Evidence) -> list[str]:
    """The stages ("target", "drafter") whose GPU waits on their thread: judged on device time, named (or,
    when balanced, allowed) by the stage verdict, with the thread busy LAUNCH_BUSY or more and the stage's
    GPU running kernels at most LAUNCH_GPU_RATIO of that busy share."""
    if not _device(e):
        return []
    out = []
    for stage in _JUDGED.get(first_stage_verdict(e).name, ()):
        gpu, busy = e.get(f"{stage}.gpu_busy"), min(1.0, _f(e, f"{stage}.busy"))
        if gpu is not None and busy >= LAUNCH_BUSY and gpu <= LAUNCH_GPU_RATIO * busy:
            out.append(stage)
    return out


def _launch(e: Evidence) -> bool:
    return bool(launch_bound_stages(e))


def _launch_why(e: Evidence, under: str) -> str:
    said = [f"the {s} stage's thread is busy {min(1.0, _f(e, f'{s}.busy')):.0%} of the time while its GPU runs "
            f"kernels only {_f(e, f'{s}.gpu_busy'):.0%} (NVML; CUDA events put it at "
            f"{_f(e, f'{s}.device_busy'):.0%}, idle gaps between its kernels included)" for s in launch_bound_stages(e)]
    return (f"{'; '.join(said)}: the GPU waits on its host thread - kernel launches, the allocator, host work "
            f"between them - so the stage ({under} by device time) is limited by its host, not by its GPU; "
            "capture the step in CUDA graphs (torch.compile mode='reduce-overhead'), run larger batches (fewer, "
            "bigger kernels) or fuse small ops, and `dflash-top --pid PID --native` shows whether its thread "
            "sits in launches, syncs or the allocator")


def _client(e: Evidence) -> bool:
    return _f(e, "endpoints") > 0 and _f(e, "client.busy") >= CLIENT_BUSY


def _client_why(e: Evidence, under: str) -> str:
    return (f"the client's one thread is busy {_f(e, 'client.busy'):.0%} of the time (building requests, reading "
            f"answers, writing rows) while the endpoints have requests {_f(e, 'endpoints.busy'):.0%} of it: "
            "the client, not the servers, limits throughput; run "
            "several clients on --shard K/N parts of the data (`dflash data merge` joins them)")


def _server(e: Evidence) -> bool:
    return _f(e, "endpoints") > 0 and _f(e, "client.busy") < CLIENT_BUSY


def _server_why(e: Evidence, under: str) -> str:
    return (f"the client is busy only {_f(e, 'client.busy'):.0%} of the time and waits on the servers, which "
            f"have requests {_f(e, 'endpoints.busy'):.0%} of it (p95 {_f(e, 'server.p95_s'):.2f} s a request): "
            "the servers limit throughput; raise --concurrency while that grows their batches "
            "(in flight near --concurrency), else add servers (more --endpoint URLs, data parallel)")


# --- the table -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """One verdict and all that is said of it. A stage verdict names the stage that bounds the pipeline;
    an overlay verdict explains why that stage is slow and takes the stage verdict's place."""

    name: str
    #: what the verdict means, for the help screen and the docs
    meaning: str
    #: how dflash-top shows its name (a Rich style)
    style: str
    #: whether the verdict follows from this evidence
    holds: Callable[[Evidence], bool]
    #: the reason it gives, from the evidence (and, for an overlay, the stage verdict it replaces)
    why: Callable[[Evidence, str], str]
    overlay: bool = False

    @property
    def tracker_key(self) -> str:
        """The verdict's one-hot scalar in TensorBoard / W&B."""
        return f"bottleneck/{self.name}"

    def reason(self, evidence: Evidence, under: str = "") -> str:
        return self.why(evidence, under)


_T, _M = f"{THRESHOLD:.0%}", f"{MIN_TRACKED:.0%}"
UNKNOWN = Verdict("unknown", f"less than {_M} timed work per pipeline worker (start-up, a pause) or no "
                  "pipeline workers (a regenerate job: nothing answered or timed yet).", "bold white on grey35",
                  _unknown, _unknown_why)
DATA_BOUND = Verdict("data-bound", f"targets wait >= {_T} of their time for batches (batch_queue_wait), at "
                     "least as much as they block on puts: the batch producer limits throughput.",
                     "bold black on yellow", _data, _data_why)
INPUT_BOUND = Verdict("input-bound", f"the hidden-states reader waits >= {_T} for files not yet written "
                      "(cache_wait, --follow), at least as much as it blocks on puts: the engine or `dflash data "
                      "cache` writing the cache limits throughput (waiting for hidden states).",
                      "bold black on cyan", _input, _input_why)
TARGET_BOUND = Verdict("target-bound", f"drafters wait >= {_T} for hidden states (hs_queue_wait), more than "
                       "targets block: the target forward limits throughput.",
                       "bold white on dark_orange3", _target, _target_why)
DRAFTER_BOUND = Verdict("drafter-bound", f"targets spend >= {_T} blocked on a full hidden-state queue "
                        "(hs_queue_put), more than drafters wait: drafter training limits throughput.",
                        "bold white on purple4", _drafter, _drafter_why)
BALANCED = Verdict("balanced", f"no stage waits {_T} or more of its time.", "bold black on green",
                   _balanced, _balanced_why)
SERVER_BOUND = Verdict("server-bound", f"a regenerate job's client thread is busy under {CLIENT_BUSY:.0%} of its "
                       "time: it waits for answers, so the serving endpoints limit throughput.",
                       "bold black on orange1", _server, _server_why)
CLIENT_BOUND = Verdict("client-bound", f"a regenerate job's client thread is busy {CLIENT_BUSY:.0%} of its time or "
                       "more (requests, answers, writes): the client limits throughput, not the servers.",
                       "bold white on deep_pink4", _client, _client_why)
GIL_BOUND = Verdict("GIL-bound", "a probe thread waits half its time or more for the interpreter lock, the "
                    "process runs on about one core and its workers' CPU time matches their busy time: "
                    "Python threads take turns, so the bounding stage is limited by the GIL, not by compute.",
                    "bold white on red3", _gil, _gil_why, overlay=True)
CPU_STARVED = Verdict("CPU-starved", "the workers are busy far longer than they get a CPU (their CPU time is "
                      "well below their busy time) while other processes use the machine's cores: the "
                      "machine, not the pipeline, limits throughput.",
                      "bold white on dark_red", _starved, _starved_why, overlay=True)
LAUNCH_BOUND = Verdict("launch-bound", f"a stage's thread is busy >= {LAUNCH_BUSY:.0%} of its time while its GPU "
                       f"runs kernels (NVML) at most {LAUNCH_GPU_RATIO:.0%} of that: the GPU waits on its host "
                       "thread (kernel launches, the allocator); CUDA graphs, larger batches or fewer small ops "
                       "help, more GPUs do not.", "bold white on blue3", _launch, _launch_why, overlay=True)

#: every verdict, in the order help and exports list them
VERDICTS: dict[str, Verdict] = {v.name: v for v in (DATA_BOUND, INPUT_BOUND, TARGET_BOUND, DRAFTER_BOUND,
                                                    SERVER_BOUND, CLIENT_BOUND, GIL_BOUND, CPU_STARVED,
                                                    LAUNCH_BOUND, BALANCED, UNKNOWN)}
#: the stage verdicts in the order they are tried: the first whose rule holds is the verdict (a slow
#: data stage starves the targets and, through them, the drafters too, so data-bound comes first);
#: balanced holds whenever none before it does. A regenerate job (endpoint workers, no pipeline) is one of
#: client-bound or server-bound, tried before the pipeline's verdicts, whose rules need targets or drafters
STAGE_ORDER: tuple[Verdict, ...] = (UNKNOWN, CLIENT_BOUND, SERVER_BOUND, DATA_BOUND, INPUT_BOUND, TARGET_BOUND,
                                    DRAFTER_BOUND, BALANCED)
#: the overlays, strongest first: CPU-starved wins over GIL-bound, whose probe (a sleeping thread's
#: lateness) also counts waiting for a core; both win over launch-bound, since a thread kept off a core or
#: queued for the GIL also leaves its GPU idle, and the cause is then the machine or the lock
OVERLAY_ORDER: tuple[Verdict, ...] = (CPU_STARVED, GIL_BOUND, LAUNCH_BOUND)


def first_stage_verdict(evidence: Evidence) -> Verdict:
    """The stage verdict this evidence decides."""
    return next(v for v in STAGE_ORDER if v.holds(evidence))


def style_of(name: str) -> str:
    return VERDICTS[name].style if name in VERDICTS else UNRECOGNISED_STYLE


def agrees_with_evidence(name: str, evidence: Evidence) -> bool:
    """Whether a verdict follows from its own evidence by its rule (for tests and the stability
    benchmark: a verdict shown beside numbers that say otherwise is a contradiction); a verdict this
    table does not know agrees with nothing."""
    return name in VERDICTS and VERDICTS[name].holds(evidence)
