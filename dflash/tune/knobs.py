"""What `dflash tune` may change, what it never changes, and which change it tries next.

A knob is a setting that decides where and how fast the same training runs, never what is trained: the
same batches, anchors, losses and learning rates make the same drafter whichever of these is set (each
trial is a `dflash train` run with only these changed). The settings that would change the math are
listed in FROZEN; the report names the one that would help most, and leaves it to the user.

The chooser is a pure function of the trials so far (settings, verdict, tokens/s and their spread): the
tests drive it with constructed verdicts, and a resumed tune makes the same choice the killed one would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dflash.telemetry.wire import verdicts as V

#: the settings a trial may change (flat names, as flags and TOML keys): placement, threads, queues and
#: the pipeline itself. Pinned memory is not a setting (the stages pin whenever a copy crosses to a GPU),
#: nor are the cache readers' threads or torch.compile: when they become settings they belong here.
KNOBS = ("target_devices", "drafter_device", "pipeline", "threads_per_worker", "batch_queue_size",
         "hs_queue_size")

#: settings that change what is trained: never touched, only named (with the verdict's evidence)
FROZEN = ("batch_size", "num_anchors", "max_seq_len", "block_size", "drafter_layers", "lr")

#: queues deeper than these hold memory and absorb no more jitter on any pipeline we measured
MAX_HS_QUEUE, MAX_BATCH_QUEUE = 8, 16

Settings = dict[str, Any]


@dataclass(frozen=True)
class Machine:
    """What the trials may place work on."""

    cores: int
    gpus: int = 0


@dataclass(frozen=True)
class Move:
    """One candidate change and why the verdict suggests it."""

    changes: Settings
    why: str


@dataclass(frozen=True)
class Decision:
    """The next trial's settings (None: stop, and `stop` says why)."""

    settings: Settings | None
    changes: Settings
    why: str
    stop: str | None = None


def threads(s: Mapping[str, Any], m: Machine) -> int:
    """Intra-op threads each worker runs: torch's own default is one per core."""
    return int(s.get("threads_per_worker") or m.cores)


def _cuda(dev: str) -> str:
    return "cuda:0" if dev == "cuda" else dev


def _cpu_workers(s: Mapping[str, Any]) -> int:
    return sum(d == "cpu" for d in s["target_devices"]) + (s["drafter_device"] == "cpu")


# --- the moves, each a function of the settings and the machine -------------------------------------------

def pipeline_on(s: Settings, m: Machine) -> list[Move]:
    if s["pipeline"]:
        return []
    return [Move({"pipeline": True}, "the pipeline overlaps the target forward with the drafter step; with it "
                                     "off there are no stages to judge")]


def fewer_threads(s: Settings, m: Machine) -> list[Move]:
    t = threads(s, m)
    if t <= 1:
        return []
    return [Move({"threads_per_worker": max(1, t // 2)},
                 f"{_cpu_workers(s)} CPU workers x {t} threads on {m.cores} cores: fewer threads, less waiting "
                 "for a core")]


def unoversubscribed(s: Settings, m: Machine) -> list[Move]:
    """Fewer threads wherever the CPU workers' threads outnumber the cores, whatever the verdict: such
    threads take turns on the cores and each one's cache with them, which no stage's waits show."""
    t, workers = threads(s, m), _cpu_workers(s)
    if workers == 0 or workers * t <= m.cores:
        return []
    return [Move({"threads_per_worker": max(1, t // 2)},
                 f"{workers} CPU workers x {t} threads oversubscribe {m.cores} cores")]


def more_threads(s: Settings, m: Machine) -> list[Move]:
    t = threads(s, m)
    if t >= m.cores:
        return []
    return [Move({"threads_per_worker": min(m.cores, t * 2)}, f"more intra-op threads for the slow stage ({t} now, "
                                                                f"{m.cores} cores)")]


def more_targets(s: Settings, m: Machine) -> list[Move]:
    devs = [_cuda(d) for d in s["target_devices"]]
    if any(d.startswith("cuda") for d in devs):
        taken = set(devs) | {_cuda(s["drafter_device"])}
        free = [f"cuda:{i}" for i in range(m.gpus) if f"cuda:{i}" not in taken]
        if free:
            return [Move({"target_devices": [*s["target_devices"], free[0]]},
                         f"another target worker on the idle {free[0]}")]
        return []
    if _cpu_workers(s) + 1 > m.cores:
        return []
    return [Move({"target_devices": [*s["target_devices"], "cpu"]}, "another target worker on a free core")]


def fewer_targets(s: Settings, m: Machine) -> list[Move]:
    if len(s["target_devices"]) < 2:
        return []
    return [Move({"target_devices": list(s["target_devices"][:-1])},
                 f"one target worker fewer ({len(s['target_devices'])} now): each takes a core or the GIL from "
                 "the rest")]


def drafter_to_gpu(s: Settings, m: Machine) -> list[Move]:
    if s["drafter_device"] != "cpu" or not m.gpus:
        return []
    return [Move({"drafter_device": "cuda:0"}, "the drafter on a GPU instead of the CPU")]


def deeper_hs_queue(s: Settings, m: Machine) -> list[Move]:
    q = int(s["hs_queue_size"])
    if q >= MAX_HS_QUEUE:
        return []
    return [Move({"hs_queue_size": q * 2}, f"a deeper hidden-state queue ({q} now): the stages stop waiting on "
                                            "each other's every slow step")]


def deeper_batch_queue(s: Settings, m: Machine) -> list[Move]:
    q = int(s["batch_queue_size"])
    if q >= MAX_BATCH_QUEUE:
        return []
    return [Move({"batch_queue_size": q * 2}, f"more batches built ahead ({q} now)")]


Rule = Callable[[Settings, Machine], list[Move]]

#: verdict -> the moves it suggests, most promising first; a verdict absent here suggests nothing the
#: tuner may change (balanced: nothing to gain; unknown: nothing measured; input-bound: the cache's
#: readers are not a setting; launch-bound: neither is torch.compile)
MOVES: dict[str, tuple[Rule, ...]] = {
    V.CPU_STARVED.name: (fewer_threads, fewer_targets),
    V.GIL_BOUND.name: (fewer_targets, fewer_threads),
    V.TARGET_BOUND.name: (more_targets, more_threads, deeper_hs_queue),
    V.DRAFTER_BOUND.name: (drafter_to_gpu, more_threads, fewer_targets, deeper_hs_queue),
    V.DATA_BOUND.name: (deeper_batch_queue, fewer_threads),
}


def moves(s: Settings, verdict: str, m: Machine) -> list[Move]:
    """Every move the verdict suggests from these settings, most promising first (the pipeline first of
    all: with it off nothing else can be judged; then threads that oversubscribe the cores)."""
    return [mv for rule in (pipeline_on, unoversubscribed, *MOVES.get(verdict, ())) for mv in rule(s, m)]


def key(s: Mapping[str, Any]) -> tuple:
    """Settings as a comparable key: two trials with one key measured the same thing."""
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(s.items()) if k in KNOBS)


def noise(trial: Mapping[str, Any], best: Mapping[str, Any]) -> float:
    """What a gain must beat to count: the larger spread of the two trials' windows."""
    return max(float(trial.get("spread") or 0.0), float(best.get("spread") or 0.0))


def best_of(trials: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    ok = [t for t in trials if t.get("status") == "ok"]
    return max(ok, key=lambda t: t["tokens_per_s"]) if ok else None


def gained(trial: Mapping[str, Any], before: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a trial beat the best before it by more than the noise (the first trial always counts)."""
    best = best_of(before)
    if trial.get("status") != "ok":
        return False
    return best is None or trial["tokens_per_s"] - best["tokens_per_s"] > noise(trial, best)


def choose(start: Settings, trials: Sequence[Mapping[str, Any]], m: Machine, patience: int = 1) -> Decision:
    """The next trial, or why to stop.

    The first trial measures `start`. After that the next one applies the first untried move the best
    trial's verdict suggests; the tune stops when the best trial is balanced, when `patience` trials in a
    row gained less than their noise over the best before them, or when no untried move is left."""
    if not trials:
        return Decision(dict(start), {}, "the starting point")
    best = best_of(trials)
    if best is None:
        return Decision(None, {}, "", stop="no trial ran to the end: see its log (train.log in its run dir)")
    streak = 0
    for i in range(len(trials) - 1, 0, -1):
        if gained(trials[i], trials[:i]):
            break
        streak += 1
    last = trials[-1]
    if streak >= patience:
        if last.get("status") != "ok":
            return Decision(None, {}, "", stop=f"trial {len(trials)} failed ({last.get('error', 'see its log')})")
        return Decision(None, {}, "", stop=(
            f"trial {len(trials)} gained {last['tokens_per_s'] - best['tokens_per_s']:+,.0f} tok/s over the best, "
            f"less than its noise (+-{noise(last, best):,.0f})"))
    if best["verdict"] == V.BALANCED.name:
        return Decision(None, {}, "", stop=f"trial {trials.index(best) + 1} is balanced: no stage waits on another")
    tried = {key(t["settings"]) for t in trials}
    for mv in moves(dict(best["settings"]), best["verdict"], m):
        nxt = {**best["settings"], **mv.changes}
        if key(nxt) not in tried:
            return Decision(nxt, mv.changes, f"{best['verdict']}: {mv.why}")
    return Decision(None, {}, "", stop=f"no untried setting left for {best['verdict']} "
                                       f"(the best trial, {trials.index(best) + 1})")


#: verdict -> (the frozen setting that would help most, why); the report names it with the evidence
ADVICE: dict[str, tuple[str, str]] = {
    V.DRAFTER_BOUND.name: ("num_anchors", "the drafter's step grows with the anchors per sequence; fewer make it "
                                          "cheaper (or drafter_layers)"),
    V.TARGET_BOUND.name: ("batch_size", "a larger batch gives the target fewer, fuller forwards per token"),
    V.LAUNCH_BOUND.name: ("batch_size", "larger batches launch fewer, bigger kernels"),
    V.DATA_BOUND.name: ("max_seq_len", "shorter samples are cheaper to build (or prepare the token store ahead: "
                                       "`dflash data prepare`)"),
}
#: the evidence keys that back each piece of advice
ADVICE_EVIDENCE = {V.DRAFTER_BOUND.name: ("drafter.busy", "target.hs_queue_put"),
                   V.TARGET_BOUND.name: ("target.busy", "drafter.hs_queue_wait"),
                   V.LAUNCH_BOUND.name: ("target.gpu_busy", "drafter.gpu_busy"),
                   V.DATA_BOUND.name: ("target.batch_queue_wait", "data.busy")}


def advice(trial: Mapping[str, Any]) -> str | None:
    """The frozen setting that would help the best trial most, with its measured evidence; None when its
    verdict names none (balanced, or a bound no training setting moves)."""
    verdict = trial.get("verdict", "")
    stage = trial.get("stage_verdict") or verdict
    for name in (verdict, stage):
        if name in ADVICE:
            setting, why = ADVICE[name]
            ev = trial.get("evidence") or {}
            shown = ", ".join(f"{k} {ev[k]:.0%}" for k in ADVICE_EVIDENCE[name] if k in ev)
            return f"{setting}: {why} ({name}{': ' + shown if shown else ''}); it changes what is trained, so " \
                   "the tuner leaves it to you"
    return None
