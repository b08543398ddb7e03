"""Which pipeline stage bounds throughput, decided from per-worker time shares.

The pipeline is data -> target workers -> hidden-state queue -> drafter workers. In steady state the
slowest stage runs flat out and the stages next to it wait on the queues between them, so the waits
name the bottleneck:

* targets waiting for batches (`batch_queue_wait`)         -> data-bound
* drafters waiting for hidden states (`hs_queue_wait`)     -> target-bound
* targets blocked putting hidden states (`hs_queue_put`)   -> drafter-bound

A slow data stage starves the targets and, through them, the drafters too; so when targets starve
for batches at least as much as they block on puts, the verdict is data-bound even if the drafters
also wait. The rules are documented in docs/telemetry.md; torch-free on purpose (dflash-top and
`dflash stats` run it on recordings).

On a GPU the waits lie: a worker that never synchronises returns from its forward as soon as the
kernels are queued, so the slow GPU's worker sits in `hs_queue_put` while the other one's time goes
into launches queued behind it. What tells the truth there is device time (CUDA events on each
worker's own stream): where a stage has it, its busy share is the share of wall time its stream
spent in its spans, and the verdict names the stage whose device is busier; a stage without device
time (on the CPU, where compute is synchronous) counts its host time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from dflash.telemetry.wire import vocab
from dflash.telemetry.wire.protocol import Bottleneck, CategoryStats
from dflash.telemetry.wire.table import busy_share
from dflash.telemetry.wire.vocab import (
    DRAFTER_BUSY,
    GIL_BOUND_MAX_CPU,
    GIL_BOUND_MIN_CPU,
    HOLD_WINDOWS,
    MIN_TRACKED,
    STARVED_IDLE_CORES,
    STARVED_OTHERS_CORES,
    STARVED_RATIO,
    TARGET_BUSY,
    THRESHOLD,
    Role,
    roles_of,
)

#: GIL contention (share of a probe thread's time spent waiting for the GIL, dflash/telemetry/gil.py)
#: from which the interpreter lock, not compute, limits the stage that bounds throughput
GIL_BOUND = 0.5


@dataclass(frozen=True)
class CpuFigures:
    """What the machine gave the pipeline over the judged time (dflash.telemetry.system's samples)."""

    #: mean share of wall time a pipeline worker's thread ran on a CPU
    worker_cpu: float
    #: mean share of wall time a pipeline worker was busy (in spans that are not queue waits)
    worker_busy: float
    cores: int
    #: cores other processes used, and cores nobody used (means over the judged time)
    others_cores: float
    idle_cores: float
    load1: float = 0.0
    steal_cores: float | None = None



def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _share(cats: Mapping[str, CategoryStats], names: tuple[str, ...]) -> float:
    return sum(cats[n].share for n in names if n in cats)


def _device(cats: Mapping[str, CategoryStats], names: tuple[str, ...]) -> float | None:
    """Share of wall time the worker's stream spent in these categories; None without device time.

    Device stats without a share (recordings from before the field existed) count as none, so an old
    recording is judged as it was when recorded."""
    dev = [cats[n].device for n in names if n in cats and cats[n].device is not None and cats[n].device.share > 0]
    return min(1.0, sum(d.share for d in dev)) if dev else None


def _busy(cats: Mapping[str, CategoryStats], names: tuple[str, ...]) -> float:
    """Device busy share where the worker has device time, else host busy share."""
    dev = _device(cats, names)
    return dev if dev is not None else min(1.0, _share(cats, names))


def analyze(
    workers: Mapping[str, Mapping[str, CategoryStats]], roles: Mapping[str, str] | None = None,
    threshold: float = THRESHOLD, steps: float | None = None,
) -> Bottleneck:
    """The bottleneck verdict for one window (or a merged range) of per-worker stats; `roles` maps each
    worker to its Role (a snapshot's or summary's `roles`); `steps`: the training steps in the same
    window, for each stage's device milliseconds per step."""
    by_role: dict[Role, list[Mapping[str, CategoryStats]]] = {r: [] for r in Role}
    for name, role in roles_of(workers, roles).items():
        if role is not None:
            by_role[role].append(workers[name])
    targets, drafters, data = by_role[Role.TARGET], by_role[Role.DRAFTER], by_role[Role.DATA]

    target_starve = _mean([_share(c, ("batch_queue_wait",)) for c in targets])
    target_blocked = _mean([_share(c, ("hs_queue_put",)) for c in targets])
    drafter_starve = _mean([_share(c, ("hs_queue_wait",)) for c in drafters])
    input_starve = _mean([_share(c, ("cache_wait",)) for c in targets])  # a followed cache not yet written
    evidence = {
        "target.batch_queue_wait": round(target_starve, 4),
        "target.hs_queue_put": round(target_blocked, 4),
        "drafter.hs_queue_wait": round(drafter_starve, 4),
        "target.cache_wait": round(input_starve, 4),
        "target.busy": round(_mean([_share(c, TARGET_BUSY) for c in targets]), 4),
        "drafter.busy": round(_mean([_share(c, DRAFTER_BUSY) for c in drafters]), 4),
        "targets": float(len(targets)),
        "drafters": float(len(drafters)),
        "threshold": threshold,
    }
    if data:
        # busy = not blocked: the producer spends most of a healthy run waiting on a full batch queue
        evidence["data.busy"] = round(_mean([busy_share(c) for c in data]), 4)

    pipeline = targets + drafters
    tracked = _mean([sum(cs.share for cs in c.values()) for c in pipeline])
    if not pipeline or tracked < MIN_TRACKED:
        why = (
            "no target or drafter workers reported timings"
            if not pipeline
            else f"too little timed work to judge ({tracked:.0%} of pipeline workers' time)"
        )
        return Bottleneck(verdict=vocab.UNKNOWN.name, reason=why, evidence=evidence)

    def judged(verdict: vocab.Verdict, reason: str) -> Bottleneck:
        return Bottleneck(verdict=verdict.name, reason=reason, evidence=evidence)

    if targets and target_starve >= threshold and target_starve >= target_blocked:
        return judged(vocab.DATA_BOUND, f"targets wait {target_starve:.0%} of their time for batches "
                      "(batch_queue_wait): the data producer (one thread) limits throughput; make batch building cheaper")
    if targets and input_starve >= threshold and input_starve >= target_blocked:
        return judged(vocab.INPUT_BOUND, f"waiting for hidden states: the cache reader waits {input_starve:.0%} of "
                      "its time for files not yet written (cache_wait); the engine or `dflash data cache` writing "
                      "them limits throughput")
    has_device = any(_device(c, TARGET_BUSY) is not None for c in targets) or any(
        _device(c, DRAFTER_BUSY) is not None for c in drafters)
    if targets and drafters and has_device:
        return _by_device_time(targets, drafters, threshold, evidence, steps)
    if max(drafter_starve, target_blocked) >= threshold:
        if drafters and drafter_starve >= target_blocked:
            return judged(vocab.TARGET_BOUND, f"drafters wait {drafter_starve:.0%} of their time for hidden states "
                          f"(hs_queue_wait) while targets block only {target_blocked:.0%}: the target forward limits "
                          "throughput; add target workers/GPUs (--target-devices) or batch the target more")
        return judged(vocab.DRAFTER_BOUND, f"targets spend {target_blocked:.0%} of their time blocked on a full "
                      f"hidden-state queue (hs_queue_put) while drafters wait only {drafter_starve:.0%}: drafter "
                      "training limits throughput; make the drafter step cheaper (fewer anchors or drafter layers) "
                      "or add ranks (--nproc, torchrun), each with its own drafter")
    worst = max(
        ("batch_queue_wait", target_starve), ("hs_queue_wait", drafter_starve), ("hs_queue_put", target_blocked),
        key=lambda kv: kv[1],
    )
    return judged(vocab.BALANCED, f"no stage waits more than {threshold:.0%} of its time (largest: {worst[0]} "
                  f"{worst[1]:.0%})")


class SteadyVerdict:
    """Hysteresis for the judged verdict: the published verdict changes only once another has won
    `hold` judgements in a row, so shares wobbling around a threshold do not flip it. The first real
    verdict, and any verdict after "unknown" (start-up, an evaluation pause), is taken at once: there is
    nothing to hold then. A held verdict keeps the reason and evidence it was last judged on (so the
    two never disagree) and says in its scope what the newer judgements look like."""

    def __init__(self, hold: int = HOLD_WINDOWS) -> None:
        self.hold = hold
        self.current: Bottleneck | None = None
        self._challenger: str | None = None
        self._wins = 0

    def update(self, raw: Bottleneck) -> Bottleneck:
        cur = self.current
        if cur is None or cur.verdict == vocab.UNKNOWN.name or raw.verdict == cur.verdict:
            self._challenger, self._wins = None, 0
            self.current = raw
            return raw
        if raw.verdict == self._challenger:
            self._wins += 1
        else:
            self._challenger, self._wins = raw.verdict, 1
        if self._wins >= self.hold:
            self._challenger, self._wins = None, 0
            self.current = raw
            return raw
        # Held: the standing verdict with its own numbers, and why it stands.
        scope = f"{cur.scope}; " if cur.scope else ""
        return msgspec.structs.replace(cur, scope=f"{scope}held: the latest judgement looks {raw.verdict}, "
                                                  f"{self._wins} of {self.hold} in a row needed to change")


def gil_bound(b: Bottleneck, contention: float | None, cpu_percent: float | None = None,
              threshold: float = GIL_BOUND) -> Bottleneck:
    """The verdict, turned into "GIL-bound" when Python threads queue for the interpreter lock while
    the process runs on about one core: then the stage that looks slowest is slow because its thread
    waits for the GIL, and more compute (GPUs, workers) would not help; less Python per step, or
    processes, would."""
    if contention is None or contention < threshold or b.verdict == vocab.UNKNOWN.name:
        return b
    if cpu_percent is not None and not GIL_BOUND_MIN_CPU <= cpu_percent <= GIL_BOUND_MAX_CPU:
        return b
    evidence = {**b.evidence, "gil_contention": round(contention, 4)}
    if cpu_percent is not None:
        evidence["process_cpu_percent"] = round(cpu_percent, 1)
    stage = b.verdict.removesuffix("-bound")
    return Bottleneck(
        verdict=vocab.GIL_BOUND.name,
        reason=(f"a thread that wants the GIL waits {contention:.0%} of its time for it: Python threads queue "
                f"for the interpreter lock, so the {stage} stage ({b.verdict} by its waits) is limited by the GIL, "
                "not by compute; move Python work out of the step (fewer small ops, CUDA graphs) or use "
                "processes (--nproc)"),
        evidence=evidence,
    )


def _device_seconds(workers: list[Mapping[str, CategoryStats]], names: tuple[str, ...]) -> float:
    """Device time the workers' streams spent in these categories, all workers together."""
    return sum(c[n].device.total for c in workers for n in names if n in c and c[n].device is not None)


def _by_device_time(targets: list[Mapping[str, CategoryStats]], drafters: list[Mapping[str, CategoryStats]],
                    threshold: float, evidence: dict[str, float], steps: float | None = None) -> Bottleneck:
    """The verdict once device time exists: the stage whose device is busier by ``threshold`` bounds
    the pipeline (the other one idles that much of the time waiting for it).

    Shares that sum past 1 overlapped in time: target and drafter on one GPU, each on its own stream,
    run their kernels side by side, and each stage's span also covers the time the other's kernels
    held the GPU. That overlap (at least the excess over 1) is counted in both shares alike, so their
    difference is still the difference of the time each stage ran without the other, and the rule
    compares exactly that; the reason says how much of the time was shared instead of showing shares
    that add up to more than the whole as if they did not."""
    t_busy = _mean([_busy(c, TARGET_BUSY) for c in targets])
    d_busy = _mean([_busy(c, DRAFTER_BUSY) for c in drafters])
    overlap = max(0.0, t_busy + d_busy - 1.0)
    evidence.update({"target.device_busy": round(t_busy, 4), "drafter.device_busy": round(d_busy, 4),
                     "device.overlap": round(overlap, 4), "device_time": 1.0})
    figures = f"target stage busy {t_busy:.0%} of the time, drafter stage {d_busy:.0%} (device time from CUDA events)"
    if overlap > 0:
        figures += (f", both at once at least {overlap:.0%} of it (on a shared GPU each stage counts that time; "
                    f"apart from it the target ran {t_busy - overlap:.0%}, the drafter {d_busy - overlap:.0%})")
    if steps:
        t_ms = _device_seconds(targets, TARGET_BUSY) / steps * 1e3
        d_ms = _device_seconds(drafters, DRAFTER_BUSY) / steps * 1e3
        evidence.update({"target.device_ms_per_step": round(t_ms, 3), "drafter.device_ms_per_step": round(d_ms, 3)})
        if overlap > 0:
            figures += f"; per step the target's kernels spanned {t_ms:.1f} ms, the drafter's {d_ms:.1f} ms"
    if t_busy - d_busy >= threshold:
        return Bottleneck(verdict=vocab.TARGET_BOUND.name, reason=f"{figures}: the target forward limits throughput; add "
                          "target workers/GPUs (--target-devices) or batch the target more", evidence=evidence)
    if d_busy - t_busy >= threshold:
        return Bottleneck(verdict=vocab.DRAFTER_BOUND.name, reason=f"{figures}: drafter training limits throughput; make the "
                          "drafter step cheaper (fewer anchors or drafter layers) or add ranks (--nproc, torchrun)",
                          evidence=evidence)
    return Bottleneck(verdict=vocab.BALANCED.name, reason=f"{figures}: within {threshold:.0%} of each other", evidence=evidence)


def cpu_starved(b: Bottleneck, cpu: CpuFigures | None) -> Bottleneck:
    """The verdict, turned into "CPU-starved" when the workers ran on a CPU far less than they were busy
    while other processes took the cores: the stage that looks slowest is slow because it waits for a
    core, which neither the pipeline's settings nor the GIL explain. Wins over GIL-bound, whose probe
    (a sleeping thread's lateness) also counts waiting for a core."""
    if cpu is None or b.verdict == vocab.UNKNOWN.name or cpu.worker_busy < THRESHOLD:
        return b
    starved = (cpu.worker_cpu < STARVED_RATIO * cpu.worker_busy and cpu.others_cores >= STARVED_OTHERS_CORES
               and cpu.idle_cores < STARVED_IDLE_CORES)
    if not starved:
        return b
    evidence = {**b.evidence, "workers.cpu": round(cpu.worker_cpu, 4), "workers.busy": round(cpu.worker_busy, 4),
                "machine.other_cores": round(cpu.others_cores, 2), "machine.idle_cores": round(cpu.idle_cores, 2),
                "machine.cores": float(cpu.cores)}
    return Bottleneck(
        verdict=vocab.CPU_STARVED.name,
        reason=(f"other processes use {cpu.others_cores:.1f} of {cpu.cores} cores: the workers ran on a CPU "
                f"{cpu.worker_cpu:.0%} of the time while busy {cpu.worker_busy:.0%}, so the "
                f"{b.verdict.removesuffix('-bound')} stage ({b.verdict} by its waits) waits for a core; free "
                "cores (stop other jobs) or use fewer threads (--threads-per-worker)"),
        evidence=evidence,
    )


def agrees_with_evidence(b: Bottleneck) -> bool:
    """Whether the verdict follows from its own evidence by the rules above (for tests and the
    stability benchmark: a verdict shown beside numbers that say otherwise is a contradiction)."""
    e, t = b.evidence, b.evidence.get("threshold", THRESHOLD)
    starve, put, wait = (e.get("target.batch_queue_wait", 0.0), e.get("target.hs_queue_put", 0.0),
                         e.get("drafter.hs_queue_wait", 0.0))
    device = e.get("device_time") == 1.0
    gap = e.get("target.device_busy", 0.0) - e.get("drafter.device_busy", 0.0)
    checks = {
        vocab.UNKNOWN.name: True,
        vocab.DATA_BOUND.name: starve >= t and starve >= put,
        vocab.INPUT_BOUND.name: e.get("target.cache_wait", 0.0) >= t and e.get("target.cache_wait", 0.0) >= put,
        vocab.TARGET_BOUND.name: gap >= t if device else wait >= t and wait >= put,
        vocab.DRAFTER_BOUND.name: -gap >= t if device else put >= t and put >= wait,
        vocab.BALANCED.name: abs(gap) < t if device else max(starve, put, wait) < t,
        vocab.GIL_BOUND.name: e.get("gil_contention", 0.0) >= GIL_BOUND,
        vocab.CPU_STARVED.name: (e.get("workers.busy", 0.0) >= t
                                 and e.get("workers.cpu", 1.0) < STARVED_RATIO * e.get("workers.busy", 0.0)),
    }
    return checks.get(b.verdict, False)  # a verdict without a rule here agrees with nothing
