"""What the benchmark scripts share: their common command line, how busy the rest of the machine was
during a run, and how a report is printed.

On a machine of two shared cores any other job halves the figures, so every benchmark reports the
load other processes put on the machine while it ran (`foreign_load_cores`) instead of figures that
silently mix both.
"""

from __future__ import annotations

import argparse
import json
import time

import psutil


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's argument parser: described by its docstring's first line, with `--json`."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def bench_args(doc: str, options: dict[str, tuple[object, str]], quick: tuple[str, dict]) -> argparse.Namespace:
    """A benchmark's command line from its docstring and its settings (name -> (default, help); the
    type is the default's), with `--json` and `--quick`: `quick` is (what the smoke run is, the
    settings it replaces), the run its test makes to prove the script works."""
    p = bench_parser(doc)
    p.add_argument("--quick", action="store_true", help=quick[0])
    for name, (default, text) in options.items():
        # `--max-tokens` as the docs write it; the setting's own name (`--max_tokens`) still reads
        flags = dict.fromkeys((f"--{name.replace('_', '-')}", f"--{name}"))
        p.add_argument(*flags, dest=name, type=type(default), default=default, help=f"{text} (default {default})")
    args = p.parse_args()
    if args.quick:
        vars(args).update(quick[1])
    return args


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent non-idle since boot (guest time is already in user)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)


def process_seconds(p: psutil.Process) -> float:
    """CPU seconds of `p` and of the children it has waited for; 0 for a process that is gone."""
    try:
        c = p.cpu_times()
        return c.user + c.system + c.children_user + c.children_system
    except psutil.Error:
        return 0.0


class ForeignLoad:
    """Cores that processes other than ours kept busy during a `with` block: the machine's busy CPU
    minus this process's (with the children it waited for) and that of the live processes `ours`.

        with ForeignLoad() as load:
            ...
        report["foreign_load_cores"] = round(load.cores, 2)
    """

    def __init__(self, *ours: psutil.Process) -> None:
        self.procs = [psutil.Process(), *ours]
        self.cores = 0.0

    def _own(self) -> float:
        return sum(process_seconds(p) for p in self.procs)

    def __enter__(self) -> ForeignLoad:
        self.t0, self.busy0, self.own0 = time.monotonic(), busy_seconds(), self._own()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self.t0
        self.cores = max(0.0, ((busy_seconds() - self.busy0) - (self._own() - self.own0)) / wall)


def print_report(report: dict, as_json: bool) -> None:
    """JSON, or one aligned line per figure plus a warning when other processes loaded the machine."""
    if as_json:
        print(json.dumps(report, indent=2))
        return
    width = max(len(k) for k in report)
    for k, v in report.items():
        print(f"{k:>{width}}: {v}")
    if report.get("busy_machine"):
        print(f"WARNING: other processes used {report['foreign_load_cores']:.2f} cores during the run; "
              "figures are unreliable")


def rate_after(stamps: list[float], warmup: int) -> float:
    """Steps per second between the end of step `warmup` and the last step (the warm-up left out)."""
    steady = stamps[warmup - 1:]
    return (len(steady) - 1) / (steady[-1] - steady[0])


def steady_steps_per_s(trainer, warmup: int) -> float:
    """Run a Trainer to its end, stamping each step as the trainer finishes it; its steady rate."""
    stamps: list[float] = []
    inner = trainer.on_step

    def on_step(r):
        stamps.append(time.perf_counter())
        return inner(r)

    trainer.on_step = on_step
    assert trainer.run() == 0
    return rate_after(stamps, warmup)
