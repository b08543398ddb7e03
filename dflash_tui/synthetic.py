"""Deterministic, plausible telemetry frames: for snapshot tests, screenshots and the replay benchmark.

Shaped like a target-bound DFlash pipeline (target workers mostly in `target_forward`, drafter
workers waiting on the hidden-state queue), so the screens look like the real thing. Real trainers
are exercised by the pilot tests; these frames only stand in where fixed data is the point.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from dflash.telemetry.wire import vocab
from dflash.telemetry.wire.protocol import (
    PROTO,
    Bottleneck,
    CategoryStats,
    Cluster,
    ClusterCategory,
    ClusterRank,
    DeviceStats,
    Event,
    GpuSample,
    Hello,
    OpenSpan,
    Snapshot,
    SystemSample,
    ThreadSample,
    encode,
)

T0 = 1_760_000_000.0
#: the trainer's categories of a run whose targets keep pace (reorder_wait shows only behind a straggling
#: one) and one of a custom stage's (shown after them, in its own colour)
CATEGORIES = [*(c for c in vocab.CATEGORIES if c != "reorder_wait"), "loader_io"]
#: typical share of wall time per category for each kind of worker
_TARGET = {"target_forward": 0.62, "pack_hidden": 0.09, "hs_queue_put": 0.06, "batch_queue_wait": 0.04, "h2d": 0.05}
_DRAFTER = {"hs_queue_wait": 0.31, "h2d": 0.04, "drafter_forward": 0.21, "drafter_backward": 0.27,
            "optimizer_step": 0.07}
_DATA = {"loader_io": 0.22}
_MEAN = {"target_forward": 0.0120, "pack_hidden": 0.0018, "hs_queue_put": 0.0009, "batch_queue_wait": 0.0006,
         "h2d": 0.0007, "hs_queue_wait": 0.0041, "drafter_forward": 0.0046, "drafter_backward": 0.0061,
         "optimizer_step": 0.0016, "checkpoint": 0.4, "eval": 0.2, "loader_io": 0.0003}


def worker_names(n: int) -> list[str]:
    """Half target workers, then drafters; from 6 workers on the last is the batch producer, whose
    name is the longest a real run has (panels must show it whole)."""
    return list(worker_roles(n))


def worker_roles(n: int) -> dict[str, str]:
    """The `n` workers by name, each with the role a trainer registers for it (see worker_names)."""
    half = max(1, n // 2)
    roles = [(f"target-{i}", vocab.Role.TARGET) for i in range(half)]
    roles += [(f"drafter-{i}", vocab.Role.DRAFTER) for i in range(n - half)]
    if n >= 6:
        roles[-1] = ("batch-producer", vocab.Role.DATA)
    return {name: str(role) for name, role in roles}


def hello(run: str = "demo", pid: int = 4242, host: str = "trainbox", workers: int = 4,
          run_dir: str | None = None, interval_s: float = 0.5, rank: int = 0, world_size: int = 1) -> Hello:
    names = worker_names(workers)
    threads = {str(pid + 10 + i): name for i, name in enumerate(names)}
    threads[str(pid)] = "MainThread"
    return Hello(proto=PROTO, run=run, pid=pid, host=host, rank=rank, world_size=world_size, workers=names,
                 threads=threads, started=T0, interval_s=interval_s, run_dir=run_dir)


def _stats(rng: random.Random, cat: str, share: float, interval: float, device: bool) -> CategoryStats:
    mean = _MEAN.get(cat, 0.001) * rng.uniform(0.85, 1.15)
    total = share * interval
    n = max(1, round(total / mean))
    dev = None
    if device and cat in ("target_forward", "drafter_forward", "drafter_backward", "h2d"):
        dmean = mean * rng.uniform(0.8, 0.95)
        dev = DeviceStats(n=n, total=dmean * n, mean=dmean, p50=dmean * 0.97, p95=dmean * 1.3, max=dmean * 1.6)
    return CategoryStats(n=n, total=total, mean=mean, p50=mean * 0.95, p95=mean * 1.45, max=mean * 2.1,
                         share=share, device=dev)


def snapshot(seq: int, *, workers: int = 4, categories: int = 12, interval_s: float = 0.5, pid: int = 4242,
             gpus: int = 0, gpu_error: str | None = "no NVIDIA driver (NVML: libnvidia-ml.so.1 not found)",
             seed: int = 7, device: bool | None = None) -> Snapshot:
    """Snapshot number `seq`; the same arguments always give the same frame."""
    rng = random.Random(seed * 100_003 + seq)
    t = T0 + 5.0 + seq * interval_s
    cats = CATEGORIES[:categories]
    device = gpus > 0 if device is None else device
    ws: dict[str, dict[str, CategoryStats]] = {}
    untracked: dict[str, float] = {}
    wave = 0.5 + 0.5 * math.sin(seq / 15)
    roles = worker_roles(workers)
    for w in worker_names(workers):
        base = {vocab.Role.TARGET: _TARGET, vocab.Role.DATA: _DATA}.get(roles[w], _DRAFTER)
        shares = {c: base.get(c, 0.004) * rng.uniform(0.85, 1.15) * (1.1 - 0.2 * wave) for c in cats}
        covered = sum(shares.values())
        if covered > 0.97:
            shares = {c: s * 0.97 / covered for c, s in shares.items()}
            covered = 0.97
        ws[w] = {c: _stats(rng, c, s, interval_s, device) for c, s in shares.items()}
        untracked[w] = 1.0 - covered
    steps = seq * 4
    tokens = steps * 4096.0
    threads = [ThreadSample(tid=pid + 10 + i, name=w,
                            cpu_percent=round((93.0 if roles[w] == vocab.Role.TARGET else 41.0)
                                              * rng.uniform(0.8, 1.05), 1))
               for i, w in enumerate(worker_names(workers))]
    threads += [ThreadSample(tid=pid, name="MainThread", cpu_percent=round(rng.uniform(1, 4), 1)),
                ThreadSample(tid=pid + 1, name="telemetry", cpu_percent=round(rng.uniform(0.5, 2), 1))]
    gpu_list = [GpuSample(index=i, name="NVIDIA H200",
                          util_percent=round(min(100, 78 + 15 * wave + rng.uniform(-4, 4)), 1),
                          mem_used=int((60 + 10 * wave) * 2**30), mem_total=int(141 * 2**30),
                          power_w=round(420 + 180 * wave, 1), temp_c=round(55 + 9 * wave, 1), sm_clock_mhz=1980.0,
                          process_mem=int((56 + 10 * wave) * 2**30)) for i in range(gpus)]
    system = SystemSample(cpu_percent=round(sum(th.cpu_percent for th in threads), 1), rss_bytes=int(3.2 * 2**30),
                          threads=threads, gpus=gpu_list, gpu_error=None if gpus else gpu_error)
    target_share = sum(ws[w]["target_forward"].share for w in ws
                       if roles[w] == vocab.Role.TARGET and "target_forward" in ws[w])
    n_target = max(1, sum(1 for w in ws if roles[w] == vocab.Role.TARGET))
    wait = [ws[w]["hs_queue_wait"].share for w in ws if roles[w] == vocab.Role.DRAFTER and "hs_queue_wait" in ws[w]]
    bottleneck = Bottleneck(verdict="target-bound",
                            reason="drafters wait on hidden states while target workers are busy in target_forward",
                            evidence={"target_busy_share": round(target_share / n_target, 3),
                                      "drafter_wait_share": round(sum(wait) / max(1, len(wait)), 3),
                                      "hs_queue_depth": 0.0})
    # what each worker is in now: targets in a forward, drafters waiting for hidden states
    inflight = {}
    for i, w in enumerate(worker_names(workers)):
        cat = {vocab.Role.TARGET: "target_forward",
               vocab.Role.DRAFTER: "hs_queue_wait"}.get(roles[w], "batch_queue_put")
        elapsed = round(_MEAN.get(cat, 0.01) * (0.2 + 0.7 * ((seq + i) % 5) / 4), 4)
        inflight[w] = OpenSpan(category=cat, start=round(t - elapsed, 4), elapsed=elapsed)
    return Snapshot(seq=seq, t=t, interval_s=interval_s, workers=ws, untracked=untracked, inflight=inflight,
                    counters={"steps": float(steps), "tokens": tokens, "samples": steps * 8.0},
                    rates={"tokens": 4096 * 4 / interval_s * (0.9 + 0.2 * wave), "steps": 4 / interval_s},
                    gauges={"loss": round(6.0 * math.exp(-seq / 80) + 1.8 + 0.05 * rng.uniform(-1, 1), 4),
                            "lr": 3e-4, "hs_queue_depth": 0.0, **progress_gauges(steps, seq * interval_s)},
                    metrics={"sim_tau": round(1.2 + 2.4 * (1 - math.exp(-seq / 60)), 3),
                             "per_position_acc": [round(0.9 * 0.85**k, 3) for k in range(15)]},
                    system=system, bottleneck=bottleneck, roles=roles)


def progress_gauges(steps: int, elapsed: float, max_steps: int = 1000) -> dict[str, float]:
    """The trainer's progress gauges for a run of `max_steps` at its mean rate so far."""
    rate = steps / elapsed if elapsed > 0 else 0.0
    out = {"train_time_s": elapsed, "max_steps": float(max_steps), "progress": min(1.0, steps / max_steps)}
    if rate > 0:
        out["eta_s"] = max(0.0, (max_steps - steps) / rate)
    return out


def cluster(seq: int, world_size: int = 2, *, workers: int = 4, interval_s: float = 0.5, straggler: int | None = 1,
            stale: tuple[int, ...] = (), seed: int = 7) -> Cluster:
    """Rank 0's cross-rank view at snapshot `seq`: rank `straggler` computes slower, so it waits least in
    the all-reduce and is the slowest rank of the compute categories; `stale` ranks stopped reporting."""
    rng = random.Random(seed * 7_919 + seq)
    steps = seq * 4
    ranks = []
    for r in range(world_size):
        slow = r == straggler
        age = 14.5 + 0.5 * seq if r in stale else round(rng.uniform(0.1, 0.9), 1)
        ranks.append(ClusterRank(
            rank=r, host="trainbox" if r < 8 else f"trainbox{r // 8 + 1}", pid=4242 + r,
            step=steps - (2 if slow else 0) - (40 if r in stale else 0),
            tokens_per_s=round(4096 * 4 / interval_s * (0.78 if slow else rng.uniform(0.97, 1.03)), 1),
            loss=round(6.0 * math.exp(-seq / 80) + 1.8 + 0.05 * rng.uniform(-1, 1), 4),
            allreduce_share=round(0.03 if slow else 0.24 * rng.uniform(0.9, 1.1), 4), age_s=age, stale=r in stale,
            socket=f"/run/user/1000/dflash/demo-{4242 + r}-r{r}.sock"))
    live = [r for r in range(world_size) if r not in stale]
    categories = []
    roles = worker_roles(workers)
    for worker in worker_names(workers):
        base = _TARGET if roles[worker] == vocab.Role.TARGET else _DRAFTER
        for cat, share in base.items():
            # compute stretches on the straggler; waiting shrinks there (it is the one waited for)
            factor = 1.25 if cat.endswith(("forward", "backward")) else 0.6 if cat.endswith("wait") else 1.0
            shares = {r: share * (factor if r == straggler else 1.0) * rng.uniform(0.97, 1.03) for r in live}
            if not shares:
                continue
            lo, hi = min(shares, key=shares.get), max(shares, key=shares.get)
            categories.append(ClusterCategory(key=f"{worker}/{cat}", min=round(shares[lo], 4),
                                              mean=round(sum(shares.values()) / len(shares), 4),
                                              max=round(shares[hi], 4), min_rank=lo, max_rank=hi))
    categories.sort(key=lambda c: -(c.max - c.min))
    reason = ""
    if straggler is not None:
        waits = [r.allreduce_share for r in ranks if r.rank != straggler and not r.stale]
        reason = (f"waits {ranks[straggler].allreduce_share:.0%} of its time in the gradient all-reduce, the others "
                  f"{sum(waits) / max(1, len(waits)):.0%}: they wait for it")
    return Cluster(world_size=world_size, ranks=ranks, categories=categories, straggler=straggler,
                   straggler_reason=reason, stale=list(stale))


def events(seq: int, t: float) -> list[Event]:
    out: list[Event] = []
    if seq and seq % 40 == 0:
        out.append(Event(t=t, kind="checkpoint", message=f"saved checkpoint step {seq * 4}",
                         data={"step": seq * 4, "path": f"ckpt/step-{seq * 4}"}))
    if seq and seq % 60 == 0:
        out.append(Event(t=t, kind="eval", message="eval tau 2.84", data={"tau": 2.84}))
    if seq == 25:
        out.append(Event(t=t, kind="warning", message="hs_queue empty for 3 windows: drafters starved"))
    return out


def frames(n: int, world_size: int = 1, **kw) -> list:
    """A hello then `n` snapshots with their events, in recording order; with `world_size` > 1, rank 0's,
    each snapshot carrying the cluster view."""
    workers, interval_s = kw.get("workers", 4), kw.get("interval_s", 0.5)
    out: list = [hello(workers=workers, interval_s=interval_s, world_size=world_size)]
    for seq in range(1, n + 1):
        snap = snapshot(seq, **kw)
        if world_size > 1:
            snap.cluster = cluster(seq, world_size, workers=workers, interval_s=interval_s)
            own = snap.cluster.ranks[0]  # rank 0's row agrees with rank 0's own snapshot
            own.step, own.tokens_per_s = int(snap.counters["steps"]), snap.rates["tokens"]
            own.loss = snap.gauges["loss"]
        out.append(snap)
        out.extend(events(seq, snap.t))
    return out


def write_recording(path: Path, n: int, **kw) -> Path:
    """telemetry.jsonl with a hello and `n` snapshots, streamed (an hour of 8x12 is ~100 MB)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    workers = kw.get("workers", 4)
    with open(path, "wb") as f:
        f.write(encode(hello(workers=workers, interval_s=kw.get("interval_s", 0.5), run_dir=str(path.parent))))
        for seq in range(1, n + 1):
            snap = snapshot(seq, **kw)
            f.write(encode(snap))
            for ev in events(seq, snap.t):
                f.write(encode(ev))
    return path
