"""The words the trainer and its readers share: categories, worker roles, verdicts, gauge names.

They cross process boundaries (the trainer names them, the wire carries them, Prometheus, the trackers,
`dflash stats` and dflash-top read them), so each is written once, here. Part of the wire: dflash-top
imports it, so it imports nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

# --- categories ------------------------------------------------------------------------------------

#: the trainer's own timing categories, in pipeline order (also the TUI's display order)
CATEGORIES = ("batch_queue_wait", "target_forward", "pack_hidden", "hs_queue_put", "hs_queue_wait", "h2d",
              "drafter_forward", "drafter_backward", "optimizer_step", "checkpoint", "eval")
#: a hidden-states cache's: read in place of target_forward (cache_read), waited for when following a
#: directory still being written (cache_wait), written by `dflash data cache` (cache_write)
CACHE_CATEGORIES = ("cache_wait", "cache_read", "cache_write")
#: what only a sampled view (`dflash-top --pid`, stacks read from outside) tells apart: a thread in a
#: collective (torch.distributed, waiting for the other ranks), one waiting for the device on the host
#: (a stream/event synchronize, `.item()`: seen with native frames), one with nothing to do
SAMPLED_CATEGORIES = ("collective_wait", "host_sync", "idle_wait")
#: categories that are not training: time spent in them pauses the pipeline
PAUSE_CATEGORIES = ("eval",)
#: a category named with one of these waits (on a queue, for a file not yet written): time a worker is
#: neither working nor asking for a CPU, and a consequence of another stage's speed
WAIT_SUFFIXES = ("_wait", "_put")
#: a role's working share: what it does when it is not waiting on a queue
TARGET_BUSY = ("target_forward", "cache_read", "pack_hidden", "h2d")
DRAFTER_BUSY = ("drafter_forward", "drafter_backward", "optimizer_step", "h2d")


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


# --- the bottleneck verdicts -----------------------------------------------------------------------

#: a wait above this share of a worker's wall time counts as starving/blocked
THRESHOLD = 0.20
#: below this much timed work per pipeline worker there is nothing to judge (start-up, eval pauses)
MIN_TRACKED = 0.05
#: the published verdict judges this many seconds of recent windows merged, not one window
VERDICT_SPAN_S = 10.0
#: a GIL-bound verdict needs the process to run on no more than this many cores (CPU percent): threads
#: limited by the GIL run one at a time, so a process using more is computing in parallel, whatever the
#: probe says (a sleep probe on an oversubscribed machine also counts waiting for a core)
GIL_BOUND_MAX_CPU = 150.0
#: ... and on at least this much of one: one thread holds the GIL and runs, so a process far below one
#: core while its threads "wait" was waiting for a CPU, not for the lock (the probe cannot tell them apart)
GIL_BOUND_MIN_CPU = 70.0
#: workers that ran on a CPU less than this fraction of the time they were busy were kept off the cores
STARVED_RATIO = 0.5
#: ... while busy at least THRESHOLD of their time (workers that mostly wait are not limited by a CPU) ...
#: ... by other processes using at least this many cores, with fewer than this many left idle
STARVED_OTHERS_CORES = 0.5
STARVED_IDLE_CORES = 0.5
#: a new verdict shows once it has won this many judgements (one per window) in a row
HOLD_WINDOWS = 3


@dataclass(frozen=True)
class Verdict:
    """One verdict: its name (on the wire, a Prometheus label value, a tracker key) and what it means."""

    name: str
    meaning: str

    @property
    def tracker_key(self) -> str:
        """The verdict's one-hot scalar in TensorBoard / W&B."""
        return f"bottleneck/{self.name}"


_T, _M = f"{THRESHOLD:.0%}", f"{MIN_TRACKED:.0%}"
DATA_BOUND = Verdict("data-bound", f"targets wait >= {_T} of their time for batches (batch_queue_wait), at "
                     "least as much as they block on puts: the batch producer limits throughput.")
TARGET_BOUND = Verdict("target-bound", f"drafters wait >= {_T} for hidden states (hs_queue_wait), more than "
                       "targets block: the target forward limits throughput.")
DRAFTER_BOUND = Verdict("drafter-bound", f"targets spend >= {_T} blocked on a full hidden-state queue "
                        "(hs_queue_put), more than drafters wait: drafter training limits throughput.")
GIL_BOUND = Verdict("GIL-bound", "a probe thread waits half its time or more for the interpreter lock, the "
                    "process runs on about one core and its workers' CPU time matches their busy time: "
                    "Python threads take turns, so the bounding stage is limited by the GIL, not by compute.")
CPU_STARVED = Verdict("CPU-starved", "the workers are busy far longer than they get a CPU (their CPU time is "
                      "well below their busy time) while other processes use the machine's cores: the "
                      "machine, not the pipeline, limits throughput.")
INPUT_BOUND = Verdict("input-bound", f"the hidden-states reader waits >= {_T} for files not yet written "
                      "(cache_wait, --follow), at least as much as it blocks on puts: the engine or `dflash data "
                      "cache` writing the cache limits throughput (waiting for hidden states).")
BALANCED = Verdict("balanced", f"no stage waits {_T} or more of its time.")
UNKNOWN = Verdict("unknown", f"less than {_M} timed work per pipeline worker (start-up, a pause) or no "
                  "pipeline workers.")

#: every verdict the analysis can return, in the order help and exports list them
VERDICTS: dict[str, Verdict] = {v.name: v for v in (DATA_BOUND, INPUT_BOUND, TARGET_BOUND, DRAFTER_BOUND,
                                                    GIL_BOUND, CPU_STARVED, BALANCED, UNKNOWN)}


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
TELEMETRY_LOOPS = ("dflash/telemetry/server.py", "dflash/telemetry/gil.py", "dflash/telemetry/cluster.py",
                   "dflash/telemetry/watchdog.py")
