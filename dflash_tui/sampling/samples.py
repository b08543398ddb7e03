"""A window of py-spy samples: each thread's stacks in the order they were taken, and how often it held
the GIL, read from the speedscope files `py-spy record` writes.

Two records cover a window side by side: one of every thread at every sample (``--idle``: a thread
waiting on a queue is sampled too), one of the GIL holder only (``--gil``). Speedscope keeps each
thread's samples in order, so a run of samples in one stage reads as a span of that stage. The files
are py-spy's, written by us, but they are read with bounds all the same (size, gzip, frame indices).
"""

from __future__ import annotations

import gzip
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: a speedscope file larger than this is refused (a 2 s window of 64 threads is well under 10 MB)
MAX_SPEEDSCOPE_BYTES = 64 * 1024 * 1024
#: `Thread 8758 "MainThread"`, `Process 12 Thread 0x7F3A "name"` (no native id: the pthread id in hex)
_PROFILE_NAME = re.compile(r'^(?:Process (\d+) )?Thread (\S+) "(.*)"$', re.S)

#: one frame: (qualified function, file or native library)
Frame = tuple[str, str]


class SamplesError(ValueError):
    """A speedscope file that cannot be read as py-spy samples; the message says why."""


@dataclass
class ThreadSamples:
    #: native thread id (as `top -H` shows it); None when py-spy could only give the pthread id
    tid: int | None
    name: str
    #: every sample, in order: indices into Window.stacks
    samples: list[int] = field(default_factory=list)
    #: samples of the GIL record in which this thread held the GIL
    gil: int = 0


@dataclass
class Window:
    """What one window of sampling saw."""

    rate_hz: float
    #: each distinct stack once, outermost frame first
    stacks: list[tuple[Frame, ...]]
    threads: list[ThreadSamples]
    #: samples in which the GIL record found the GIL held, by any thread (None: no GIL record). That
    #: record samples at the same rate for the same time, so `samples` is its count of samples too
    gil_held: int | None = None
    native: bool = False

    @property
    def samples(self) -> int:
        """Samples per thread: the longest-lived thread's count (a thread born mid-window has fewer)."""
        return max((len(t.samples) for t in self.threads), default=0)


def load_json(path: Path | str, limit: int = MAX_SPEEDSCOPE_BYTES) -> Any:
    """A (possibly gzipped) JSON file, refused past `limit` bytes before and after decompressing."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > limit:
            raise SamplesError(f"{path}: {size} bytes, more than the {limit}-byte limit")
        with path.open("rb") as f:
            raw = f.read(limit + 1)
        if raw[:2] == b"\x1f\x8b":
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as g:
                raw = g.read(limit + 1)
        if len(raw) > limit:
            raise SamplesError(f"{path}: more than {limit} bytes once decompressed")
        return json.loads(raw)
    except (OSError, EOFError, ValueError) as e:
        if isinstance(e, SamplesError):
            raise
        raise SamplesError(f"{path}: not a readable speedscope file ({e})") from None


def thread_of(profile_name: str) -> tuple[int | None, str]:
    """(native id, name) from a speedscope profile's name as py-spy writes it."""
    m = _PROFILE_NAME.match(profile_name)
    if m is None:
        return None, profile_name
    tid = m.group(2)
    return (int(tid) if tid.isdigit() else None), m.group(3)


def _profiles(data: Any, path: str) -> tuple[list[Frame], list[tuple[int | None, str, list[list[int]]]]]:
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), list):
        raise SamplesError(f"{path}: not a speedscope file (no profiles)")
    shared = data.get("shared")
    raw_frames = shared.get("frames", []) if isinstance(shared, dict) else []
    frames: list[Frame] = [(str(f.get("name", "?")), str(f.get("file") or "")) if isinstance(f, dict) else ("?", "")
                           for f in raw_frames]
    out = []
    for prof in data["profiles"]:
        if not isinstance(prof, dict):
            continue
        tid, name = thread_of(str(prof.get("name", "")))
        stacks = [[i for i in s if isinstance(i, int) and 0 <= i < len(frames)]
                  for s in prof.get("samples", []) if isinstance(s, list)]
        out.append((tid, name, stacks))
    return frames, out


def read_window(all_threads: Path | str, gil: Path | str | None = None, *, rate_hz: float,
                native: bool = False) -> Window:
    """The window two py-spy records (`--idle`, and `--gil` when given) wrote."""
    frames, profiles = _profiles(load_json(all_threads), str(all_threads))
    index: dict[tuple[Frame, ...], int] = {}
    stacks: list[tuple[Frame, ...]] = []
    threads: list[ThreadSamples] = []
    for tid, name, samples in profiles:
        t = ThreadSamples(tid=tid, name=name)
        for s in samples:
            stack = tuple(frames[i] for i in s)
            sid = index.get(stack)
            if sid is None:
                sid = index[stack] = len(stacks)
                stacks.append(stack)
            t.samples.append(sid)
        threads.append(t)
    window = Window(rate_hz=rate_hz, stacks=stacks, threads=threads, native=native)
    if gil is not None:
        _, held = _profiles(load_json(gil), str(gil))
        by_key = {(t.tid, t.name): t for t in threads}
        window.gil_held = 0
        for tid, name, samples in held:
            window.gil_held += len(samples)
            owner = by_key.get((tid, name))
            if owner is not None:
                owner.gil += len(samples)
    return window
