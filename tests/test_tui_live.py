"""dflash-top against real trainers' telemetry: pilot tests of the Textual app, the live source and the CLI.

Trainers here are a real TelemetryServer fed by a scripted workload, either in this process (so a
test can stop and restart it) or in a child process (so py-spy has another process to attach to and
a restart gets a new pid, as a real restart does).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import screen_text, until
from textual.containers import VerticalScroll

from dflash.telemetry import ProfileStats, TelemetryServer
from dflash.telemetry.wire import protocol
from dflash.telemetry.wire.verdicts import VERDICTS
from dflash_tui import synthetic
from dflash_tui.app import YOUNG_GENERATION, DFlashTop
from dflash_tui.pyspy import ProfileFailure, StackReport, find_pyspy
from dflash_tui.sources import Connection, LiveSource, ReplaySource
from dflash_tui.widgets.categories import CategoryTable
from dflash_tui.widgets.cluster import STRAGGLER, ClusterPanel
from dflash_tui.widgets.events import EventsLog
from dflash_tui.widgets.picker import ChoiceScreen, PickerScreen, WaitingScreen
from dflash_tui.widgets.stacks import StacksScreen

PY = sys.executable

# A trainer in miniature: the real server, a hot target worker and a mostly-waiting drafter.
TRAINER = r"""
import signal, sys, threading, time
from dflash.telemetry import ProfileStats, TelemetryServer
run, sock_dir, run_dir = sys.argv[1], sys.argv[2], sys.argv[3]
stats = ProfileStats()
server = TelemetryServer(run=run, stats=stats, interval_s=0.2, run_dir=run_dir, socket_dir=sock_dir).start()
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
def target():
    w = stats.worker("target-0")
    while True:
        with w.span("target_forward"):
            t = time.perf_counter()
            while time.perf_counter() - t < 0.008:
                pass
        with w.span("hs_queue_put"):
            time.sleep(0.004)
def drafter():
    w = stats.worker("drafter-0")
    while True:
        with w.span("hs_queue_wait"):
            time.sleep(0.02)
        with w.span("drafter_forward"):
            time.sleep(0.004)
for fn, name in ((target, "target-0"), (drafter, "drafter-0")):
    threading.Thread(target=fn, name=name, daemon=True).start()
print(server.path, flush=True)
step = 0
while True:
    step += 1
    stats.count("steps"); stats.count("tokens", 512); stats.gauge("step", step)
    stats.gauge("loss", 3.0 / step ** 0.1); stats.metric("sim_tau", 2.0)
    if step % 10 == 0:
        server.publish_event("checkpoint", f"saved step {step}", step=step)
    time.sleep(0.05)
"""


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """Socket directories need short paths (sun_path is 107 bytes; pytest's tmp_path can be longer)."""
    d = Path(tempfile.mkdtemp(prefix="dftui-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Workload:
    """An in-process TelemetryServer fed by a scripted worker thread (timings, counters, events)."""

    CATS = ("target_forward", "pack_hidden", "hs_queue_put")
    DCATS = ("hs_queue_wait", "drafter_forward", "drafter_backward")

    def __init__(self, run: str, sock_dir: Path, run_dir: Path, interval_s: float = 0.1, **server_kw) -> None:
        self.stats = ProfileStats()
        self.server = TelemetryServer(run=run, stats=self.stats, interval_s=interval_s, run_dir=run_dir,
                                      socket_dir=sock_dir, **server_kw)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="workload", daemon=True)

    def start(self) -> Workload:
        self.server.start()
        self._thread.start()
        return self

    def _work(self) -> None:
        t, d = self.stats.worker("target-0"), self.stats.worker("drafter-0")
        step = 0
        while not self._stop.is_set():
            step += 1
            for i, c in enumerate(self.CATS):
                t.add(c, 0.004 / (i + 1))
            for i, c in enumerate(self.DCATS):
                d.add(c, 0.003 / (i + 1))
            self.stats.count("steps")
            self.stats.count("tokens", 1024)
            self.stats.gauge("loss", 2.0 + 1.0 / step)
            self.stats.metric("sim_tau", 2.5)
            if step % 15 == 0:
                self.server.publish_event("checkpoint", f"saved step {step}", step=step)
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.server.close()


@pytest.fixture
def workloads() -> Iterator[Callable[..., Workload]]:
    made: list[Workload] = []

    def make(run: str, sock_dir: Path, run_dir: Path, **kw) -> Workload:
        w = Workload(run, sock_dir, run_dir, **kw).start()
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


@pytest.fixture
def trainers() -> Iterator[Callable[..., tuple[subprocess.Popen, Path]]]:
    procs: list[subprocess.Popen] = []

    def spawn(run: str, sock_dir: Path, run_dir: Path) -> tuple[subprocess.Popen, Path]:
        p = subprocess.Popen([PY, "-c", TRAINER, run, str(sock_dir), str(run_dir)], stdout=subprocess.PIPE)
        procs.append(p)
        assert p.stdout is not None
        return p, Path(p.stdout.readline().decode().strip())

    yield spawn
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def text_of(app: DFlashTop, selector: str) -> str:
    w = app.query_one(selector)
    content = getattr(w, "content", None)
    return (content if content is not None else w.render()).plain


# ----------------------------------------------------------------------------- pilot tests


async def test_attaches_and_fills_every_panel_at_80x24(short_dir: Path, workloads) -> None:
    wl = workloads("pilot", short_dir / "s", short_dir / "run")
    app = DFlashTop(wl.server.path)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.state.snapshot is not None and len(app.state.workers) == 2, "2 workers")
        await until(pilot, lambda: app.state.events, "an event")
        # a panel is drawn while in view: at 80x24 most are below the fold, and each is scrolled to
        shown_verdicts = {v.upper() for v in VERDICTS}
        for box, drawn in (("p-bars", lambda: "drafter-0" in text_of(app, "#bars")),
                           ("p-table", lambda: app.query_one(CategoryTable).row_count),
                           ("p-threads", lambda: "dflash-telemetry" in text_of(app, "#threads")),
                           ("p-curves", lambda: "loss" in text_of(app, "#curves")),
                           ("p-events", lambda: app.query_one(EventsLog).lines),
                           ("p-bottleneck", lambda: text_of(app, "#bottleneck").split()[0] in shown_verdicts)):
            app.query_one(f"#{box}").scroll_visible(animate=False, top=True)
            await until(pilot, drawn, f"#{box} drawn once in view")
        await until(pilot, lambda: app.screen.has_class("-narrow") and "LIVE" in text_of(app, "#header"),
                    "the narrow layout")
        header = text_of(app, "#header")
        assert "LIVE" in header and "run pilot" in header and f"pid {os.getpid()}" in header
        bars = text_of(app, "#bars")
        assert "target-0" in bars and "drafter-0" in bars and "untr" in bars
        table = app.query_one(CategoryTable)
        table.parent.scroll_visible(animate=False, top=True)
        await until(pilot, lambda: table.row_count == len(Workload.CATS) + len(Workload.DCATS), "all table rows")
        gpus = text_of(app, "#gpus")
        assert "GPU0" in gpus or "no NVIDIA driver" in gpus or "no GPUs" in gpus
        assert "workload" in text_of(app, "#threads") and "dflash-telemetry" in text_of(app, "#threads")
        assert "loss" in text_of(app, "#curves")
        assert app.query_one(EventsLog).lines, "events reach the log"
        # the status line's last row says the cadence (the header's uptime shows the stream moving): a
        # count that ticked there every snapshot made each frame redraw the whole screen
        interval = f"a snapshot every {app.state.hello.interval_s:g} s"
        await until(pilot, lambda: interval in screen_text(app).splitlines()[-2], "the cadence on the status line")
        await pilot.press("2")
        assert app.screen.maximized is app.query_one("#p-table")
        await pilot.press("2")
        assert app.screen.maximized is None


async def test_disconnect_keeps_data_and_reattaches(short_dir: Path, workloads) -> None:
    wl = workloads("flaky", short_dir / "s", short_dir / "run")
    app = DFlashTop(wl.server.path)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.state.snapshots >= 2, "snapshots")
        wl.close()
        await until(pilot, lambda: app.disconnected, "disconnected")
        await until(pilot, lambda: "DISCONNECTED" in text_of(app, "#header"), "the header to say so")
        assert (app.state.connection == Connection.DISCONNECTED
                and "trainer exited (shutdown)" in app.state.connection_detail)
        assert app.screen.has_class("-disconnected")
        assert app.state.workers and app.query_one(CategoryTable).row_count > 0, "last data kept"
        seen = app.state.snapshots
        workloads("flaky", short_dir / "s", short_dir / "run")
        await until(pilot, lambda: app.state.connection == Connection.LIVE and app.state.snapshots > seen + 1,
                    "reattached")
        assert not app.disconnected


async def test_waits_for_a_trainer_then_attaches(short_dir: Path, workloads) -> None:
    sock_dir = short_dir / "s"
    # no torch process to offer instead, whatever else runs on the machine (tests/test_sampled_source.py
    # has the offer)
    app = DFlashTop(None, socket_directory=sock_dir, processes=list)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, WaitingScreen), "the waiting screen")
        workloads("late", sock_dir, short_dir / "run")
        await until(pilot, lambda: app.state.hello is not None and app.state.hello.run == "late", "attach")
        assert not isinstance(app.screen, WaitingScreen)


async def test_picker_when_several_trainers_run(short_dir: Path, workloads) -> None:
    sock_dir = short_dir / "s"
    workloads("alpha", sock_dir, short_dir / "a")
    workloads("beta", sock_dir, short_dir / "b")
    app = DFlashTop(None, socket_directory=sock_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, PickerScreen), "the picker")
        await pilot.press("down", "enter")
        await until(pilot, lambda: app.state.hello is not None, "attach")
        assert app.state.hello.run == "beta"


async def test_wait_attaches_only_to_the_named_run_dir(short_dir: Path, workloads) -> None:
    sock_dir = short_dir / "s"
    workloads("other", sock_dir, short_dir / "other")
    mine = short_dir / "mine"
    app = DFlashTop(None, socket_directory=sock_dir, wait_for=mine)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: isinstance(app.screen, WaitingScreen), "the waiting screen")
        await pilot.pause(1.2)  # a discovery pass saw "other" and ignored it
        assert app.source is None and isinstance(app.screen, WaitingScreen)
        workloads("mine", sock_dir, mine)
        await until(pilot, lambda: app.state.hello is not None, "attach")
        assert app.state.hello.run == "mine" and app.state.hello.run_dir == str(mine)


@pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed")
async def test_snapshot_key_dumps_the_hot_thread_first(short_dir: Path, trainers) -> None:
    run_dir = short_dir / "run"
    proc, path = trainers("spy", short_dir / "s", run_dir)
    app = DFlashTop(path, pyspy_timeout=30)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.state.system is not None and app.state.snapshots >= 3, "thread CPU")
        await pilot.press("s")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen), "the stacks screen", timeout=30)
        await pilot.pause()
        report = app.screen.result
        assert isinstance(report, StackReport), getattr(report, "reason", report)
        assert report.pid == proc.pid
        assert report.threads[0].name == "target-0", [(t.name, t.cpu_percent) for t in report.threads]
        assert report.threads[0].cpu_percent and report.threads[0].cpu_percent > 5
        saved = sorted((run_dir / "pyspy").iterdir())
        assert [p.suffix for p in saved] == [".json", ".txt"]
        assert "target-0" in saved[1].read_text()
        body = app.screen.query_one("#stacks-body").content.plain
        assert "target-0" in body and "saved" in body
        assert "hot-thread snapshot (py-spy" in screen_text(app)
        # read down the dump, then ask for the trainer's own stacks: a new title, read from the top,
        # files named by their package path, saved apart from py-spy's output
        scroll = app.screen.query_one(VerticalScroll)
        scroll.scroll_end(animate=False)
        await until(pilot, lambda: scroll.scroll_y > 0, "the dump scrolled down")
        await pilot.press("t")
        await until(pilot, lambda: isinstance(app.screen.result, StackReport)
                    and app.screen.result.source == "trainer stacks", "the trainer's stacks", timeout=15)
        await until(pilot, lambda: "the trainer's own stacks" in screen_text(app) and scroll.scroll_y == 0,
                    "its title, at the top")
        assert "hot-thread snapshot" not in screen_text(app)
        # the telemetry thread's frames, named by package path, wherever the threads' CPU order puts them
        body = app.screen.query_one("#stacks-body").content.plain.splitlines()
        line = next(i for i, text in enumerate(body) if "dflash/telemetry/" in text)
        scroll.scroll_to(y=max(0, line - 2), animate=False)
        await until(pilot, lambda: "dflash/telemetry/" in screen_text(app), "a frame's package path on the screen")
        assert sorted(p.suffix for p in (run_dir / "stacks").iterdir()) == [".json", ".txt"]
        assert len(list((run_dir / "pyspy").iterdir())) == 2, "py-spy's directory holds only py-spy's dump"
        await pilot.press("escape")
        assert not isinstance(app.screen, StacksScreen)


async def test_refused_ptrace_explains_and_offers_trainer_stacks(short_dir: Path, trainers, tmp_path: Path) -> None:
    setpriv, pyspy = shutil.which("setpriv"), find_pyspy()
    if os.geteuid() != 0 or not setpriv or not pyspy:
        pytest.skip("needs root, setpriv and py-spy to produce a real ptrace refusal")
    exe = tmp_path / "py-spy"
    exe.write_text(f'#!/bin/sh\nexec {setpriv} --reuid=65534 --regid=65534 --clear-groups {pyspy} "$@"\n')
    exe.chmod(0o755)
    proc, path = trainers("refused", short_dir / "s", short_dir / "run")
    app = DFlashTop(path, pyspy_exe=str(exe))
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.state.snapshots >= 2, "snapshots")
        await pilot.press("s")
        await until(pilot, lambda: isinstance(app.screen, StacksScreen), "the explanation", timeout=30)
        await pilot.pause()
        failure = app.screen.result
        assert isinstance(failure, ProfileFailure) and failure.permission
        body = app.screen.query_one("#stacks-body").content.plain
        assert "ptrace" in body and "SYS_PTRACE" in body and "sudo" in body and "press t" in body
        await pilot.press("t")
        await until(pilot, lambda: isinstance(app.screen.result, StackReport), "the trainer's stacks", timeout=15)
        report = app.screen.result
        assert report.source == "trainer stacks"
        names = {t.name for t in report.threads}
        assert {"target-0", "drafter-0", "MainThread"} <= names
        assert report.threads[0].name == "target-0"


async def test_a_stuck_pyspy_never_freezes_the_app(short_dir: Path, workloads, tmp_path: Path) -> None:
    stuck = tmp_path / "py-spy"
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    stuck.chmod(0o755)
    wl = workloads("stuck", short_dir / "s", short_dir / "run")
    app = DFlashTop(wl.server.path, pyspy_exe=str(stuck), pyspy_timeout=6)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.state.snapshots >= 1, "a snapshot")
        await pilot.press("s")
        assert app.job is not None
        seen = app.state.snapshots
        await pilot.press("3")  # keys are handled while py-spy hangs (the job is still running) ...
        assert app.screen.maximized is app.query_one("#p-gpus") and app.job is not None
        # ... and so are snapshots: three more arrive before the job's timeout ends it
        await until(pilot, lambda: app.state.snapshots > seen + 2 or app.job is None, "snapshots or the timeout",
                    timeout=30)
        assert app.job is not None, "the app only caught up once py-spy was killed"
        await until(pilot, lambda: isinstance(app.screen, StacksScreen), "the timeout", timeout=30)
        assert "did not finish within 6 s and was killed" in app.screen.result.reason


async def test_malformed_frame_reports_and_continues(short_dir: Path) -> None:
    frames = [protocol.encode(synthetic.hello()), b'{"type":"snapshot","seq":"oops"}\n', b"not json at all\n",
              protocol.encode(synthetic.snapshot(1))]
    with raw_trainer(short_dir / "raw.sock", frames) as path:
        app = DFlashTop(path)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.state.snapshot is not None, "the good snapshot")
            await until(pilot, lambda: "2 bad frames" in text_of(app, "#status"), "the status line to count them")
            assert app.state.bad_frames == 2
            status = text_of(app, "#status")
            assert "2 bad frames" in status and "malformed frame" in status
            assert app.state.connection == Connection.LIVE


async def test_protocol_mismatch_is_a_clear_message(short_dir: Path) -> None:
    hello = b'{"type":"hello","proto":2,"run":"new","pid":1,"host":"h","workers":{"changed":"shape"}}\n'
    with raw_trainer(short_dir / "new.sock", [hello]) as path:
        app = DFlashTop(path)
        async with app.run_test(size=(80, 24)) as pilot:
            await until(pilot, lambda: app.state.connection == Connection.INCOMPATIBLE, "incompatible")
            await until(pilot, lambda: "INCOMPATIBLE" in text_of(app, "#header")
                        and "protocol v2" in text_of(app, "#status") and app._notifications, "the message shown")
            status = text_of(app, "#status")
            assert "protocol v2" in status and f"speaks v{protocol.PROTO}" in status
            assert any("protocol v2" in n.message for n in app._notifications)


async def test_replay_keys_pause_step_and_change_speed(tmp_path: Path) -> None:
    rec = synthetic.write_recording(tmp_path / "telemetry.jsonl", 40, interval_s=0.5)
    app = DFlashTop(rec, speed=1.0, paused=True)
    async with app.run_test(size=(80, 24)) as pilot:
        src = app.source
        assert isinstance(src, ReplaySource)
        await until(pilot, lambda: "PAUSED" in text_of(app, "#header"), "the paused header")
        assert app.state.hello is not None and app.state.snapshots == 0
        await pilot.press("n")
        await until(pilot, lambda: app.state.snapshots == 1, "one step")
        await pilot.press("n", "n")
        await until(pilot, lambda: app.state.snapshots == 3, "two more steps")
        await pilot.press("plus", "plus")
        assert src.speed == 5.0
        await pilot.press("space")
        await until(pilot, lambda: app.state.snapshots >= 8, "playing at 5x")
        assert not src.paused and app.check_action("snapshot", ()) is False
        await pilot.press("minus")
        assert src.speed == 2.0


# ----------------------------------------------------------------------------- multi-rank jobs


class TwoRanks:
    """Ranks 0 and 1 of a 3-rank job on this machine (real servers, one run directory); rank 2 is on
    "node-b". Rank 0 publishes a cluster view naming rank 1 the straggler; rank 1 publishes none."""

    def __init__(self, workloads, short_dir: Path) -> None:
        self.sock_dir, self.run_dir = short_dir / "s", short_dir / "run"
        self.remote = self.sock_dir / "job-999999-r2.sock"
        self.views = 0
        self.r1 = workloads("job", self.sock_dir, self.run_dir, rank=1, world_size=3)
        self.r0 = workloads("job", self.sock_dir, self.run_dir, rank=0, world_size=3, cluster_view=self.view)

    def view(self) -> protocol.Cluster:
        self.views += 1
        here = socket.gethostname()
        own = getattr(self, "r0", None)  # the view is asked for as soon as rank 0's server starts
        return protocol.Cluster(
            world_size=3, straggler=1, straggler_reason="rank 1 waits least in the all-reduce",
            ranks=[protocol.ClusterRank(rank=0, host=here, step=self.views, tokens_per_s=9000.0, allreduce_share=0.3,
                                        socket=str(own.server.path) if own else None),
                   protocol.ClusterRank(rank=1, host=here, step=self.views, tokens_per_s=7000.0, allreduce_share=0.02,
                                        socket=str(self.r1.server.path)),
                   protocol.ClusterRank(rank=2, host="node-b", step=self.views, tokens_per_s=9100.0,
                                        allreduce_share=0.29, socket=str(self.remote))],
            categories=[protocol.ClusterCategory(key="drafter-0/drafter_forward", min=0.2, mean=0.3, max=0.5,
                                                 min_rank=0, max_rank=1)])


def styled(text, style: str) -> list[str]:
    """The pieces of a Rich Text drawn in `style`."""
    return [text.plain[sp.start:sp.end] for sp in text.spans if str(sp.style) == style]


async def test_cluster_panel_and_rank_keys_follow_each_rank(short_dir: Path, workloads) -> None:
    job = TwoRanks(workloads, short_dir)
    app = DFlashTop(job.r0.server.path)
    async with app.run_test(size=(120, 40)) as pilot:
        panel = app.query_one(ClusterPanel)
        await until(pilot, lambda: app.query_one("#p-cluster").display and "r2" in panel.content.plain, "the cluster")
        text = panel.content.plain
        assert "node-b" in text and "straggler r1" in text and "rank 1 waits least" in text
        # rank 1's row, the rank with the category's highest share and the reason line
        assert sorted(styled(panel.content, STRAGGLER)) == [" straggler r1 ", "r1", "r1"]
        assert "drafter-0/drafter_forward" in text and "▶ r0" in text
        assert app.check_action("rank", (1,)) and app.check_action("pick_rank", ())

        # ] : the detailed panels follow rank 1; the cluster view keeps coming from rank 0
        await pilot.press("right_square_bracket")
        await until(pilot, lambda: app.state.hello is not None and app.state.hello.rank == 1, "rank 1's hello")
        assert app.source.path == job.r1.server.path
        await until(pilot, lambda: "rank 1/3" in text_of(app, "#header"), "the header redrawn for rank 1")
        await until(pilot, lambda: app.state.workers, "rank 1's timings")
        assert app.cluster_source is not None and app.cluster_source.path == job.r0.server.path
        seen = job.views
        await until(pilot, lambda: (app.state.cluster_connection == Connection.LIVE
                                    and app.state.cluster.ranks[0].step > seen),
                    "fresh cluster views through the second connection")
        assert "▶ r1" in panel.content.plain and "view from" not in app.query_one("#p-cluster").border_title

        # ] again: rank 2 is on another machine: say so, keep rank 1's panels and mark rank 2's row
        await pilot.press("right_square_bracket")
        await until(pilot, lambda: "node-b" in text_of(app, "#status"), "the status line")
        assert "rank 2 runs on node-b: its socket is not on this machine" in text_of(app, "#status")
        assert app.state.hello.rank == 1 and app.source.path == job.r1.server.path
        assert "▶ r2" in panel.content.plain and "• r1" in panel.content.plain

        # ] wraps to rank 0, whose own connection carries the cluster view again
        await pilot.press("right_square_bracket")
        await until(pilot, lambda: app.state.hello is not None and app.state.hello.rank == 0, "rank 0 again")
        assert app.cluster_source is None and not app.state.rank_note
        assert "node-b" not in text_of(app, "#status")

        # g: the list of every rank; the panels follow the one picked
        await pilot.press("g")
        await until(pilot, lambda: isinstance(app.screen, ChoiceScreen), "the rank list")
        await pilot.press("down", "enter")
        await until(pilot, lambda: app.state.hello is not None and app.state.hello.rank == 1, "rank 1 picked")


async def test_a_job_on_this_machine_attaches_to_rank_0_without_a_picker(short_dir: Path, workloads) -> None:
    job = TwoRanks(workloads, short_dir)
    app = DFlashTop(None, socket_directory=job.sock_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.state.hello is not None, "attach")
        assert app.state.hello.rank == 0 and not isinstance(app.screen, PickerScreen)
        await until(pilot, lambda: app.state.cluster is not None, "the cluster view")


def test_cli_list_groups_ranks_and_once_shows_the_cluster(short_dir: Path, workloads) -> None:
    job = TwoRanks(workloads, short_dir)
    listed = run_cli("--list", "--socket-dir", str(job.sock_dir))
    assert listed.returncode == 0, listed.stderr
    assert "0/3" in listed.stdout and "1/3" in listed.stdout and "one job: ranks 0-1 of 3" in listed.stdout
    once = run_cli("--once", "--json", "--socket-dir", str(job.sock_dir))
    assert once.returncode == 0, once.stderr
    s = json.loads(once.stdout)
    assert s["rank"] == 0 and s["world_size"] == 3
    assert s["cluster"]["straggler"] == 1 and [r["rank"] for r in s["cluster"]["ranks"]] == [0, 1, 2]
    text = run_cli("--once", str(job.r0.server.path))
    assert text.returncode == 0, text.stderr
    assert "cluster (rank 0's view): 3 ranks" in text.stdout and "straggler r1" in text.stdout
    assert "node-b" in text.stdout


# ----------------------------------------------------------------------------- live source


def test_live_source_requests_and_new_pid_reattach(short_dir: Path, trainers) -> None:
    import queue

    sock_dir = short_dir / "s"
    first, path = trainers("again", sock_dir, short_dir / "run")
    q: queue.Queue = queue.Queue()
    src = LiveSource(path, retry_s=0.1)
    src.start(q.put)
    try:
        deadline = time.monotonic() + 10
        while src.hello is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert src.hello is not None and src.hello.pid == first.pid
        stacks = src.request("stacks")
        assert stacks.ok and {"target-0", "drafter-0"} <= {t["name"] for t in stacks.data["threads"]}
        allow = src.request("ptrace_allow", {"pid": os.getpid()})
        assert allow.ok, allow.error
        first.send_signal(signal.SIGTERM)
        first.wait(10)
        states = []
        while Connection.DISCONNECTED not in states:
            states.append(q.get(timeout=10).state)
        second, path2 = trainers("again", sock_dir, short_dir / "run")
        assert path2 != path
        deadline = time.monotonic() + 10
        while (src.hello is None or src.hello.pid != second.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert src.hello is not None and src.hello.pid == second.pid and src.path == path2
    finally:
        src.stop()


# ----------------------------------------------------------------------------- command line


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "dflash_tui", *args], capture_output=True, text=True, timeout=timeout)


def test_cli_list_and_once_json_against_a_trainer(short_dir: Path, trainers) -> None:
    sock_dir = short_dir / "s"
    proc, path = trainers("cli", sock_dir, short_dir / "run")
    listed = run_cli("--list", "--socket-dir", str(sock_dir))
    assert listed.returncode == 0, listed.stderr
    assert "live" in listed.stdout and "cli" in listed.stdout and str(proc.pid) in listed.stdout
    once = run_cli("--once", "--json", "--socket-dir", str(sock_dir))
    assert once.returncode == 0, once.stderr
    s = json.loads(once.stdout)
    assert s["run"] == "cli" and s["pid"] == proc.pid
    assert {"n", "mean", "p95", "share"} <= set(s["workers"]["target-0"]["target_forward"])
    assert "bottleneck" in s and isinstance(s["gpus"], list)
    # a run directory whose trainer is running attaches live rather than replaying its recording
    text = run_cli("--once", str(short_dir / "run"), "--socket-dir", str(sock_dir))
    assert text.returncode == 0 and "target_forward" in text.stdout
    assert re.search(r"bottleneck \(last \d+ s[^)]*\): ", text.stdout)  # the verdict names the time it judged
    assert "[live]" in text.stdout


def test_cli_once_on_a_recording_and_without_trainers(short_dir: Path) -> None:
    synthetic.write_recording(short_dir / "run" / "telemetry.jsonl", 5, workers=8, gpus=1)
    out = run_cli("--once", "--json", str(short_dir / "run"), "--socket-dir", str(short_dir / "none"))
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    assert len(s["workers"]) == 8 and s["gpus"][0]["index"] == 0 and s["bottleneck"]["verdict"]
    none = run_cli("--once", "--socket-dir", str(short_dir / "none"))
    assert none.returncode == 1 and "no running trainer" in none.stderr
    listed = run_cli("--list", "--socket-dir", str(short_dir / "none"))
    assert listed.returncode == 1 and "no trainer sockets" in listed.stderr


SETTLES = """
import asyncio, gc, json, sys
from dflash_tui import synthetic
from dflash_tui.app import DFlashTop
from dflash_tui.sources import MemorySource

async def main(freeze):
    app = DFlashTop(source=MemorySource(synthetic.frames(3), path="r/telemetry.jsonl", detail="replay"),
                    freeze_heap=freeze)
    before = (gc.get_freeze_count(), gc.get_threshold()[0])
    async with app.run_test(size=(120, 40)) as pilot:
        while app._slow_empty:  # until the first data is drawn (every panel: the slow ones too)
            await pilot.pause(0.05)
        done = []  # what the app queued after that refresh runs first: then this marker
        app.call_after_refresh(done.append, True)
        while not done:
            await pilot.pause(0.05)
        after = (gc.get_freeze_count(), gc.get_threshold()[0])
    print(json.dumps({"before": before, "after": after}))

asyncio.run(main(sys.argv[1] == "own"))
"""


@pytest.mark.parametrize("own", [True, False])
def test_its_own_process_takes_the_heap_out_of_the_collector_once_data_is_drawn(run_python, own: bool) -> None:
    """dflash-top's own process (the command line's app) freezes what it built and collects the youngest
    generation less often once the first data is on screen; an app in someone else's process (a test)
    leaves that process's collector alone."""
    code = f"import sys; sys.argv[1:] = [{'own' if own else 'guest'!r}]\n" + SETTLES
    seen = json.loads(run_python(code))
    # (some interpreters start with objects frozen already: pyenv's Python 3.12.1 has 375)
    frozen, threshold = seen["before"]
    assert threshold == 700  # the interpreter's default
    if own:
        assert seen["after"][0] > frozen and seen["after"][1] == YOUNG_GENERATION
    else:
        assert seen["after"] == [frozen, threshold]


# ----------------------------------------------------------------------------- helpers


class raw_trainer:
    """A bare socket that sends fixed bytes to each client: frames no real trainer would send."""

    def __init__(self, path: Path, lines: list[bytes]) -> None:
        self.path, self.lines = path, lines
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conns: list[socket.socket] = []

    def __enter__(self) -> Path:
        self.sock.bind(str(self.path))
        self.sock.listen(4)
        threading.Thread(target=self._serve, daemon=True).start()
        return self.path

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            for line in self.lines:
                conn.sendall(line)
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.mark.skipif(find_pyspy() is None, reason="py-spy is not installed")
async def test_recording_defaults_to_python_sampling_and_panels_keep_updating(short_dir: Path, trainers) -> None:
    """`r` against a trainer in another process: the dialog offers non-blocking Python sampling by
    default (native stated as pausing the trainer), and while py-spy records, snapshots keep coming
    and the header keeps moving; then the summary opens."""
    from textual.widgets import Checkbox

    from dflash_tui.widgets.record import ProfileScreen, RecordDialog

    _, path = trainers("rec", short_dir / "s", short_dir / "run")
    app = DFlashTop(path, record_seconds=3)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: app.state.snapshot is not None and app.state.hello is not None, "a snapshot")
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, RecordDialog), "the record dialog")
        native = app.screen.query_one("#native", Checkbox)
        assert native.value is False and "pauses every trainer thread" in str(native.label)
        await pilot.press("enter")
        await until(pilot, lambda: app.job is not None, "the recording to start")
        # poll until the recording job ends, noting every header drawn meanwhile
        seen, headers, screens, deadline = app.state.snapshots, set(), [], time.monotonic() + 60
        while app.job is not None:
            assert time.monotonic() < deadline, "the 3 s recording did not end within 60 s"
            headers.add(text_of(app, "#header"))
            screens.append(screen_text(app))
            await pilot.pause(0.05)
        assert app.state.snapshots >= seen + 2, "snapshots stopped while recording"
        assert len(headers) >= 2, "the header did not change while recording"
        # the countdown the README shows is on the 80x24 screen, not only in the status widget
        pid = app.state.hello.pid
        assert any(re.search(rf"py-spy record of pid {pid}: up to \d+ s left", s) for s in screens), screens[-1]
        # the screen is pushed before its body is mounted and drawn: wait for the text itself
        await until(pilot, lambda: isinstance(app.screen, ProfileScreen) and app.screen.query("#profile-body")
                    and "Python functions" in app.screen.query_one("#profile-body").render().plain,
                    "the summary", timeout=30)
