"""Validate the GIL contention gauge (dflash/telemetry/verdict/gil.py) on real workloads, side by side with
`gilknocker` (when installed) and the GIL-held share from `py-spy record --gil`, and measure its cost:
by throughput (ops with and without the probe) and, in the trainer, by py-spy (the share of all samples
that fall in dflash's own telemetry threads, the probe's and the publisher's).

    python scripts/bench_gil.py [--seconds 5] [--threads 4] [--skip-trainer]

Workloads, each in its own process:
  python   N threads running pure-Python loops          (expect: high contention, GIL held ~100%)
  matmul   N threads in large torch matmuls             (expect: low contention, GIL mostly free)
  trainer  `dflash train` on the built-in tiny target   (the probe runs inside it as a monitor)

For `python` and `matmul` the workload runs three times: with our probe (and py-spy attached), with
gilknocker's KnockKnock at the same 5 ms interval (if installed), and with neither; the throughput
ratio against the last is each probe's cost. Run it on a quiet machine: the probe's floor is the OS's wake-up
latency, which grows with load (the script prints the load average it ran under).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from dflash.telemetry.verdict.evidence import gil_bound
from dflash.telemetry.wire.protocol import Bottleneck

REPO = Path(__file__).resolve().parent.parent
RATE = 100  # py-spy samples per second


def _child(kind: str, threads: int, seconds: float, probe: str) -> None:
    """One workload; prints {"ops_per_s", "probe", "probe_wait_ms", "knocker"} as JSON."""
    sys.path.insert(0, str(REPO))
    from dflash.telemetry.verdict.gil import INTERVAL_S, GilProbe

    stop = threading.Event()
    counts = [0] * threads
    if kind == "python":
        def work(i: int) -> None:
            n = 0
            while not stop.is_set():
                for _ in range(1000):
                    n += 1
                counts[i] += 1
    else:
        import torch

        torch.set_num_threads(1)

        def work(i: int) -> None:
            a = torch.randn(1024, 1024)
            while not stop.is_set():
                a @ a
                counts[i] += 1
    ts = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(threads)]
    for t in ts:
        t.start()
    time.sleep(0.5)  # warm up
    p = GilProbe(backend="sleep").start() if probe == "ours" else None
    knocker = None
    if probe == "knocker":
        from gilknocker import KnockKnock

        knocker = KnockKnock(polling_interval_micros=int(INTERVAL_S * 1e6))
        knocker.start()
    if p is not None:
        p.read()
    c0, t0, cpu0 = sum(counts), time.perf_counter(), time.process_time()
    print("ready", flush=True)
    time.sleep(seconds)
    wall = time.perf_counter() - t0
    ops = (sum(counts) - c0) / wall
    cpu = (time.process_time() - cpu0) / wall * 100
    share, wait, _ = p.read() if p is not None else (None, None, 0)
    if knocker is not None:
        knocker_share = knocker.contention_metric
    if knocker is not None:
        knocker.stop()
    stop.set()
    for t in ts:
        t.join()
    if p is not None:
        p.close()
    print(json.dumps({"ops_per_s": ops, "cpu_percent": cpu, "probe": share,
                      "probe_wait_ms": wait * 1e3 if wait is not None else None,
                      "knocker": knocker_share if knocker is not None else None}), flush=True)


def pyspy_gil_share(pid: int, seconds: float) -> float | None:
    """Share of py-spy samples in which some thread held the GIL (`record --gil` keeps only those)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists() and shutil.which(exe) is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "raw.txt"
        r = subprocess.run([exe, "record", "--gil", "--rate", str(RATE), "--duration", str(int(seconds)), "--format",
                            "raw", "--nonblocking", "-o", str(out), "--pid", str(pid)], capture_output=True, text=True)
        if r.returncode != 0 or not out.exists():
            print(f"  py-spy failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}", file=sys.stderr)
            return None
        held = sum(int(line.rsplit(" ", 1)[1]) for line in out.read_text().splitlines() if line.strip())
    return min(1.0, held / (RATE * int(seconds)))


def pyspy_monitor_share(pid: int, seconds: float) -> dict[str, float] | None:
    """Share of py-spy's samples (all threads, not only the GIL holder's) in each of dflash's own
    telemetry threads: the probe's and the publisher's cost as a profiler sees it, beside the
    throughput ratio."""
    sys.path.insert(0, str(REPO))
    from dflash_tui.pyspy import TELEMETRY_MARK, parse_speedscope

    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists() and shutil.which(exe) is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        r = subprocess.run([exe, "record", "--rate", str(RATE), "--duration", str(int(seconds)), "--format",
                            "speedscope", "--nonblocking", "-o", str(out), "--pid", str(pid)],
                           capture_output=True, text=True)
        if r.returncode != 0 or not out.exists():
            print(f"  py-spy failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}", file=sys.stderr)
            return None
        _, samples, threads = parse_speedscope(out)
    if not samples:
        return None
    # py-spy names a profile "Process P Thread T "name"": keep the thread's name
    return {name.removesuffix(TELEMETRY_MARK).rsplit(" ", 1)[-1].strip('"'): n / samples
            for name, n in threads.items() if name.endswith(TELEMETRY_MARK)}


def _run_child(kind: str, threads: int, seconds: float, probe: str, spy: bool) -> tuple[dict, float | None]:
    cmd = [sys.executable, __file__, "--child", kind, "--threads", str(threads), "--seconds", str(seconds),
           "--probe", probe]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    share = pyspy_gil_share(proc.pid, seconds - 1) if spy else None
    out = json.loads(proc.stdout.readline())
    proc.wait()
    return out, share


def trainer_row(seconds: float) -> dict:
    """The real trainer: its own GIL probe's gauge (mean over the run after warm-up) and py-spy."""
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d) / "run"
        cmd = [sys.executable, "-m", "dflash", "train", "--config", str(REPO / "configs/tiny-cpu.toml"),
               "--run-dir", str(run_dir), "--max-time", str(2 * seconds + 15), "--eval-prompts", "0",
               "--socket-dir", str(Path(d) / "s"), "--log-every", "1000"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        rec = run_dir / "telemetry.jsonl"
        deadline = time.monotonic() + 120
        while not rec.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(5)  # past start-up
        t0 = time.time()
        share = pyspy_gil_share(proc.pid, seconds)
        t1 = time.time()
        monitor = pyspy_monitor_share(proc.pid, seconds)
        proc.wait()
        sys.path.insert(0, str(REPO))
        from dflash.telemetry.wire.protocol import Snapshot
        from dflash.telemetry.wire.reader import read_frames

        snaps = [f for f in read_frames(rec) if isinstance(f, Snapshot) and t0 <= f.t <= t1]
        vals = [s.gauges["gil_contention"] for s in snaps if "gil_contention" in s.gauges]
        waits = [s.gauges["gil_wait_ms"] for s in snaps if "gil_wait_ms" in s.gauges]
        verdicts = [s.bottleneck.verdict for s in snaps if s.bottleneck is not None]
    mean = sum(vals) / len(vals) if vals else None
    return {"probe": mean, "probe_wait_ms": sum(waits) / len(waits) if waits else None,
            "knocker": None, "pyspy": share, "ratio": None, "kratio": None, "monitor": monitor,
            "verdict": max(set(verdicts), key=verdicts.count) if verdicts else "-"}


def _monitor(shares: dict[str, float] | None) -> str:
    if shares is None:
        return "-"
    return ", ".join(f"{name} {share:.1%}" for name, share in shares.items()) or "0%"


def _fmt(v: float | None, pct: bool = True) -> str:
    if v is None:
        return "-"
    return f"{v:.0%}" if pct else f"{v:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--skip-trainer", action="store_true")
    ap.add_argument("--child", choices=["python", "matmul"], help=argparse.SUPPRESS)
    ap.add_argument("--probe", choices=["ours", "knocker", "none"], default="ours", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.threads, a.seconds, a.probe)
        return
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {a.threads} threads, "
          f"{a.seconds:g} s per workload")
    try:
        import gilknocker  # noqa: F401

        have_knocker = True
    except ImportError:
        have_knocker = False
        print("gilknocker is not installed (pip install gilknocker): its column stays empty")
    rows = {}
    for kind in ("python", "matmul"):
        on, spy = _run_child(kind, a.threads, a.seconds, "ours", spy=True)
        kn = _run_child(kind, a.threads, a.seconds, "knocker", spy=False)[0] if have_knocker else None
        off, _ = _run_child(kind, a.threads, a.seconds, "none", spy=False)
        rows[f"{a.threads} {kind} threads"] = {
            **on, "knocker": kn["knocker"] if kn else None, "pyspy": spy, "ratio": on["ops_per_s"] / off["ops_per_s"],
            "kratio": kn["ops_per_s"] / off["ops_per_s"] if kn else None,
            # what the trainer's verdict would say (dflash.telemetry.verdict.evidence.gil_bound)
            "verdict": gil_bound(Bottleneck(verdict="balanced"), on["probe"], on["cpu_percent"]).verdict}
    if not a.skip_trainer:
        rows["trainer (tiny-cpu)"] = trainer_row(a.seconds)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print()
    print("| workload | sleep probe | its wait/wake | gilknocker | py-spy GIL held | ops on/off: sleep probe | "
          "gilknocker | telemetry threads' py-spy samples | verdict |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        print(f"| {name} | {_fmt(r['probe'])} | {_fmt(r['probe_wait_ms'], False)} ms | {_fmt(r['knocker'])} | "
              f"{_fmt(r['pyspy'])} | {_fmt(r['ratio'], False)} | {_fmt(r['kratio'], False)} | "
              f"{_monitor(r.get('monitor'))} | {r['verdict']} |")


if __name__ == "__main__":
    main()
