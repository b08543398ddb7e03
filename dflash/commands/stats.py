"""`dflash stats <telemetry.jsonl>`: the per-category table of a recorded run (whole run or last N windows).

Torch-free and independent of a live trainer: it reads the same frames dflash-top replays.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from dflash.commands import CliError
from dflash.telemetry.summary import (
    WorkerStats,
    format_profile_stats,
    merge_windows,
    untracked_of,
)
from dflash.telemetry.verdict.evidence import analyze
from dflash.telemetry.wire.protocol import Bye, Event, Hello, Snapshot, training_shares
from dflash.telemetry.wire.reader import read_frames
from dflash.telemetry.wire.table import evidence_text, seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recording", type=Path, help="a telemetry.jsonl written by `dflash train`")
    parser.add_argument("--last", type=int, metavar="N", help="summarise only the last N windows (snapshots)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--limit", type=int, default=20, help="rows in the table (default 20)")
    parser.add_argument(
        "--by", choices=("worker", "category"), default="worker", help="one row per worker/category or per category"
    )


def _load(path: Path) -> tuple[list[tuple[Hello | None, list[Snapshot]]], list[Event], list[Bye], int]:
    """Frames grouped into run segments (a resumed run appends a new hello to the same file)."""
    if not path.exists():
        raise CliError(f"no such file: {path}")
    if path.is_dir():
        path_hint = path / "telemetry.jsonl"
        raise CliError(f"{path} is a directory; did you mean {path_hint}?")
    segments: list[tuple[Hello | None, list[Snapshot]]] = []
    events: list[Event] = []
    byes: list[Bye] = []
    bad: list[str] = []
    try:
        for frame in read_frames(path, on_error=lambda n, msg: bad.append(f"line {n}: {msg}")):
            if isinstance(frame, Hello):
                segments.append((frame, []))
            elif isinstance(frame, Snapshot):
                if not segments:
                    segments.append((None, []))
                segments[-1][1].append(frame)
            elif isinstance(frame, Event):
                events.append(frame)
            elif isinstance(frame, Bye):
                byes.append(frame)
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}") from None
    for msg in bad[:3]:
        print(f"dflash stats: warning: skipped malformed {msg}", file=sys.stderr)
    if len(bad) > 3:
        print(f"dflash stats: warning: skipped {len(bad) - 3} more malformed lines", file=sys.stderr)
    segments = [(h, snaps) for h, snaps in segments if snaps]
    if not segments:
        raise CliError(f"{path} holds no snapshot frames; is it a telemetry recording of a run that got going?")
    return segments, events, byes, len(bad)


def summarize(path: Path, last: int | None = None) -> dict[str, Any]:
    """The merged view of a recording, as plain data (what --json prints)."""
    if last is not None and last < 1:
        raise CliError("--last must be at least 1")
    segments, events, byes, bad = _load(path)
    snaps = [s for _, seg in segments for s in seg]
    hello = next((h for h, _ in reversed(segments) if h is not None), None)
    counters = dict(snaps[-1].counters)
    if last is not None:
        window = snaps[-last:]
        wall = sum(s.window_s or s.interval_s for s in window)
        workers: WorkerStats = merge_windows([s.workers for s in window], wall)
        before = snaps[-len(window) - 1].counters if len(snaps) > len(window) else {}
        made = {k: v - before.get(k, 0.0) for k, v in counters.items()}
        scope = f"last {len(window)} windows"
    else:
        window = snaps
        if len(segments) == 1:
            # the last snapshot's cumulative stats are exact (shares relative to each worker's life)
            workers = dict(snaps[-1].cumulative)
            wall = _duration(segments[0])
        else:
            wall = sum(_duration(seg) for seg in segments)
            workers = merge_windows([seg[1][-1].cumulative for seg in segments], wall)
            counters = {}
            for _, seg in segments:  # counters restart with each segment
                for k, v in seg[-1].counters.items():
                    counters[k] = counters.get(k, 0.0) + v
        made = counters
        scope = "whole run" + (f" ({len(segments)} segments)" if len(segments) > 1 else "")
    workers, evaluation_s = training_shares(workers)
    # per second of training: an evaluation pauses the pipeline, and its time would dilute every rate
    trained_s = wall - evaluation_s
    rates = {k: v / trained_s for k, v in made.items()} if trained_s > 0 else {}
    return {
        "recording": str(path),
        "run": hello.run if hello else None,
        "host": hello.host if hello else None,
        "pid": hello.pid if hello else None,
        "scope": scope,
        "windows": len(window),
        "wall_s": wall,
        "workers": workers,
        #: seconds spent evaluating (the pipeline paused): left out of the shares above
        "evaluation_s": evaluation_s,
        "untracked": untracked_of(workers),
        "counters": counters,
        "rates": rates,
        "gauges": dict(snaps[-1].gauges),
        "bottleneck": msgspec.structs.replace(analyze(workers, snaps[-1].roles), scope=scope),
        "events": len(events),
        "ended": byes[-1].reason if byes else None,
        "malformed_lines": bad,
    }


def _duration(segment: tuple[Hello | None, list[Snapshot]]) -> float:
    hello, snaps = segment
    if hello is not None and hello.started:
        return max(0.0, snaps[-1].t - hello.started)
    return sum(s.window_s or s.interval_s for s in snaps)


def run(args: argparse.Namespace) -> int:
    data = summarize(args.recording, args.last)
    if args.json:
        print(json.dumps(msgspec.to_builtins(data), indent=2, sort_keys=True))
        return 0
    who = f"run {data['run']!r}" if data["run"] else "run"
    if data["host"]:
        who += f" on {data['host']} (pid {data['pid']})"
    span = f"{data['scope']} ({seconds(data['wall_s'])})"
    if data["scope"].startswith("whole run"):
        span = f"{data['scope']}: {data['windows']} windows, {seconds(data['wall_s'])}"
    print(f"{who}: {span}")
    print(format_profile_stats(data["workers"], limit=args.limit, by=args.by))
    if data["evaluation_s"]:
        print(f"evaluation: {seconds(data['evaluation_s'])} (training paused; not in the shares above)")
    if data["untracked"]:
        print("untracked: " + ", ".join(f"{w} {u:.0%}" for w, u in sorted(data["untracked"].items())))
    if data["counters"]:
        print(
            "counters: "
            + ", ".join(
                f"{k} {v:,.0f} ({data['rates'].get(k, 0.0):,.1f}/s)" for k, v in sorted(data["counters"].items())
            )
        )
    if data["gauges"]:
        print("gauges (last): " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(data["gauges"].items())))
    b = data["bottleneck"]
    print(f"bottleneck ({b.scope}): {b.verdict}: {b.reason}")
    if b.evidence:
        print(f"  evidence: {evidence_text(b.evidence)}")
    if data["ended"]:
        print(f"ended: {data['ended']}")
    else:
        print("ended: no bye frame (the run is live, or was killed)")
    return 0
