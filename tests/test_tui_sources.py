"""What a source can do is the source's to say: the app offers replay keys for any source with
`playback` and trainer keys for any with `live`, whatever its class; the rank keys' decisions live in
a Textual-free helper, checked here on real sockets."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from test_tui_snapshots import settle, utc  # noqa: F401 (utc: autouse fixture)

from dflash.telemetry.wire.sockets import socket_filename
from dflash_tui import synthetic
from dflash_tui.app import DFlashTop
from dflash_tui.ranks import RankFollower
from dflash_tui.sources import Connection, LiveSource, MemorySource, ReplaySource
from dflash_tui.state import RunState


class SteppedFrames(MemorySource):
    """Fixed frames that a viewer steps through: another kind of source with replay controls."""

    def __init__(self) -> None:
        super().__init__(synthetic.frames(10), detail="stepped frames")
        self.playback = self
        self.speed, self.paused, self.start_t, self.end_t = 1.0, False, None, None
        self.calls: list[str] = []

    def toggle_pause(self) -> None:
        self.paused = not self.paused
        self.calls.append("pause" if self.paused else "resume")

    def step(self) -> None:
        self.calls.append("step")

    def set_speed(self, speed: float) -> None:
        self.speed = speed
        self.calls.append(f"speed {speed:g}")

    def seek(self, delta: float | None = None, to: float | None = None) -> None:
        self.calls.append(f"seek {delta:+g}")

    def where(self) -> str:
        return "stepped"


async def test_replay_keys_follow_the_sources_playback_not_its_class() -> None:
    source = SteppedFrames()
    app = DFlashTop(source=source, pyspy_exe="py-spy")
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        for key in ("space", "n", "plus", "full_stop", "space"):
            await pilot.press(key)
        await pilot.pause()
        assert source.calls == ["pause", "step", "speed 2", "seek +10", "resume"]
        assert app.check_action("snapshot", ()) is False  # no `live`: nothing to ask for stacks
        assert app.state.connection == Connection.ENDED

    fixed = DFlashTop(source=MemorySource(synthetic.frames(3)), pyspy_exe="py-spy")
    async with fixed.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        assert fixed.check_action("pause", ()) is False and fixed.check_action("seek", ()) is False


def test_sources_state_their_capabilities(tmp_path: Path) -> None:
    replay = ReplaySource(tmp_path / "telemetry.jsonl")
    live = LiveSource(tmp_path / "x.sock")
    assert replay.playback is replay and replay.live is None
    assert live.live is live and live.playback is None
    assert MemorySource([]).playback is None and MemorySource([]).live is None
    assert Connection.UNTRUSTED.away and Connection.DISCONNECTED.away and not Connection.LIVE.away
    assert f"{Connection.PAUSED}" == "paused"


def _listen(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(1)
    return s


def test_rank_follower_finds_the_jobs_sockets_and_wants_rank_0_for_the_cluster_view(tmp_path: Path) -> None:
    sock_dir = tmp_path / "socks"
    sock_dir.mkdir(mode=0o700)
    paths = {r: sock_dir / socket_filename("job", os.getpid(), r) for r in (0, 1)}
    listeners = [_listen(p) for p in paths.values()]
    try:
        state = RunState()
        follow = RankFollower(state)
        state.apply(synthetic.hello(run="job", rank=1, world_size=3))
        live = LiveSource(paths[1])  # never started: only its name and directory are read
        assert follow.local(live) == paths
        assert follow.next(live, +1) == 2 and follow.next(live, -1) == 0
        assert follow.cluster_feed(live) == paths[0]  # rank 1 shown: rank 0 publishes the cluster view
        assert follow.select(0, live) == paths[0] and state.selected_rank == 0 and state.rank_note == ""
        assert follow.select(2, live) is None and "rank 2 has no live socket of this run" in state.rank_note
        choices = {c.rank: c for c in follow.choices(live)}
        assert choices[1].why == "shown now" and choices[0].path == paths[0] and choices[2].path is None

        # a recording holds one rank: nothing to follow, and no second connection
        assert follow.cluster_feed(None) is None
        assert follow.select(0, None) is None and "replay telemetry.jsonl" in state.rank_note
    finally:
        for s in listeners:
            s.close()
