"""dflash-top: the live view of a dflash trainer (entry point `main`, app `DFlashTop`).

Data flows one way: a source thread (live socket or replay) posts `SourceUpdated` messages; the app
folds them into `RunState` and, at most `MAX_REFRESH_HZ` times a second, asks the panels to redraw
from the state inside one `batch_update()` (the dense ones about once a second, on a snapshot's own
frame: drawing is nearly all of the app's CPU time, and each frame costs Textual a pass over the
screen). Blocking work (py-spy, requests, discovery) runs on background threads and comes back as
messages, so no key press ever waits on the trainer.

A multi-rank run is shown one rank at a time: `[`/`]` and `g` point the panels at another rank by
attaching to its socket when it is on this machine. Only rank 0 publishes the cluster view, so while
another rank is shown a second, view-only connection to rank 0 keeps that panel current.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Vertical
from textual.reactive import reactive
from textual.timer import Timer
from textual.widgets import Footer

from dflash.telemetry.wire.protocol import Hello
from dflash.telemetry.wire.sockets import SocketInfo, default_socket_dir, discover, group_jobs
from dflash_tui import layout, sources
from dflash_tui.jobs import RecordSettings, take_record, take_snapshot
from dflash_tui.messages import ProfileDone, SourceUpdated, TrainersFound
from dflash_tui.pyspy import RecordReport, StackReport, find_pyspy, pid_is_local
from dflash_tui.ranks import RankFollower
from dflash_tui.sampling.processes import TorchProcess, torch_processes
from dflash_tui.sources import Connection, FrameSource, LiveLink, Playback, SampledSource, SourceUpdate
from dflash_tui.state import RunState
from dflash_tui.widgets.alerts import AlertBanner
from dflash_tui.widgets.base import Panel
from dflash_tui.widgets.categories import CategoryTable
from dflash_tui.widgets.header import RunHeader
from dflash_tui.widgets.help import HelpScreen
from dflash_tui.widgets.jump import JumpDialog, parse_time
from dflash_tui.widgets.panelhint import PanelHint
from dflash_tui.widgets.picker import ChoiceScreen, PickerScreen, WaitingScreen, rank_label
from dflash_tui.widgets.record import ProfileScreen, RecordDialog
from dflash_tui.widgets.stacks import StacksScreen
from dflash_tui.widgets.statusline import StatusLine


def _zoom_bindings() -> list[Binding]:
    """Number keys for the zoomable panels: the first shown in the footer for all of them."""
    names = ", ".join(f"{i} {p.zoom}" for i, p in enumerate(layout.ZOOMABLE, 1))
    first = Binding("1", "panel(0)", f"zoom 1-{len(layout.ZOOMABLE)}",
                    tooltip=f"zoom a panel: {names} (again or escape: back)")
    return [first, *(Binding(str(i), f"panel({i - 1})", p.zoom or p.id, show=False)
                     for i, p in enumerate(layout.ZOOMABLE[1:], 2))]


#: objects the youngest generation holds before a collection (Python's default: 700). Each frame makes a
#: few hundred short-lived Strips (a dozen containers each) that die within the frame or the next: at 700
#: a collection came four times a second and caught them alive, so the next generation walked them again
#: (collections 1.7 ms per second of dflash-top's time; at 10,000, 1.0 ms, one collection every few s).
YOUNG_GENERATION = 10_000


def settle_heap() -> None:
    """Freeze what exists now (the app, its widgets and styles: they live as long as the process) out of
    the garbage collector, and collect the youngest generation every few seconds rather than four times a
    second: the collector was about a sixth of dflash-top's time."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION, older, oldest)


class DFlashTop(App[None]):
    """The dashboard. Give it a `target` (socket or recording), a ready `source`, or neither: then it
    discovers trainers (one: attach, several: picker, none: wait; `wait_for` narrows to one run)."""

    TITLE = "dflash-top"
    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute: subclasses elsewhere find it too
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (120, "-wide")]
    ALLOW_IN_MAXIMIZED_VIEW = "Footer, RunHeader, #alerts-box, AlertBanner, StatusLine"
    MAX_REFRESH_HZ = 5.0
    #: how often the dense panels (layout.SLOW) redraw at most: at 2 Hz this halved the largest part of
    #: dflash-top's CPU time
    SLOW_INTERVAL_S = 1.0
    #: the slow panels ride along with the first snapshot's frame this close to their interval, and a
    #: trailing timer redraws them on a frame of their own only this long after it (the stream paused).
    #: Every frame costs the compositor a pass over the screen, whatever it changes: a timer that raced
    #: the 2 Hz snapshots made three frames a second out of two.
    SLOW_SLACK_S = 0.25
    BINDINGS = [
        Binding("q,ctrl+c", "quit", "quit"),
        Binding("question_mark,f1", "help", "help",
                tooltip="this screen: every key, what share/untracked/window mean, the verdicts"),
        Binding("s", "snapshot", "py-spy dump", tooltip="py-spy dump of the hot threads (joined with their CPU%)"),
        Binding("r", "record", "record", tooltip="py-spy record: sample the trainer for some seconds"),
        Binding("t", "trainer_stacks", "stacks", show=False,
                tooltip="the trainer's own Python stacks (no py-spy needed; works across hosts)"),
        Binding("space", "pause", "pause", tooltip="pause / resume the replay"),
        Binding("n", "step", "step", tooltip="one snapshot forward (pauses)"),
        Binding("plus,equals_sign", "faster", "faster", tooltip="replay faster"),
        Binding("minus", "slower", "slower", tooltip="replay slower"),
        Binding("less_than_sign,comma", "seek(-10)", "-10s", key_display="<", tooltip="back 10 s of the run's time"),
        Binding("greater_than_sign,full_stop", "seek(10)", "+10s", key_display=">",
                tooltip="forward 10 s of the run's time"),
        Binding("j", "jump", "jump", show=False, tooltip="jump to a time of the run (m:ss, or a percentage)"),
        Binding("w", "next_worker", "worker", tooltip="the table shows one worker, the next, ... all"),
        Binding("o", "sort", "sort", show=False, tooltip="sort the table: pipeline order, share, p95, name"),
        # multi-rank runs only: the panels follow the chosen rank (when its socket is on this machine)
        Binding("right_square_bracket", "rank(1)", "rank", key_display="[ ]"),
        Binding("left_square_bracket", "rank(-1)", "previous rank", show=False),
        Binding("g", "pick_rank", "ranks"),
        *_zoom_bindings(),
    ]

    #: the panels dim while the trainer is away, and keep the last data
    disconnected: reactive[bool] = reactive(False)

    def __init__(self, target: Path | None = None, *, socket_directory: Path | None = None, speed: float = 1.0,
                 paused: bool = False, pyspy_exe: str | None = None, pyspy_timeout: float = 10.0,
                 record_seconds: float = 10.0, request_timeout: float = 5.0,
                 source: FrameSource | None = None, wait_for: Path | str | None = None,
                 processes: Callable[[], list[TorchProcess]] = torch_processes, freeze_heap: bool = False) -> None:
        super().__init__()
        #: dflash-top's own process (not a test's): once the first data is on screen, the heap built so
        #: far (Textual, the widgets, their styles) is frozen out of the garbage collector, whose older
        #: generations would otherwise walk it again and again for nothing (collections were about a
        #: sixth of dflash-top's time; frozen, 40% less), and the youngest generation is collected less
        #: often (see settle_heap)
        self.freeze_heap = freeze_heap
        #: what the picker offers to sample when no trainer answers (the machine's torch processes; a
        #: test that waits for a trainer passes none, whatever else runs on its machine)
        self.processes = processes
        self.target = target
        #: with no target: attach only to this run (a run directory or a run name), once it appears
        self.wait_for = wait_for
        self.socket_directory = socket_directory or default_socket_dir()
        self.speed = speed
        self.start_paused = paused
        self.pyspy_exe = pyspy_exe if pyspy_exe is not None else find_pyspy()
        self.pyspy_timeout = pyspy_timeout
        # Python-only, non-blocking sampling by default: --native pauses the trainer at every sample
        self.record_defaults = RecordSettings(seconds=record_seconds, gil=False, native=False)
        self.request_timeout = request_timeout
        self.source: FrameSource | None = source
        #: while the panels follow a rank other than 0: a second connection, to rank 0, which alone
        #: publishes the cluster view
        self.cluster_source: sources.LiveSource | None = None
        self.state = RunState()
        self.ranks = RankFollower(self.state)
        self._multi_rank = False
        self.job: str | None = None
        self._job_end: float | None = None
        self._job_timer: Timer | None = None
        self._refresh_timer: Timer | None = None
        self._slow_timer: Timer | None = None
        self._last_refresh = 0.0
        self._last_slow = 0.0
        self._slow_empty = True
        #: panel id -> the state version it was last drawn from (a panel out of view is not drawn)
        self._drawn: dict[str, int] = {}
        self._waiting: WaitingScreen | None = None
        self._offered_processes = False

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield RunHeader(id="header")
        with Vertical(id="alerts-box"):  # a container of auto height: the banner's own height varies
            yield AlertBanner(id="alerts")
        yield from (Panel(p.title, p.widget(id=p.id), id=p.box) for p in layout.in_column("top"))
        with Container(id="body"):
            for column in ("left", "right"):
                with Vertical(id=column):
                    yield from (Panel(p.title, p.widget(id=p.id), id=p.box) for p in layout.in_column(column))
        yield PanelHint(id="hint")  # names the panels a small terminal leaves out of view
        yield StatusLine(id="status")
        yield Footer()

    @property
    def panels(self) -> list:
        ids = ("header", "alerts", *(p.id for p in layout.DASHBOARD), "status")
        return [self.query_one(f"#{i}") for i in ids]

    def on_mount(self) -> None:
        self._panels = self.panels
        self._status = self.query_one(StatusLine)
        self._main = self.screen  # the dashboard, whatever modal is on top of it later
        self._cluster_box = self.query_one("#p-cluster")
        self._cluster_box.display = False
        self._hint, self._body = self.query_one(PanelHint), self.query_one("#body")
        # scrolled, or zoomed in or out (a number key, or Textual's own escape): the panels shown again
        # catch up at once, once laid out
        self.watch(self._body, "scroll_y", lambda _: self.call_after_refresh(self._catch_up), init=False)
        self.watch(self._main, "maximized", lambda _: self.call_after_refresh(self._catch_up), init=False)
        if self.source is not None:
            self._start(self.source)
        elif self.target is not None:
            self.attach(self.target)
        else:
            self.discover_trainers()
        self.refresh_panels()

    def on_unmount(self) -> None:
        if self.source is not None:
            self.source.stop()
        self._stop_cluster_feed()

    # ------------------------------------------------------------------ sources

    def attach(self, path: Path) -> None:
        if self.source is not None:
            self.source.stop()
        self.target = path
        self.source = sources.open_source(path, speed=self.speed, paused=self.start_paused)
        self._start(self.source)

    def _start(self, source: FrameSource) -> None:
        source.start(partial(self._sink, source))

    def _sink(self, source: FrameSource, update: SourceUpdate) -> None:
        self.post_message(SourceUpdated(update, source))

    def on_source_updated(self, message: SourceUpdated) -> None:
        update = message.update
        if message.source is not self.source:
            if message.source is not None and message.source is self.cluster_source:
                self.state.apply_cluster_update(update)
                self._bindings_follow_ranks()
                self.schedule_refresh()
            return  # the last words of a source we have switched away from
        self.state.apply_update(update)
        if any(isinstance(f, Hello) for f in update.frames):
            self._sync_cluster_feed()
        self._bindings_follow_ranks()
        if update.state is not None:
            self.disconnected = update.state.away
            if update.state == Connection.INCOMPATIBLE:
                self.notify(update.detail, title="protocol mismatch", severity="error", timeout=30)
            elif update.state == Connection.UNTRUSTED:
                self.notify(update.detail, title="socket not trusted", severity="error", timeout=30)
            self.refresh_bindings()
        self.schedule_refresh()

    def schedule_refresh(self) -> None:
        """Redraw now, or once the refresh budget allows; many updates in between cost one redraw."""
        if self._refresh_timer is not None:
            return
        delay = self._last_refresh + 1.0 / self.MAX_REFRESH_HZ - time.monotonic()
        if delay <= 0:
            self.refresh_panels()
        else:
            self._refresh_timer = self.set_timer(delay, self._timed_refresh)

    def _timed_refresh(self) -> None:
        self._refresh_timer = None
        self.refresh_panels()

    def refresh_panels(self, slow: bool | None = None, fast: bool = True) -> None:
        """Redraw every panel from the state; the slow ones only when their interval has passed (a
        trailing timer makes sure they still show the last data when the stream stops), the others
        unless `fast` is False (that timer: they are drawn from the latest data already)."""
        if not self.screen_stack:  # shutting down: a timer fired after the last screen went
            return
        maximized = self._main.maximized
        now = time.monotonic()
        if fast:
            self._last_refresh = now
        if slow is None:
            # the first data is drawn at once everywhere; after that the slow panels keep their pace
            slow = (now - self._last_slow >= self.SLOW_INTERVAL_S - self.SLOW_SLACK_S
                    or (self._slow_empty and self.state.snapshot is not None))
        if slow:
            self._last_slow = now
            if self._slow_empty and self.state.snapshot is not None and self.freeze_heap:
                self.call_after_refresh(settle_heap)
            self._slow_empty = self.state.snapshot is None
            if self._slow_timer is not None:
                self._slow_timer.stop()
                self._slow_timer = None
        elif self._slow_timer is None:
            self._slow_timer = self.set_timer(self._last_slow + self.SLOW_INTERVAL_S + self.SLOW_SLACK_S - now,
                                              self._timed_slow)
        if self.playback is not None:
            self._status.replay_text = self.playback.where()
        with self.batch_update():
            show_cluster = self.state.cluster is not None
            if self._cluster_box.display != show_cluster:
                self._cluster_box.display = show_cluster
            for panel in self._panels:
                if panel.id in layout.BOXED and not self._in_view(panel, maximized):
                    continue  # drawn when it is shown again (_catch_up)
                paced = panel.id in layout.SLOW and panel.parent is not maximized
                if slow if paced else fast:
                    self._draw(panel)
        self.call_after_refresh(self._update_hint)  # panels may have grown or shrunk

    def _in_view(self, panel, maximized) -> bool:
        """Whether a boxed panel shows: not behind a zoomed one, and not scrolled out of the body's view
        (a small terminal; a box not laid out yet counts as shown). Only those are drawn."""
        if maximized is not None:
            return panel.parent is maximized
        if panel.id not in layout.SCROLLED:
            return True
        box = panel.parent.region
        return not box.height or bool(box.intersection(self._body.region).height)

    def _catch_up(self) -> None:
        """The panels shown again (scrolled into view, or no longer behind a zoomed one) catch up with the
        data that came while they were hidden."""
        maximized = self._main.maximized
        with self.batch_update():
            for panel in self._panels:
                if (panel.id in layout.BOXED and self._drawn.get(panel.id) != self.state.version
                        and self._in_view(panel, maximized)):
                    self._draw(panel)
        self._update_hint()

    def _draw(self, panel) -> None:
        panel.refresh_from(self.state)
        self._drawn[panel.id] = self.state.version

    def on_resize(self) -> None:
        self.call_after_refresh(self._update_hint)

    def _update_hint(self) -> None:
        """Name in the hint line each zoomable panel whose title or first row is out of view (rows
        without their title do not say what they are)."""
        if not self.screen_stack or not hasattr(self, "_hint"):
            return
        # judged as if the hint showed (it takes its row from the body): showing it then changes nothing,
        # so one pass settles it
        view = self._body.region
        if not self._hint.display:
            view = view._replace(height=max(0, view.height - 1))

        def in_view(panel) -> bool:
            return view.y <= panel.region.y and panel.region.intersection(view).height >= 2

        hidden = tuple((str(i), p.zoom) for i, p in enumerate(layout.ZOOMABLE, 1)
                       if (panel := self.query_one(f"#{p.box}")).display and not in_view(panel))
        if hidden != self._hint.hidden:
            self._hint.hidden = hidden

    def _timed_slow(self) -> None:
        self._slow_timer = None
        self.refresh_panels(slow=True, fast=False)

    def watch_disconnected(self, value: bool) -> None:
        if hasattr(self, "_main"):
            self._main.set_class(value, "-disconnected")

    # ------------------------------------------------------------------ discovery

    @work(thread=True, exclusive=True, group="discover")
    def discover_trainers(self) -> None:
        found = [i for i in discover(self.socket_directory) if i.alive]
        if self.wait_for is not None:
            found = [i for i in found if sources.serves(i, self.wait_for)]
        offer = not found and self.wait_for is None and not self._offered_processes
        self.post_message(TrainersFound(found, self.processes() if offer else None))

    def on_trainers_found(self, message: TrainersFound) -> None:
        if self.source is not None:
            return
        found: list[SocketInfo] = message.sockets
        if not found and message.processes and not self._offered_processes:
            self._offered_processes = True  # offered once; escape keeps waiting for a trainer
            self.push_screen(ChoiceScreen("no dflash trainer answers: sample a Python process using torch (escape: "
                                          "wait for a trainer)", [(p.label, p.pid) for p in message.processes]),
                             self.watch_process)
            return
        if not found:
            if self._waiting is None:
                self._waiting = WaitingScreen(self.socket_directory, self.wait_for)
                self.push_screen(self._waiting)
            self.set_timer(1.0, self.discover_trainers)
            return
        if self._waiting is not None:
            self._waiting.dismiss(found)
            self._waiting = None
        jobs = group_jobs(found)  # one ssh session to rank 0's node shows the whole job
        if len(jobs) == 1:
            self.attach(jobs[0][0].path)
        else:
            self.push_screen(PickerScreen(jobs), self._picked)

    def watch_process(self, pid: int | None) -> None:
        """Sample `pid` from outside (the picker's choice); None: go on waiting for a trainer."""
        if pid is None:
            self.discover_trainers()
            return
        if self._waiting is not None:
            self._waiting.dismiss([])
            self._waiting = None
        self.source = SampledSource(pid)
        self._start(self.source)

    def _picked(self, path: Path | None) -> None:
        if path is None:
            self.exit()
        else:
            self.attach(path)

    # ------------------------------------------------------------------ replay controls

    @property
    def playback(self) -> Playback | None:
        """The replay controls of the current source (None: it cannot be paused or moved in)."""
        return self.source.playback if self.source is not None else None

    @property
    def live(self) -> LiveLink | None:
        """The current source's link to a live trainer (None: a recording or fixed frames)."""
        return self.source.live if self.source is not None else None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("pause", "step", "faster", "slower", "seek", "jump"):
            return self.playback is not None
        if action in ("snapshot", "record"):  # py-spy: a live trainer, or a process sampled from outside
            return self.live is not None or (self.source is not None and self.source.watched is not None)
        if action == "trainer_stacks":
            return self.live is not None
        if action == "next_worker":
            return self.source is not None
        if action in ("rank", "pick_rank"):
            return self.state.multi_rank
        return True

    def action_pause(self) -> None:
        if self.playback is not None:
            self.playback.toggle_pause()

    def action_step(self) -> None:
        if self.playback is not None:
            self.playback.step()

    def _change_speed(self, direction: int) -> None:
        if self.playback is not None:
            self.speed = sources.next_speed(self.playback.speed, direction)
            self.playback.set_speed(self.speed)

    def action_seek(self, seconds: float) -> None:
        if self.playback is not None:
            self.playback.seek(delta=seconds)

    def action_jump(self) -> None:
        src = self.playback
        if src is None:
            return

        def go(value: str | None) -> None:
            if value is None:
                return
            length = (src.end_t - src.start_t) if src.end_t is not None and src.start_t is not None else None
            to = parse_time(value, length)
            if to is None:
                self.notify(f"not a time: {value!r} (m:ss, h:mm:ss, seconds, or a percentage)", severity="warning")
            else:
                src.seek(to=to)

        self.push_screen(JumpDialog(src.where()), go)

    def action_faster(self) -> None:
        self._change_speed(+1)

    def action_slower(self) -> None:
        self._change_speed(-1)

    # ------------------------------------------------------------------ panels

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.BINDINGS))

    def action_sort(self) -> None:
        order = self.query_one(CategoryTable).cycle_sort(self.state)
        self.notify(f"table sorted by {order}", timeout=2)

    def action_next_worker(self) -> None:
        table = self.query_one(CategoryTable)
        chosen = table.cycle_worker(self.state)
        self.notify(f"table shows {chosen or 'all workers'}", timeout=2)

    def action_panel(self, index: int) -> None:
        panel = self.query_one(f"#{layout.ZOOMABLE[index].box}")
        if self._main.maximized is panel:
            self._main.minimize()
        else:
            self._main.maximize(panel, container=False)

    # ------------------------------------------------------------------ ranks

    def _bindings_follow_ranks(self) -> None:
        """The rank keys appear in the footer once the run turns out to have several ranks."""
        if self.state.multi_rank != self._multi_rank:
            self._multi_rank = self.state.multi_rank
            self.refresh_bindings()

    def action_rank(self, delta: int) -> None:
        rank = self.ranks.next(self.live, delta)
        if rank is not None:
            self.select_rank(rank)

    def action_pick_rank(self) -> None:
        choices = [(rank_label(c), c.rank) for c in self.ranks.choices(self.live)]
        ranks = [r for _, r in choices]
        current = self.ranks.current
        highlighted = ranks.index(current) if current in ranks else None
        self.push_screen(ChoiceScreen(f"{len(ranks)} ranks: the panels follow the one you pick", choices,
                                      highlighted), self.select_rank)

    def select_rank(self, rank: int | None) -> None:
        """Point the panels at `rank`: follow its socket when it is on this machine; otherwise keep the
        current rank's panels and say in the status line why (its cluster row stays marked)."""
        if rank is None:
            return
        path = self.ranks.select(rank, self.live)
        if path is not None and (self.source is None or path != self.source.path):
            self.state.forget_source()
            self.state.note("info", f"following rank {rank} ({path})")
            self.attach(path)  # its hello then decides whether rank 0 needs a second connection
        self.refresh_panels()

    def _sync_cluster_feed(self) -> None:
        """Keep a connection to rank 0 exactly while the panels follow another rank of a multi-rank run."""
        live = self.live
        leader = self.ranks.cluster_feed(live)
        feed = self.cluster_source
        if feed is not None and (leader is None or live is None or feed.info.run != live.info.run):
            self._stop_cluster_feed()
        if leader is not None and self.cluster_source is None:
            self.cluster_source = sources.LiveSource(leader)
            self._start(self.cluster_source)

    def _stop_cluster_feed(self) -> None:
        feed, self.cluster_source = self.cluster_source, None
        if feed is not None:
            feed.stop()
            self.state.cluster_connection = None

    # ------------------------------------------------------------------ py-spy

    def _live_trainer(self, what: str) -> tuple[LiveLink | None, int, str, str | None] | None:
        """(the trainer's link, None for a process sampled from outside; its pid; host; run directory)."""
        src, hello = self.live, self.state.hello
        watched = self.source.watched if self.source is not None else None
        connected = watched.connected if watched is not None else src is not None and src.connected
        if hello is None or not connected:
            self.notify(f"{what} needs a live trainer (this is {self.state.connection})", severity="warning")
            return None
        if self.job is not None:
            self.notify(f"{self.job} is still running", severity="warning")
            return None
        if watched is not None:
            return None, watched.pid, hello.host, None
        return src, hello.pid, hello.host, hello.run_dir

    def action_snapshot(self, force_trainer: bool = False) -> None:
        live = self._live_trainer("a stack snapshot")
        if live is None:
            return
        src, pid, host, run_dir = live
        local = pid_is_local(pid, host)
        what = "trainer stacks" if force_trainer or not local else "py-spy dump"
        self._start_job(f"{what} of pid {pid}", self.pyspy_timeout * 2 + self.request_timeout)
        job = partial(take_snapshot, pid, local=local, ask=partial(self._ask, src) if src else None,
                      cpu=self.state.thread_cpu(), names=self.state.thread_names(), exe=self.pyspy_exe,
                      timeout=self.pyspy_timeout,
                      force_trainer=force_trainer, run_dir=run_dir)
        self.run_worker(partial(self._post_result, job), thread=True, group="profile", name="snapshot")

    def action_trainer_stacks(self) -> None:
        self.action_snapshot(force_trainer=True)

    def _ask(self, src: LiveLink, op: str, args: dict) -> object:
        return src.request(op, args, timeout=self.request_timeout)

    def _post_result(self, job: Callable[[], object]) -> None:
        """Run a profiling job (on a worker thread) and hand its result, never an exception, to the UI."""
        self.post_message(ProfileDone(job()))

    def action_record(self) -> None:
        live = self._live_trainer("py-spy record")
        if live is None:
            return
        src, pid, host, run_dir = live
        if not pid_is_local(pid, host):
            self.notify(f"py-spy record needs the trainer on this host (pid {pid} on {host} is not here); "
                        "use s for its own stacks", severity="warning")
            return

        def start(settings: RecordSettings | None) -> None:
            if settings is None:
                return
            self.record_defaults = settings
            self._start_job(f"py-spy record of pid {pid}", settings.seconds)
            job = partial(take_record, src, pid, settings, exe=self.pyspy_exe, run_dir=run_dir,
                          request_timeout=self.request_timeout)
            self.run_worker(partial(self._post_result, job), thread=True, group="profile", name="record")

        self.push_screen(RecordDialog(self.record_defaults), start)

    def _start_job(self, what: str, expected_s: float) -> None:
        self.job = what
        self._job_end = time.monotonic() + expected_s
        status = self.query_one(StatusLine)
        status.job_text = f"{what}..."
        self._job_timer = self.set_interval(1.0, self._tick_job)
        self.refresh_panels()

    def _tick_job(self) -> None:
        if self.job is None or self._job_end is None:
            return
        left = max(0, round(self._job_end - time.monotonic()))
        self.query_one(StatusLine).job_text = f"{self.job}: up to {left} s left"
        self.schedule_refresh()

    def on_profile_done(self, message: ProfileDone) -> None:
        self.job = None
        self._job_end = None
        if self._job_timer is not None:
            self._job_timer.stop()
            self._job_timer = None
        self.query_one(StatusLine).job_text = None
        r = message.result
        if isinstance(r, RecordReport):
            self.state.note("info", f"py-spy record saved to {r.path}")
            self.push_screen(ProfileScreen(r))
        else:
            if isinstance(r, StackReport):
                where = r.saved[-1] if r.saved else "(not saved)"
                self.state.note("info", f"{r.source} snapshot: {len(r.threads)} threads, saved to {where}")
            else:
                self.state.note("warning", f"{r.what} failed: {r.reason}")
            if isinstance(self.screen, StacksScreen):
                self.screen.show(r)
            else:
                self.push_screen(StacksScreen(r))
        self.schedule_refresh()
