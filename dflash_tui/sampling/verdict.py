"""The verdict on sampled shares: what stacks read from outside can show, and a plain "cannot judge"
for what they cannot.

Samples show where the *training thread* (the one running backward passes and optimizer steps) spends
its time, how often a thread holds the GIL, and, with per-thread CPU time beside them, whether a thread
that looks busy was on a core. From that:

* input-bound: the training thread waits on its data loader (batch_queue_wait) >= THRESHOLD;
* CPU-starved: as the trainer judges it (vocabulary thresholds), from sampled busy shares;
* GIL-bound: the training thread looks busy but is off the CPU for half that time or more while other
  threads hold the GIL, in a process on about one core;
* balanced: it waits on nothing for THRESHOLD or more;
* launch-bound (native frames only): the training thread, or a target thread, spends LAUNCH_SHARE or more
  of its samples launching kernels or in the caching allocator: its GPU waits on it.

A training thread waiting on something else (a pipeline queue, the other ranks) is "unknown", with what
it waits on: which stage feeds that queue, or which rank is slow, is not in its own stacks - except
dflash's own drafter waiting for hidden states while a target thread in view is launch-bound. Too few
samples, or no training thread, is "unknown" too. docs/sampling.md has the rules and their evidence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dflash.telemetry.wire import verdicts as V
from dflash.telemetry.wire.protocol import Bottleneck, MachineSample
from dflash.telemetry.wire.table import busy_share
from dflash.telemetry.wire.verdicts import GIL_MAX_CPU, GIL_MIN_CPU, MIN_TRACKED, THRESHOLD
from dflash.telemetry.wire.vocab import ALLOCATOR, KERNEL_LAUNCH, WAIT_SUFFIXES, Role
from dflash_tui.sampling.tally import Tally, margin

#: fewer samples of the training thread than this and there is nothing to judge (a share is then known
#: to no better than +/-18%)
MIN_SAMPLES = 30
#: the training thread is GIL-bound when, of its busy time, at least this share was spent off the CPU
#: while another thread held the GIL
GIL_WAIT_SHARE = 0.5
#: a thread is launch-bound when at least this share of its samples are in kernel launches or the caching
#: allocator (native frames): most of its time goes to feeding its GPU, which therefore waits on it. Host
#: syncs do not count: a thread waiting in a synchronize waits for a GPU that has work queued
LAUNCH_SHARE = 0.5
#: the categories that make a thread the training thread, and a data thread
TRAINING = ("drafter_backward", "optimizer_step", "drafter_forward")
DATA = ("batch_build", "batch_queue_put")
TARGET = ("target_forward", "cache_read", "pack_hidden", "cache_wait")


def role_of(t: Tally) -> Role | None:
    """What a sampled thread does, from where its samples fall (the role with the most samples). A thread
    waiting on a data loader is the loop that consumes it: the training thread, when nothing says more."""
    by_role = {Role.DRAFTER: sum(t.counts[c] for c in (*TRAINING, "batch_queue_wait")),
               Role.TARGET: sum(t.counts[c] for c in TARGET), Role.DATA: sum(t.counts[c] for c in DATA)}
    role, n = max(by_role.items(), key=lambda kv: kv[1])
    return role if n > 0 else None


@dataclass(frozen=True)
class Observed:
    """What the verdict is judged on, over one span of sampling."""

    #: worker -> its samples over the span
    tallies: Mapping[str, Tally]
    #: worker -> mean share of wall time its thread ran on a CPU (psutil), where known
    thread_cpu: Mapping[str, float]
    #: the process's CPU, percent of one core
    process_cpu: float | None = None
    machine: MachineSample | None = None
    #: share of samples some thread held the GIL (None: not sampled)
    gil_held: float | None = None
    interval_s: float = 0.01
    scope: str = ""


def judge(o: Observed) -> Bottleneck:
    roles = {w: role_of(t) for w, t in o.tallies.items()}
    training = [w for w, r in roles.items() if r == Role.DRAFTER]
    evidence: dict[str, float] = {"threshold": THRESHOLD}

    def verdict(v: V.Verdict, reason: str) -> Bottleneck:
        return Bottleneck(verdict=v.name, reason=reason, evidence=evidence, scope=o.scope)

    if not training:
        return verdict(V.UNKNOWN, "cannot judge: no thread ran a forward, backward or optimizer step, or waited "
                       "on a data loader, in these samples (no training thread)")
    main = max(training, key=lambda w: sum(o.tallies[w].counts[c] for c in (*TRAINING, "batch_queue_wait")))
    t = o.tallies[main]
    stats = t.stats(o.interval_s)
    busy = busy_share(stats)
    waits = {c: st.share for c, st in stats.items() if c.endswith(WAIT_SUFFIXES)}
    data = waits.pop("batch_queue_wait", 0.0)
    evidence.update({"training.batch_queue_wait": round(data, 4), "training.busy": round(busy, 4),
                     "sample_count": float(t.samples), "margin": round(margin(t.samples), 4)})
    if t.samples < MIN_SAMPLES:
        return verdict(V.UNKNOWN, f"cannot judge yet: {t.samples} samples of the training thread ({main}), "
                       f"fewer than {MIN_SAMPLES}")
    if busy + data + sum(waits.values()) < MIN_TRACKED:
        return verdict(V.UNKNOWN, f"cannot judge: the rules name less than {MIN_TRACKED:.0%} of {main}'s samples")
    if data >= THRESHOLD:
        raw = verdict(V.INPUT_BOUND, f"the training thread ({main}) waits {data:.0%} of its samples on its data "
                      "loader (batch_queue_wait): the input limits throughput; more loader workers, cheaper "
                      "batches, or a faster source of hidden states")
    elif waits and max(waits.values()) >= THRESHOLD:
        cat = max(waits, key=lambda c: waits[c])
        evidence[f"training.{cat}"] = round(waits[cat], 4)
        if cat == "idle_wait":
            what = ("on a queue, an event or a lock no rule names: if that is its input, it is input-bound (a rule "
                    "naming its loop would say so: docs/sampling.md)")
        else:
            what = f"in {cat}, and what it waits for (another stage, another rank) is not in its own stacks"
        unknown = verdict(V.UNKNOWN, f"cannot judge from samples: the training thread ({main}) waits "
                          f"{waits[cat]:.0%} {what}")
        # dflash's drafter waiting for hidden states: the target threads that feed it are in view
        return (_launch_bound(unknown, o, roles, main, feeders=True) or unknown) if cat == "hs_queue_wait" else unknown
    else:
        top = sorted(((st.share, c) for c, st in stats.items() if not c.endswith(WAIT_SUFFIXES)), reverse=True)[:3]
        doing = ", ".join(f"{c} {s:.0%}" for s, c in top)
        raw = verdict(V.BALANCED, f"the training thread ({main}) works {busy:.0%} of its samples ({doing}) and "
                      f"waits on no input for {THRESHOLD:.0%}; whether a GPU is the limit needs device time, which "
                      "sampling does not see")
    return _cpu_starved(raw, o, roles) or _gil_bound(raw, o, main, busy) or _launch_bound(raw, o, roles, main) or raw


def _cpu_starved(raw: Bottleneck, o: Observed, roles: Mapping[str, Role | None]) -> Bottleneck | None:
    """As the trainer's rule: busy workers that got a core for far less than their busy time, while other
    processes held the machine's cores."""
    workers = [w for w, r in roles.items() if r is not None and w in o.thread_cpu]
    if not workers or o.machine is None:
        return None
    busy = sum(busy_share(o.tallies[w].stats(o.interval_s)) for w in workers) / len(workers)
    cpu = sum(o.thread_cpu[w] for w in workers) / len(workers)
    others = o.machine.others_percent / 100
    idle = max(0.0, o.machine.cores - o.machine.busy_percent / 100)
    evidence = {**raw.evidence, "workers.cpu": round(cpu, 4), "workers.busy": round(busy, 4),
                "machine.other_cores": round(others, 2), "machine.idle_cores": round(idle, 2),
                "machine.cores": float(o.machine.cores)}
    if not V.CPU_STARVED.holds(evidence):  # the trainer's own rule, on the sampled shares
        return None
    return Bottleneck(verdict=V.CPU_STARVED.name, scope=o.scope, evidence=evidence,
                      reason=f"other processes use {others:.1f} of {o.machine.cores} cores: the busy threads ran on a "
                      f"CPU {cpu:.0%} of the time while their samples are {busy:.0%} busy ({raw.verdict} by its "
                      "samples); free cores (stop other jobs) or use fewer threads")


def _gil_bound(raw: Bottleneck, o: Observed, main: str, busy: float) -> Bottleneck | None:
    """The training thread looks busy but is off the CPU, while other threads hold the GIL, in a process
    on about one core: it waits for the interpreter lock."""
    if o.gil_held is None or main not in o.thread_cpu or busy < THRESHOLD:
        return None
    t = o.tallies[main]
    own = t.gil / t.samples if t.samples else 0.0
    off_cpu = max(0.0, busy - o.thread_cpu[main])
    waited = min(off_cpu, max(0.0, o.gil_held - own))
    cpu = o.process_cpu
    if waited < GIL_WAIT_SHARE * busy or (cpu is not None and not GIL_MIN_CPU <= cpu <= GIL_MAX_CPU):
        return None
    evidence = {**raw.evidence, "gil.held": round(o.gil_held, 4), "gil.training": round(own, 4),
                "training.cpu": round(o.thread_cpu[main], 4), "training.gil_wait": round(waited, 4)}
    if cpu is not None:
        evidence["process_cpu_percent"] = round(cpu, 1)
    return Bottleneck(verdict=V.GIL_BOUND.name, scope=o.scope, evidence=evidence,
                      reason=f"the training thread ({main}) is busy {busy:.0%} of its samples but on a CPU only "
                      f"{o.thread_cpu[main]:.0%} of the time, while other threads hold the GIL {o.gil_held - own:.0%} "
                      f"of it: it waits for the interpreter lock ({raw.verdict} by its samples); move Python work off "
                      "the other threads, or into processes")


def _launch_bound(raw: Bottleneck, o: Observed, roles: Mapping[str, Role | None], main: str,
                  feeders: bool = False) -> Bottleneck | None:
    """The training thread (or, with `feeders`, only a target thread feeding it) spends most of its samples
    launching kernels or in the caching allocator: its GPU waits on it. Needs native frames (`--native`):
    without them no sample is in either category."""
    if raw.verdict == V.INPUT_BOUND.name:  # as the trainer's rule: a GPU idle because nothing comes in
        return None
    threads = [w for w, r in roles.items() if r == Role.TARGET or (w == main and not feeders)]
    found = []
    for w in threads:
        t = o.tallies[w]
        plumbing = t.share(KERNEL_LAUNCH) + t.share(ALLOCATOR)
        if t.samples >= MIN_SAMPLES and plumbing >= LAUNCH_SHARE:
            found.append((plumbing, w))
    if not found:
        return None
    _, w = max(found)
    t = o.tallies[w]
    launch, alloc, sync = t.share(KERNEL_LAUNCH), t.share(ALLOCATOR), t.share("host_sync")
    evidence = {**raw.evidence, "launching.kernel_launch": round(launch, 4), "launching.allocator": round(alloc, 4),
                "launching.host_sync": round(sync, 4), "launching.sample_count": float(t.samples)}
    who = "the training thread" if w == main else "a target thread"
    also = (f", and synchronises {sync:.0%} (each sync drains the queue, so the GPU idles while the next launches "
            "are made)") if sync >= THRESHOLD else ""
    churn = ("; allocator time that stays high is a cache emptied and refilled (empty_cache, a memory fraction)"
             if alloc >= THRESHOLD else "")
    return Bottleneck(verdict=V.LAUNCH_BOUND.name, scope=o.scope, evidence=evidence,
                      reason=f"{who} ({w}) spends {launch:.0%} of its samples launching kernels and {alloc:.0%} in the "
                      f"caching allocator (native frames){also}: its GPU waits on it ({raw.verdict} by its samples); "
                      "capture the step in CUDA graphs (torch.compile mode='reduce-overhead'), run larger batches or "
                      f"fuse small ops{churn}")
