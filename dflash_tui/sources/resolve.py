"""Turning what the user typed (a socket, a run directory, a recording, a run's name) into a path,
and opening the source that reads it."""

from __future__ import annotations

from pathlib import Path

from dflash.telemetry.wire.protocol import recording_filename
from dflash.telemetry.wire.sockets import (
    SocketInfo,
    default_socket_dir,
    discover,
    group_jobs,
    is_socket,
    read_hello,
)
from dflash_tui.sources.base import FrameSource
from dflash_tui.sources.live import LiveSource
from dflash_tui.sources.replay import ReplaySource


class AttachError(Exception):
    """The command-line target names nothing we can read; the message says what to do."""


def resolve(target: str | None, directory: Path | str | None = None) -> Path | None:
    """Turn the TARGET argument into a socket or a recording path (None: discover at runtime).

    A run directory of a running trainer (its hello names that run_dir) attaches live; any other run
    directory replays its telemetry.jsonl. A bare word that matches a running run's name attaches too.
    """
    if target is None:
        return None
    path = Path(target).expanduser()
    if is_socket(path):
        return path
    if path.is_dir():
        live = _live_socket_for_run_dir(path, directory)
        if live is not None:
            return live
        rec = path / recording_filename()
        if rec.exists():
            return rec
        raise AttachError(f"{path} has no {recording_filename()} and no running trainer writes to it")
    if path.is_file():
        return path
    matches = [i for i in discover(directory) if i.alive and i.run == target]
    if matches:
        return group_jobs(matches)[-1][0].path  # a multi-rank job is shown from rank 0
    raise AttachError(f"{target}: not a socket, a run directory, a {recording_filename()} or a running run's name "
                      f"(sockets are looked for in {Path(directory) if directory else default_socket_dir()})")


def _live_socket_for_run_dir(run_dir: Path, directory: Path | str | None) -> Path | None:
    for info in discover(directory):
        if info.alive and serves(info, run_dir):
            return info.path
    return None


def serves(info: SocketInfo, run: Path | str) -> bool:
    """Whether the trainer behind `info` is the run we want: a run directory (compared with the run_dir
    its hello names; a relative one is taken from our working directory) or a run name."""
    if isinstance(run, str):
        return info.run == run
    hello = read_hello(info.path, timeout=0.5)
    return hello is not None and bool(hello.run_dir) and Path(hello.run_dir).resolve() == run.resolve()


def open_source(path: Path, speed: float = 1.0, paused: bool = False) -> FrameSource:
    """A LiveSource for a socket, a ReplaySource for anything else."""
    if is_socket(path):
        return LiveSource(path)
    return ReplaySource(path, speed=speed, paused=paused)
