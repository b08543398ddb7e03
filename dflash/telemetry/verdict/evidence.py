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

from dflash.telemetry.wire import verdicts as V
from dflash.telemetry.wire.protocol import Bottleneck, CategoryStats, SystemSample
from dflash.telemetry.wire.table import busy_share
from dflash.telemetry.wire.vocab import CLIENT_BUSY, DRAFTER_BUSY, SERVER_REQUEST, TARGET_BUSY, Role, roles_of


@dataclass(frozen=True)
class CpuFigures:
    """What the machine gave the pipeline over the judged time (dflash.telemetry.wire.system's samples)."""

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
    threshold: float = V.THRESHOLD, steps: float | None = None,
) -> Bottleneck:
    """The bottleneck verdict for one window (or a merged range) of per-worker stats; `roles` maps each
    worker to its Role (a snapshot's or summary's `roles`); `steps`: the training steps in the same
    window, for each stage's device milliseconds per step."""
    by_role: dict[Role, list[Mapping[str, CategoryStats]]] = {r: [] for r in Role}
    for name, role in roles_of(workers, roles).items():
        if role is not None:
            by_role[role].append(workers[name])
    targets, drafters, data = by_role[Role.TARGET], by_role[Role.DRAFTER], by_role[Role.DATA]
    if by_role[Role.ENDPOINT] and not (targets or drafters):
        evidence = _regen_evidence(by_role[Role.ENDPOINT], by_role[Role.CLIENT], threshold)
        verdict = V.first_stage_verdict(evidence)
        return Bottleneck(verdict=verdict.name, reason=verdict.reason(evidence), evidence=evidence)

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
    evidence["pipeline.tracked"] = round(_mean([sum(cs.share for cs in c.values()) for c in pipeline]), 4)
    if targets and drafters and (any(_device(c, TARGET_BUSY) is not None for c in targets)
                                 or any(_device(c, DRAFTER_BUSY) is not None for c in drafters)):
        evidence.update(_device_evidence(targets, drafters, steps))
    verdict = V.first_stage_verdict(evidence)
    return Bottleneck(verdict=verdict.name, reason=verdict.reason(evidence), evidence=evidence)


def _regen_evidence(endpoints: list[Mapping[str, CategoryStats]], clients: list[Mapping[str, CategoryStats]],
                    threshold: float) -> dict[str, float]:
    """A regenerate job's evidence: how busy its client thread is (the share of its time not spent waiting
    for answers), how much of the time the endpoints had requests (each one's request time over wall time,
    at most all of it: requests overlap; the gauges count those in flight) and the slowest p95 request."""
    p95 = [c[SERVER_REQUEST].p95 for c in endpoints if SERVER_REQUEST in c and c[SERVER_REQUEST].n]
    return {
        "endpoints": float(len(endpoints)),
        "client.busy": round(_mean([min(1.0, _share(c, CLIENT_BUSY)) for c in clients]), 4),
        "client.tracked": round(_mean([sum(cs.share for cs in c.values()) for c in clients]), 4),
        "endpoints.busy": round(_mean([min(1.0, _share(c, (SERVER_REQUEST,))) for c in endpoints]), 4),
        "server.p95_s": round(max(p95), 4) if p95 else 0.0,
        "threshold": threshold,
    }


def gil_bound(b: Bottleneck, contention: float | None, cpu_percent: float | None = None) -> Bottleneck:
    """The verdict, turned into "GIL-bound" when Python threads queue for the interpreter lock while
    the process runs on about one core: then the stage that looks slowest is slow because its thread
    waits for the GIL, and more compute (GPUs, workers) would not help; less Python per step, or
    processes, would."""
    if contention is None or b.verdict == V.UNKNOWN.name:
        return b
    evidence = {**b.evidence, "gil_contention": round(contention, 4)}
    if cpu_percent is not None:
        evidence["process_cpu_percent"] = round(cpu_percent, 1)
    return _overlaid(b, V.GIL_BOUND, evidence)


def cpu_starved(b: Bottleneck, cpu: CpuFigures | None) -> Bottleneck:
    """The verdict, turned into "CPU-starved" when the workers ran on a CPU far less than they were busy
    while other processes took the cores: the stage that looks slowest is slow because it waits for a
    core, which neither the pipeline's settings nor the GIL explain."""
    if cpu is None or b.verdict == V.UNKNOWN.name:
        return b
    evidence = {**b.evidence, "workers.cpu": round(cpu.worker_cpu, 4), "workers.busy": round(cpu.worker_busy, 4),
                "machine.other_cores": round(cpu.others_cores, 2), "machine.idle_cores": round(cpu.idle_cores, 2),
                "machine.cores": float(cpu.cores)}
    return _overlaid(b, V.CPU_STARVED, evidence)


def launch_bound(b: Bottleneck, gpu_busy: Mapping[str, float] | None) -> Bottleneck:
    """The verdict, turned into "launch-bound" when the bounding stage's thread is busy while its GPU idles:
    the GPU waits on the host launching kernels, so more GPUs would not help and fewer, bigger kernels
    would. `gpu_busy`: each stage's ("target", "drafter") GPU kernel share (`stage_gpu_busy`)."""
    if not gpu_busy or b.verdict == V.UNKNOWN.name:
        return b
    evidence = {**b.evidence, **{f"{stage}.gpu_busy": round(v, 4) for stage, v in gpu_busy.items()}}
    return _overlaid(b, V.LAUNCH_BOUND, evidence)


def gpu_kernel_shares(system: SystemSample | None) -> dict[int, float]:
    """CUDA ordinal -> share of the window the trainer's kernels ran on that GPU, from NVML: the process's
    own utilisation where NVML keeps it, else the whole GPU's (which can only be higher: a bound that keeps
    the launch-bound rule sound). GPUs the trainer does not see, and MIG instances (no utilisation), are absent."""
    out: dict[int, float] = {}
    for g in system.gpus if system is not None else ():
        util = g.process_util if g.process_util is not None else g.util_percent
        if g.cuda_index is not None and util is not None:
            out[g.cuda_index] = min(1.0, max(0.0, util / 100.0))
    return out


def stage_gpu_busy(roles: Mapping[str, str] | None, devices: Mapping[str, int],
                   gpu: Mapping[int, float]) -> dict[str, float]:
    """Each stage's GPU kernel share: the mean over its workers on a GPU (`devices`, as they registered) of
    their GPU's share (`gpu`, by CUDA ordinal). Where stages share a GPU each one reads both stages'
    kernels: an upper bound of its own."""
    per: dict[Role, list[float]] = {Role.TARGET: [], Role.DRAFTER: []}
    for worker, role in roles_of(devices, roles).items():
        if role in per and devices[worker] in gpu:
            per[role].append(gpu[devices[worker]])
    return {role.value: _mean(values) for role, values in per.items() if values}


def _overlaid(b: Bottleneck, overlay: V.Verdict, evidence: dict[str, float]) -> Bottleneck:
    """`overlay` in place of the stage verdict where its rule holds on the widened evidence, else `b` as it was."""
    if not overlay.holds(evidence):
        return b
    return Bottleneck(verdict=overlay.name, reason=overlay.reason(evidence, b.verdict), evidence=evidence)


def _device_seconds(workers: list[Mapping[str, CategoryStats]], names: tuple[str, ...]) -> float:
    """Device time the workers' streams spent in these categories, all workers together."""
    return sum(c[n].device.total for c in workers for n in names if n in c and c[n].device is not None)


def _device_evidence(targets: list[Mapping[str, CategoryStats]], drafters: list[Mapping[str, CategoryStats]],
                     steps: float | None) -> dict[str, float]:
    """Each stage's busy share once device time exists: the stage whose device is busier by the
    threshold bounds the pipeline (the other one idles that much of the time waiting for it).

    Shares that sum past 1 overlapped in time: target and drafter on one GPU, each on its own stream,
    run their kernels side by side, and each stage's span also covers the time the other's kernels
    held the GPU. That overlap (at least the excess over 1) is counted in both shares alike, so their
    difference is still the difference of the time each stage ran without the other, and the rule
    compares exactly that; the reason says how much of the time was shared."""
    t_busy = _mean([_busy(c, TARGET_BUSY) for c in targets])
    d_busy = _mean([_busy(c, DRAFTER_BUSY) for c in drafters])
    evidence = {"target.device_busy": round(t_busy, 4), "drafter.device_busy": round(d_busy, 4),
                "device.overlap": round(max(0.0, t_busy + d_busy - 1.0), 4), "device_time": 1.0}
    if steps:
        evidence["target.device_ms_per_step"] = round(_device_seconds(targets, TARGET_BUSY) / steps * 1e3, 3)
        evidence["drafter.device_ms_per_step"] = round(_device_seconds(drafters, DRAFTER_BUSY) / steps * 1e3, 3)
    return evidence


def agrees_with_evidence(b: Bottleneck) -> bool:
    """Whether the verdict follows from its own evidence by its rule (the same rule that decided it)."""
    return V.agrees_with_evidence(b.verdict, b.evidence)
