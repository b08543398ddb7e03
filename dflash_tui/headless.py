"""`dflash-top --once [--json]`: one summary, printed, for scripts and for terminals without a TUI.

It reads through the same sources and state as the app (a replay is played at full speed to its
end; a live trainer is read until its first snapshot), so what it prints is what the panels show.
"""

from __future__ import annotations

import json
import math
import queue
import sys
import time
from typing import Any, TextIO

import msgspec

from dflash.telemetry.wire.protocol import CategoryStats, Cluster, training_shares
from dflash.telemetry.wire.sockets import default_socket_dir, discover, group_jobs
from dflash.telemetry.wire.table import category_table, evidence_text
from dflash.telemetry.wire.vocab import TELEMETRY_THREADS, Gauge
from dflash_tui import fmt
from dflash_tui.sampling.processes import torch_processes
from dflash_tui.sources import AttachError, Connection, FrameSource, SourceUpdate, open_source, resolve
from dflash_tui.state import RunState
from dflash_tui.widgets.alerts import stall_line
from dflash_tui.widgets.bottleneck import machine_line
from dflash_tui.widgets.cluster import cluster_summary, cluster_text
from dflash_tui.widgets.header import mfu_text


def summarize(state: RunState) -> dict[str, Any]:
    """The summary as plain JSON-able data; its keys are the documented `--once --json` contract.

    A finished run (a replay played to its end) is summarised whole, as `dflash stats` does: the last
    snapshot's cumulative stats with evaluation time apart from the training shares, and the last
    verdict judged on training; a live run by its latest window."""
    hello, snap = state.hello, state.snapshot
    sys_ = state.system
    whole = state.connection == Connection.ENDED and snap is not None and bool(snap.cumulative)
    stats, evaluation_s = training_shares(snap.cumulative) if whole else (state.workers, None)
    bottleneck = (state.training_bottleneck or state.bottleneck) if whole else state.bottleneck
    workers: dict[str, dict[str, dict[str, Any]]] = {}
    for w, cats in stats.items():
        workers[w] = {}
        for c, st in cats.items():
            row = {"n": st.n, "total": st.total, "mean": st.mean, "p50": st.p50, "p95": st.p95,
                   "max": st.max, "share": st.share}
            if st.device is not None:
                row["device"] = msgspec.to_builtins(st.device)
            workers[w][c] = row
    top_threads = sorted(sys_.threads, key=lambda t: -t.cpu_percent)[:16] if sys_ else []
    return {
        "run": hello.run if hello else None,
        "pid": hello.pid if hello else None,
        "host": hello.host if hello else None,
        "rank": hello.rank if hello else None,
        "world_size": hello.world_size if hello else None,
        "run_dir": hello.run_dir if hello else None,
        "connection": state.connection,
        "seq": snap.seq if snap else None,
        "t": snap.t if snap else None,
        "interval_s": snap.interval_s if snap else None,
        "uptime_s": state.uptime_s,
        "step": state.step,
        "tokens_per_s": state.tokens_rate,
        #: the trainer's model TFLOP/s (last 10 s) and MFU (a fraction; None where it knows no peak)
        "tflops": state.gauge(Gauge.TFLOPS),
        "mfu": state.gauge(Gauge.MFU),
        "loss": state.loss_value,
        "tau": state.tau_value,
        #: "whole run" (a finished recording) or "last window" (a live trainer)
        "scope": "whole run" if whole else "last window",
        "workers": workers,
        #: seconds the run spent evaluating, apart from the shares (whole-run summaries only)
        "evaluation_s": evaluation_s,
        "untracked": (_untracked(workers) if whole else dict(snap.untracked)) if snap else {},
        "bottleneck": msgspec.to_builtins(bottleneck) if bottleneck else None,
        "gpus": [msgspec.to_builtins(g) for g in state.gpus],
        "gpu_error": sys_.gpu_error if sys_ else None,
        "process": {"cpu_percent": sys_.cpu_percent, "rss_bytes": sys_.rss_bytes} if sys_ else None,
        #: `telemetry`: one of dflash's own telemetry threads (the monitor's CPU, not the trainer's)
        "threads": [{"tid": t.tid, "name": t.name, "cpu_percent": t.cpu_percent,
                     "telemetry": t.name in TELEMETRY_THREADS} for t in top_threads],
        #: the machine's view over the latest window in one line (None without a machine sample)
        "machine": machine_line(state),
        "counters": dict(snap.counters) if snap else {},
        "rates": dict(snap.rates) if snap else {},
        "gauges": dict(snap.gauges) if snap else {},
        "errors": list(state.errors),
        #: rank 0's cross-rank view (protocol.Cluster as JSON) in multi-rank runs, else None
        "cluster": msgspec.to_builtins(state.cluster) if state.cluster is not None else None,
        #: how the figures were sampled (protocol.Sampling as JSON) when the process was watched from outside
        #: (`--pid`): shares are then fractions of samples; None for a trainer's own telemetry
        "sampling": msgspec.to_builtins(snap.sampling) if snap is not None and snap.sampling is not None else None,
        #: worker -> its innermost open span {category, start, elapsed, depth}
        "inflight": {w: msgspec.to_builtins(op) for w, op in state.inflight.items()},
        #: stalled workers now (protocol.Stall as JSON); empty when none
        "stalls": [msgspec.to_builtins(st) for st in state.stalls],
        #: timings deviating from their baseline now (protocol.Anomaly as JSON)
        "anomalies": [msgspec.to_builtins(a) for a in state.anomalies],
    }


def _untracked(workers: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float]:
    return {w: max(0.0, 1.0 - sum(st["share"] for st in cats.values())) for w, cats in workers.items() if cats}


def render_text(s: dict[str, Any]) -> str:
    """The summary as an 80-column report: header, bottleneck, per-category table, GPUs."""
    lines: list[str] = []
    rank = f"  rank {s['rank']}/{s['world_size']}" if s.get("world_size", 1) and s["world_size"] > 1 else ""
    lines.append(f"run {s['run']}  pid {s['pid']}  host {s['host']}{rank}  uptime {fmt.clock(s['uptime_s'])}"
                 f"  step {s['step'] if s['step'] is not None else fmt.NA}")
    mfu = mfu_text(s.get("mfu"), s.get("tflops")).plain
    lines.append(f"tokens/s {fmt.count(s['tokens_per_s'])}{mfu}  loss {fmt.number(s['loss'])}"
                 f"  sim tau {fmt.number(s['tau'])}  [{s['connection']}]")
    if s.get("sampling"):
        lines.append(sampling_line(s["sampling"]))
    if s["scope"] == "whole run":
        lines.append("whole run" + (f"; evaluation {fmt.clock(s['evaluation_s'], short=True)} (training paused, "
                                    "not in the shares)" if s["evaluation_s"] else ""))
    b = s["bottleneck"]
    if b:
        scope = f" ({b['scope']})" if b.get("scope") else ""
        lines.append(f"bottleneck{scope}: {b['verdict']}" + (f" - {b['reason']}" if b.get("reason") else ""))
        ev = b.get("evidence") or {}
        if ev:
            lines.append("  evidence: " + evidence_text(ev))
    else:
        lines.append("bottleneck: unknown (no verdict yet)")
    if s.get("machine"):
        lines.append(s["machine"])
    for st in s.get("stalls", []):
        lines.append("STALLED: " + stall_line(st))
    for a in s.get("anomalies", []):
        lines.append(f"ANOMALY: {a.get('message') or a['worker'] + '/' + a['category']}")
    if s.get("inflight"):
        lines.append("now: " + "  ".join(f"{w} {op['category']} {fmt.seconds(op['elapsed'])}"
                                         for w, op in s["inflight"].items()))
    lines.append("")
    workers = msgspec.convert(s["workers"], dict[str, dict[str, CategoryStats]])
    if workers:
        lines.append(category_table(workers, limit=sum(map(len, workers.values())), untracked=s["untracked"]))
    if not s["workers"]:
        lines.append("(no snapshot yet)")
    lines.append("")
    if s["gpus"]:
        for g in s["gpus"]:
            lines.append(gpu_line(g))
    else:
        lines.append(f"GPUs: {s['gpu_error'] or 'none reported'}")
    if s.get("cluster"):
        cluster = msgspec.convert(s["cluster"], Cluster)
        lines.append("")
        lines.append(f"cluster (rank 0's view): {cluster_summary(cluster)}")
        table = cluster_text(cluster, 80, selected=s["rank"], shown=s["rank"], max_ranks=max(1, len(cluster.ranks)),
                             max_categories=8)
        lines += [line.rstrip() for line in table.plain.splitlines()]
    if s["errors"]:
        lines.append(f"{len(s['errors'])} bad frames; last: {s['errors'][-1]}")
    return "\n".join(lines)


def sampling_line(sm: dict[str, Any]) -> str:
    """`sampled: py-spy --nonblocking at 100 Hz, 2,000 samples per thread (shares +/-2.2%); <its cost>`."""
    n, m = (sm["total_samples"], sm.get("total_margin", 0.0)) if sm.get("total_samples") else (sm["samples"],
                                                                                               sm.get("margin", 0.0))
    return (f"sampled: {sm['tool']} at {sm['rate_hz']:g} Hz, {n:,} samples per thread (shares ±{m * 100:.1f}%); "
            f"{sm.get('cost', '')}")


def gpu_line(g: dict[str, Any]) -> str:
    mem = (f"{fmt.nbytes(g.get('mem_used'))}/{fmt.nbytes(g.get('mem_total'))}"
           if g.get("mem_used") is not None else fmt.NA)
    power = f"{g['power_w']:.0f}W" if g.get("power_w") is not None else fmt.NA
    temp = f"{g['temp_c']:.0f}C" if g.get("temp_c") is not None else fmt.NA
    clock = f"{g['sm_clock_mhz']:.0f}MHz" if g.get("sm_clock_mhz") is not None else fmt.NA
    util = fmt.percent(g.get("util_percent"), scale=1)
    own = f" {fmt.percent(g['process_util'], scale=1)}" if g.get("process_util") is not None else ""
    return (f"GPU{g['index']} {g['name'][:18]}  util {util}  mem {mem}  {power}  {temp}  SM {clock}"
            f"  trainer {fmt.nbytes(g.get('process_mem'))}{own}")


def torch_hint() -> str:
    """Where no trainer answers: the Python processes using torch that `--pid` could sample instead."""
    found = torch_processes()
    if not found:
        return ""
    return ("\nPython processes using torch here (sample one with --pid PID):\n  "
            + "\n  ".join(p.label for p in found[:10]))


def collect(source: FrameSource, timeout: float) -> RunState:
    """Run `source` until it has what a summary needs (or `timeout` passes) and return the state."""
    q: queue.Queue[SourceUpdate] = queue.Queue()
    state = RunState(history=8)
    source.start(q.put)
    deadline = time.monotonic() + timeout
    live = source.live is not None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                update = q.get(timeout=min(left, 0.25))
            except queue.Empty:
                continue
            state.apply_update(update)
            if update.state in (Connection.ENDED, Connection.INCOMPATIBLE, Connection.UNTRUSTED):
                break
            if live and state.snapshot is not None and state.hello is not None:
                break
    finally:
        source.stop()
    return state


def run_once(target: str | None, as_json: bool, timeout: float = 10.0, out: TextIO = sys.stdout,
             directory: str | None = None) -> int:
    """The `--once` command: 0 on a summary, 1 when there was nothing to summarize, 2 on a bad target."""
    try:
        path = resolve(target, directory)
    except AttachError as e:
        print(f"dflash-top: {e}", file=sys.stderr)
        return 2
    if path is None:
        alive = [i for i in discover(directory) if i.alive]
        if not alive:
            where = directory or default_socket_dir()
            print(f"dflash-top: no running trainer found in {where}; start one with `dflash train`, or pass "
                  "a run directory or telemetry.jsonl to summarize a recording" + torch_hint(), file=sys.stderr)
            return 1
        jobs = group_jobs(alive)  # a multi-rank job is one trainer, summarized from rank 0
        if len(jobs) > 1:
            names = "\n  ".join(str(job[0].path) for job in jobs)
            print(f"dflash-top: several trainers are running; pass one of:\n  {names}", file=sys.stderr)
            return 2
        path = jobs[0][0].path
    return summarize_source(open_source(path, speed=math.inf), str(path), as_json, timeout, out)


def summarize_source(source: FrameSource, label: str, as_json: bool, timeout: float, out: TextIO | None = None) -> int:
    """Read `source` as `--once` does and print its summary (to `out`, default stdout): 0 on a summary, 1
    without one."""
    out = out if out is not None else sys.stdout
    state = collect(source, timeout)
    if state.connection in (Connection.INCOMPATIBLE, Connection.UNTRUSTED):
        print(f"dflash-top: {state.connection_detail}", file=sys.stderr)
        return 1
    if state.snapshot is None:
        print(f"dflash-top: {label}: {state.connection_detail}" if state.connection == Connection.ENDED
              else f"dflash-top: no snapshot from {label} within {timeout:g} s"
              + (f" ({state.connection_detail})" if state.connection_detail else ""), file=sys.stderr)
        if not as_json:
            return 1
    summary = summarize(state)
    summary["source"] = label
    if as_json:
        out.write(json.dumps(summary, indent=2, default=str) + "\n")
    else:
        out.write(render_text(summary) + "\n")
    return 0 if state.snapshot is not None else 1
