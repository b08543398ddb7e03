"""Following one rank of a multi-rank job: which ranks there are, where each one's socket is, which one
the rank keys go to next, and when a second connection to rank 0 is needed for the cluster view.

Textual-free, so the app only binds keys to it and attaches where it says; tests drive it with real
sockets and a `RunState`.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dflash.telemetry.wire.protocol import ClusterRank, recording_filename
from dflash.telemetry.wire.sockets import SocketInfo, discover, is_socket, pid_alive
from dflash_tui.sources import LiveLink
from dflash_tui.state import RunState


def rank_list(ranks: Iterable[int]) -> str:
    """`0-3,6` for ranks 0, 1, 2, 3 and 6."""
    spans: list[list[int]] = []
    for r in sorted(set(ranks)):
        if spans and spans[-1][1] == r - 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def job_label(job: list[SocketInfo]) -> str:
    """How the picker names a job: a lone socket by its own label, a multi-rank job by its ranks here."""
    lead = job[0]
    if len(job) == 1:
        return lead.label
    return f"{lead.run} (ranks {rank_list(i.rank or 0 for i in job)} here; rank {lead.rank} is pid {lead.pid})"


def rank_sockets(run: str, directory: Path | str | None) -> dict[int, Path]:
    """This machine's sockets of `run`, by rank (the newest when a rank has several). Judged by the
    pid in the name rather than by connecting, so that the UI thread may ask on a key press."""
    found: dict[int, Path] = {}
    for info in sorted(discover(directory, check_alive=False), key=lambda i: i.mtime):
        if info.run == run and info.rank is not None and info.pid is not None and pid_alive(info.pid):
            found[info.rank] = info.path
    return found


def rank_socket(rank: int, local: dict[int, Path], directory: Path | str | None,
                reported: ClusterRank | None = None) -> tuple[Path | None, str]:
    """Where rank `rank` of a job can be attached from this machine, or None and why not.

    The socket rank 0 reported for it counts when it is a socket here (its host is ours); else the
    job's socket for that rank in `local` (`rank_sockets()`: a rank that restarted has a new pid, so a
    new name). `directory` is only named in the explanation.
    """
    here = socket.gethostname()
    if (reported is not None and reported.socket and reported.host in ("", here)
            and is_socket(Path(reported.socket))):
        return Path(reported.socket), ""
    if rank in local:
        return local[rank], ""
    if reported is not None and reported.host and reported.host != here:
        return None, (f"rank {rank} runs on {reported.host}: its socket is not on this machine "
                      f"(ssh {reported.host} and run dflash-top there)")
    if reported is not None and reported.state == "silent":
        return None, f"rank {rank} has not reported yet and has no socket in {directory}"
    return None, f"rank {rank} has no live socket of this run in {directory}"


def step_rank(ranks: list[int], current: int | None, delta: int) -> int | None:
    """The rank `delta` places after `current` in `ranks`, wrapping around (from nothing: the first
    or the last); None when there are no ranks."""
    if not ranks:
        return None
    if current is None or current not in ranks:
        after = [r for r in ranks if current is None or (r > current if delta > 0 else r < current)]
        if not after:
            return ranks[0] if delta > 0 else ranks[-1]
        return after[0] if delta > 0 else after[-1]
    return ranks[(ranks.index(current) + delta) % len(ranks)]


@dataclass
class RankChoice:
    """One line of the rank picker."""

    rank: int
    #: what rank 0 last said about it (None: nothing yet)
    info: ClusterRank | None
    #: its socket here, or None and why not
    path: Path | None
    why: str


class RankFollower:
    """The decisions behind the rank keys for the run in `state`, seen through the current source's
    `live` link (None: a recording, which holds one rank)."""

    def __init__(self, state: RunState) -> None:
        self.state = state

    def local(self, live: LiveLink | None) -> dict[int, Path]:
        """The job's sockets on this machine, by rank (they share the socket directory)."""
        if live is None or live.info.run is None:
            return {}
        return rank_sockets(live.info.run, live.path.parent)

    def locate(self, rank: int, live: LiveLink | None, local: dict[int, Path] | None = None) -> tuple[Path | None, str]:
        if live is None:
            return None, f"rank {rank}: a recording holds one rank; replay {recording_filename(rank)}"
        return rank_socket(rank, self.local(live) if local is None else local, live.path.parent,
                           self.state.cluster_rank(rank))

    @property
    def current(self) -> int | None:
        st = self.state
        return st.selected_rank if st.selected_rank is not None else st.shown_rank

    def next(self, live: LiveLink | None, delta: int) -> int | None:
        """The rank `[`/`]` go to."""
        return step_rank(self.state.job_ranks(self.local(live)), self.current, delta)

    def choices(self, live: LiveLink | None) -> list[RankChoice]:
        st = self.state
        local = self.local(live)
        out = []
        for r in st.job_ranks(local):
            path, why = (None, "shown now") if r == st.shown_rank else self.locate(r, live, local)
            out.append(RankChoice(r, st.cluster_rank(r), path, why))
        return out

    def select(self, rank: int, live: LiveLink | None) -> Path | None:
        """Choose `rank`; the socket to attach to when it is another one on this machine, else None (and
        `state.rank_note` says why not, when it cannot be shown)."""
        st = self.state
        st.selected_rank = rank
        path, why = (None, "") if rank == st.shown_rank else self.locate(rank, live)
        st.rank_note = why if path is None else ""
        return path

    def cluster_feed(self, live: LiveLink | None) -> Path | None:
        """Rank 0's socket while the panels show another rank of a multi-rank run (only rank 0 publishes
        the cluster view); None when no second connection is wanted or rank 0 is not here."""
        hello = self.state.hello
        if hello is None or hello.world_size <= 1 or hello.rank == 0 or live is None:
            return None
        return self.locate(0, live)[0]
