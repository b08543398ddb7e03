"""`dflash-top`'s command line: arguments, `--list`, `--once`, and starting the app."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from dflash.telemetry.wire.sockets import default_socket_dir, discover, group_jobs, is_socket, read_hello
from dflash_tui.ranks import rank_list
from dflash_tui.sources import AttachError, resolve
from dflash_tui.sources.sampled import RATE_HZ, SampledSource


def list_sockets(directory: Path | None) -> int:
    d = directory or default_socket_dir()
    found = discover(d)
    if not found:
        print(f"no trainer sockets in {d}", file=sys.stderr)
        return 1
    print(f"{'STATE':<6} {'RUN':<20} {'PID':>8} {'RANK':>5} {'HOST':<16} {'RUN DIR':<24} SOCKET")
    for job in group_jobs(found):
        hellos = [read_hello(info.path, timeout=0.5) if info.alive else None for info in job]
        for info, hello in zip(job, hellos, strict=True):
            rank = "-" if info.rank is None else f"{info.rank}/{hello.world_size}" if hello else str(info.rank)
            print(f"{'live' if info.alive else 'stale':<6} {(info.run or '?'):<20.20} {info.pid or '?':>8} "
                  f"{rank:>5} {(hello.host if hello else '-'):<16.16} "
                  f"{((hello.run_dir or '-') if hello else '-'):<24} {info.path}")
        if len(job) > 1:
            world = next((h.world_size for h in hellos if h is not None), None)
            print(f"{'':<6} └ one job: ranks {rank_list(i.rank or 0 for i in job)}"
                  + (f" of {world}" if world else "") + f" on this machine; dflash-top shows it from rank "
                  f"{job[0].rank}, [ ] switch ranks")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-top", description="Live view of a dflash trainer: where the time goes, "
                                "GPUs, threads, and one-key py-spy snapshots.")
    p.add_argument("target", nargs="?", help="a trainer socket, a run directory, a telemetry.jsonl (replay) or a "
                   "running run's name; default: find the running trainers")
    p.add_argument("--list", action="store_true", help="print the trainer sockets found and exit")
    p.add_argument("--once", action="store_true", help="print one summary (table, bottleneck, GPUs) and exit")
    p.add_argument("--json", action="store_true", help="with --once: print the summary as JSON")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed multiplier (0 = as fast as possible)")
    p.add_argument("--paused", action="store_true", help="start a replay paused (space plays, n steps)")
    p.add_argument("--wait", action="store_true", help="TARGET is a run directory or run name that may not "
                   "be running yet: wait for its trainer instead of replaying its recording")
    p.add_argument("--socket-dir", type=Path, default=None, help="where to look for sockets "
                   "(default $XDG_RUNTIME_DIR/dflash or /tmp/dflash-$UID)")
    p.add_argument("--timeout", type=float, default=10.0, help="--once: seconds to wait for a snapshot")
    p.add_argument("--pyspy-timeout", type=float, default=10.0, help="kill a py-spy dump after this many seconds")
    p.add_argument("--record-seconds", type=float, default=10.0, help="default duration of `r` (py-spy record)")
    s = p.add_argument_group("sampling any PyTorch process (no dflash trainer needed; docs/sampling.md)")
    s.add_argument("--pid", type=int, default=None, help="watch this process from outside: sample its stacks with "
                   "py-spy (it is never paused), its threads' CPU and its GPUs")
    s.add_argument("--duration", type=float, default=None, help="with --pid: sample this many seconds, then stop "
                   "(--once: default 10)")
    s.add_argument("--record", type=Path, default=None, metavar="FILE", help="with --pid: also write the frames to "
                   "FILE, a recording `dflash-top FILE` replays")
    s.add_argument("--native", action="store_true", help="with --pid: native C/CUDA frames too (host syncs show); "
                   "py-spy then stops the process at every sample")
    s.add_argument("--rate", type=int, default=None, help="with --pid: samples per second (default 100)")
    return p


def sampled_source(args: argparse.Namespace, duration: float | None) -> SampledSource:
    """The source for `--pid`; AttachError (one line) when the process or the flags are not right."""
    from dflash_tui.sampling.processes import describe

    if describe(args.pid) is None:
        raise AttachError(f"--pid {args.pid}: no such process on this machine (or not ours to see); "
                          "run without --pid to list the Python processes using torch")
    if duration is not None and duration < 1:
        raise AttachError(f"--duration {duration:g}: sample for at least 1 second")
    if args.rate is not None and not 1 <= args.rate <= 1000:
        raise AttachError(f"--rate {args.rate}: between 1 and 1000 samples per second")
    return SampledSource(args.pid, native=args.native, duration=duration, record_to=args.record,
                         rate_hz=args.rate or RATE_HZ)


def sampling_misuse(args: argparse.Namespace) -> str | None:
    """Why the sampling flags do not fit the rest of the command line (None: they do)."""
    if args.pid is None:
        given = [flag for flag, v in (("--duration", args.duration), ("--record", args.record),
                                      ("--native", args.native or None), ("--rate", args.rate)) if v is not None]
        if given:
            return (f"{', '.join(given)} samples a process: add --pid PID (a dflash trainer records its own "
                    "telemetry.jsonl)")
    elif args.target is not None:
        return f"--pid {args.pid} and {args.target}: watch one thing at a time"
    return None


def watch(args: argparse.Namespace) -> int:
    """`--pid`: the sampled view, or with --once its summary after --duration seconds (default 10)."""
    once = args.once or args.json
    duration = args.duration if args.duration is not None or not once else 10.0
    try:
        source = sampled_source(args, duration)
    except AttachError as e:
        print(f"dflash-top: {e}", file=sys.stderr)
        return 2
    if once:
        from dflash_tui.headless import summarize_source

        return summarize_source(source, f"pid {args.pid}", args.json, timeout=duration + max(30.0, args.timeout))
    return run_app(args, source=source)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    misuse = sampling_misuse(args)
    if misuse is not None:
        print(f"dflash-top: {misuse}", file=sys.stderr)
        return 2
    if args.list:
        return list_sockets(args.socket_dir)
    if args.pid is not None:
        return watch(args)
    if args.once or args.json:
        from dflash_tui.headless import run_once

        return run_once(args.target, args.json, timeout=args.timeout,
                        directory=str(args.socket_dir) if args.socket_dir else None)
    wait_for: Path | str | None = None
    if args.wait and args.target and not is_socket(Path(args.target)):
        given = Path(args.target).expanduser()
        wait_for = given if (given.is_dir() or "/" in args.target) else args.target
        target = None
    else:
        try:
            target = resolve(args.target, args.socket_dir)
        except AttachError as e:
            print(f"dflash-top: {e}", file=sys.stderr)
            return 2
    return run_app(args, target=target, wait_for=wait_for)


def run_app(args: argparse.Namespace, target: Path | None = None, wait_for: Path | str | None = None,
            source: SampledSource | None = None) -> int:
    if not (sys.stdin.isatty() and sys.__stderr__.isatty()):
        print("dflash-top: not a terminal; use --once (or --once --json) for a printed summary",
              file=sys.stderr)
        return 2
    from dflash_tui.app import DFlashTop  # Textual only for the interactive view

    app = DFlashTop(target, socket_directory=args.socket_dir, speed=args.speed if args.speed > 0 else math.inf,
                    paused=args.paused, pyspy_timeout=args.pyspy_timeout, record_seconds=args.record_seconds,
                    wait_for=wait_for, source=source, freeze_heap=True)
    app.run()
    return app.return_code or 0


if __name__ == "__main__":
    sys.exit(main())
