"""The words the trainer and its readers share: categories, worker roles, verdicts, gauge and counter
names.

They cross process boundaries (the trainer names them, the wire carries them, Prometheus, the trackers,
`dflash stats` and dflash-top read them), so each is written once, here. Part of the wire: dflash-top
imports it, so it imports nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

# --- categories ------------------------------------------------------------------------------------

#: the trainer's own timing categories, in pipeline order (also the TUI's display order), then those added
#: since (at the end: a category's colour is its place here, and colours stay what users learnt)
CATEGORIES = ("batch_queue_wait", "target_forward", "pack_hidden", "hs_queue_put", "hs_queue_wait", "h2d",
              "drafter_forward", "drafter_backward", "optimizer_step", "checkpoint", "eval", "reorder_wait")
#: a hidden-states cache's: read in place of target_forward (cache_read), waited for when following a
#: directory still being written (cache_wait), written by `dflash data cache` (cache_write)
CACHE_CATEGORIES = ("cache_wait", "cache_read", "cache_write")
#: the objective's own work on the drafter's worker, timed apart from drafter_forward (spans of two
#: categories add up, they do not nest): the verifier's logits an objective compares with (--loss kl: the
#: target's final state through its norm and head), and a DFlash2 drafter's candidate selector (its
#: loss's forward; its backward is inside drafter_backward)
SELECTOR = "selector"
OBJECTIVE_CATEGORIES = ("verifier_logits", SELECTOR)
#: a regenerate job's (`dflash data regenerate`): on an endpoint's worker, each request from sending it to
#: its answer (the server's time; requests overlap, so its share, capped at all of the time, says how much
#: of it the endpoint had requests, and the in-flight gauges how many); on
#: the client's worker, its own work (building requests, reading answers, tokenizing) and the durable
#: writes of finished rows
SERVER_REQUEST, CLIENT_WORK, ROW_WRITE = "server_request", "client_work", "row_write"
#: the in-process regenerate job's (no --endpoint): the target writing a batch's answers, on its one worker
#: beside row_write
GENERATE = "generate"
REGEN_CATEGORIES = (SERVER_REQUEST, CLIENT_WORK, ROW_WRITE, GENERATE)
#: the regenerate client's busy categories (what its one thread does that is not waiting for a server)
CLIENT_BUSY = (CLIENT_WORK, ROW_WRITE)
#: what only a sampled view (`dflash-top --pid`, stacks read from outside) tells apart: a thread in a
#: collective (torch.distributed, waiting for the other ranks), one waiting for the device on the host
#: (a stream/event synchronize, `.item()`: seen with native frames), one with nothing to do; and, with
#: native frames, a thread feeding the GPU rather than waiting for it: launching kernels (the CUDA
#: runtime and driver, torch's CUDA ops on the host) or in the caching allocator (mapping and freeing
#: segments)
KERNEL_LAUNCH, ALLOCATOR = "kernel_launch", "allocator"
SAMPLED_CATEGORIES = ("collective_wait", "host_sync", "idle_wait", KERNEL_LAUNCH, ALLOCATOR)
#: categories that are not training: time spent in them pauses the pipeline
PAUSE_CATEGORIES = ("eval",)
#: a category named with one of these waits (on a queue, for a file not yet written): time a worker is
#: neither working nor asking for a CPU, and a consequence of another stage's speed
WAIT_SUFFIXES = ("_wait", "_put")
#: a role's working share: what it does when it is not waiting on a queue
TARGET_BUSY = ("target_forward", "cache_read", "pack_hidden", "h2d")
DRAFTER_BUSY = ("drafter_forward", *OBJECTIVE_CATEGORIES, "drafter_backward", "optimizer_step", "h2d")


# --- worker roles ----------------------------------------------------------------------------------

class Role(StrEnum):
    """What a worker does in the pipeline; a worker names its role when it registers
    (`ProfileStats.worker(name, role)`), and snapshots carry it, so the verdict never guesses from a name."""

    #: produces hidden states: a target forward in process, or a reader of a hidden-states cache
    TARGET = "target"
    #: trains the drafter
    DRAFTER = "drafter"
    #: builds batches
    DATA = "data"
    #: a regenerate job's view of one serving endpoint (requests sent to it; no thread of its own)
    ENDPOINT = "endpoint"
    #: a regenerate job's own thread: builds requests, reads answers, writes rows
    CLIENT = "client"


def legacy_role(worker: str) -> Role | None:
    """The role of a worker in a recording written before snapshots carried roles, from the names
    trainers of that time gave their threads; only for frames without a `roles` map."""
    for prefix, role in (("target", Role.TARGET), ("drafter", Role.DRAFTER), ("batch-producer", Role.DATA)):
        if worker.startswith(prefix):
            return role
    return None


def roles_of(workers: Iterable[str], roles: Mapping[str, str] | None) -> dict[str, Role | None]:
    """Each worker's role as it registered it (a snapshot's `roles`); a recording from before roles were
    on the wire (no `roles` at all) falls back to its thread names."""
    if not roles:
        return {w: legacy_role(w) for w in workers}
    known = {r.value for r in Role}
    return {w: Role(roles[w]) if roles.get(w) in known else None for w in workers}


# --- gauge names shared across processes -----------------------------------------------------------

class Gauge(StrEnum):
    """Gauges one process sets and another reads by name (the trainer -> dflash-top, Prometheus, stats)."""

    STEP = "step"
    LOSS = "loss"
    LR = "lr"
    GRAD_NORM = "grad_norm"
    BATCH_QUEUE = "batch_queue"
    HS_QUEUE = "hs_queue"
    #: training progress: seconds trained (evaluations excluded), the run's limits, fraction done, ETA
    TRAIN_TIME_S = "train_time_s"
    MAX_STEPS = "max_steps"
    MAX_TIME_S = "max_time_s"
    PROGRESS = "progress"
    ETA_S = "eta_s"
    #: an evaluation in progress: prompts done / total, its elapsed time and ETA
    EVAL_DONE = "eval_done"
    EVAL_TOTAL = "eval_total"
    EVAL_TIME_S = "eval_time_s"
    EVAL_ETA_S = "eval_eta_s"
    #: the GIL probe: share of its time waiting for the lock, and the mean wait
    GIL_CONTENTION = "gil_contention"
    GIL_WAIT_MS = "gil_wait_ms"
    NONFINITE_SKIPPED = "nonfinite_skipped"
    #: model FLOPs the run achieves, in TFLOP/s over the last 10 s of training (dflash/train/device/flops.py
    #: counts them per step from its real token counts), and where the devices' dense bf16 peak is known,
    #: that peak in TFLOP/s and the MFU it makes (a fraction: 0.41 is 41%); no `mfu` on the host or an
    #: unknown GPU, never a guessed peak
    TFLOPS = "tflops"
    MFU = "mfu"
    PEAK_TFLOPS = "peak_tflops"
    #: padded slots over all slots of the batches built so far (a batch pads to its longest row; length
    #: buckets keep it low), counted where they are built (BatchSource, on the batch producer's thread)
    PADDING_SHARE = "padding_share"
    #: the length limit's toll, set once at the start from the token store: the limit in tokens, the samples
    #: longer than it (cut, not dropped) and the share of supervised tokens beyond it (0.22 is 22%)
    MAX_SEQ_LEN = "max_seq_len"
    CUT_SAMPLES = "cut_samples"
    CUT_SUPERVISED_SHARE = "cut_supervised_share"
    #: a regenerate job's requests in flight (all endpoints) and its --concurrency; per endpoint i the
    #: gauges endpoint_gauge(i, IN_FLIGHT) and endpoint_gauge(i, TOK_S) (tokens written per second)
    IN_FLIGHT = "in_flight"
    CONCURRENCY = "concurrency"
    TOK_S = "tok_s"


class Counter(StrEnum):
    """Counters (a snapshot's ``counters``: totals since the start, rates per window) one process adds to
    and another reads by name."""

    STEPS = "steps"
    TOKENS = "tokens"
    #: rows of the batches trained on
    SAMPLES = "samples"
    #: the tokens the loss was taken over (the anchors' blocks, masked positions left out)
    SUPERVISED_TOKENS = "supervised_tokens"
    #: sample files of a hidden-states cache that did not read and were skipped (each warned once)
    BAD_SAMPLES = "bad_samples"
    #: a regenerate job's: rows written, rows that failed (in the errors file), requests retried, rows
    #: whose answer --max-tokens cut (tokens written go to TOKENS)
    ROWS = "rows"
    ROW_ERRORS = "row_errors"
    RETRIES = "retries"
    CUT_ROWS = "cut_rows"


#: the caching allocator's driver calls per second on CUDA device i, gauges `cuda<i>_<name>` (device_gauge):
#: segments mapped or allocated (cuMemMap, cudaMalloc) and unmapped or freed (cuMemUnmap, cudaFree). A cache
#: in steady state makes none; the main thread reads them once per telemetry interval, never a worker
SEGMENT_MAPS_PER_S = "segment_maps_per_s"
SEGMENT_FREES_PER_S = "segment_frees_per_s"


def device_gauge(index: int, name: str) -> str:
    """The gauge `name` of CUDA device `index` (`cuda0_segment_maps_per_s`)."""
    return f"cuda{index}_{name}"


def device_gauges(gauges: Mapping[str, float], name: str) -> dict[int, float]:
    """Each CUDA device's value of the per-device gauge `name`, by device index."""
    out = {}
    for key, value in gauges.items():
        head, sep, tail = key.partition("_")
        if sep and tail == name and head.startswith("cuda") and head[4:].isdigit():
            out[int(head[4:])] = value
    return out


def endpoint_gauge(index: int, name: str) -> str:
    """The gauge `name` of a regenerate job's endpoint `index` (`endpoint0_in_flight`)."""
    return f"endpoint{index}_{name}"


#: an objective term's gauge is this prefix and the term's name (`loss_ce`, `loss_kl`): each term of the
#: objective before its weight, beside the total `loss`
TERM_GAUGE_PREFIX = "loss_"


def term_gauge(term: str) -> str:
    """The gauge of objective term ``term``."""
    return TERM_GAUGE_PREFIX + term


def loss_terms(gauges: Mapping[str, float]) -> dict[str, float]:
    """The objective's terms among ``gauges``, by term name, in the order the trainer set them."""
    return {k[len(TERM_GAUGE_PREFIX):]: v for k, v in gauges.items() if k.startswith(TERM_GAUGE_PREFIX)}


def evaluating(gauges: Mapping[str, float]) -> bool:
    """Whether these gauges say an evaluation is under way (training paused)."""
    done, total = gauges.get(Gauge.EVAL_DONE), gauges.get(Gauge.EVAL_TOTAL)
    return done is not None and total is not None and done < total


# --- dflash's own threads --------------------------------------------------------------------------

#: the monitor's own threads (the publisher, the GIL probe, the cluster exchange, the stall dumper):
#: marked in dflash-top's threads panel and left out of py-spy summaries, so the monitor's work is not
#: read as the trainer's
PUBLISHER_THREAD = "dflash-telemetry"
GIL_PROBE_THREAD = "dflash-gil-probe"
CLUSTER_THREAD = "telemetry-cluster"
STALL_DUMP_THREAD = "dflash-stall-dump"
TELEMETRY_THREADS = (PUBLISHER_THREAD, GIL_PROBE_THREAD, CLUSTER_THREAD, STALL_DUMP_THREAD)
#: the modules whose loops those threads run: a sampled stack through one of them is the monitor's own
#: (workers never call into them; their spans live in stats.py)
TELEMETRY_LOOPS = ("dflash/telemetry/publish/server.py", "dflash/telemetry/verdict/gil.py",
                   "dflash/telemetry/export/cluster.py", "dflash/telemetry/verdict/watchdog.py")
