"""What watches a run from outside its workers: the telemetry socket (with the recorder and the health
monitors it runs on each window: anomalies, the GIL probe, the stall watchdog), the Prometheus exporter
and, in a multi-rank run, the cluster exchange. Started after the workers, so that the hello frame's
thread map names every worker; none of it can slow a worker down (each reads what the workers count).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dflash.train.config import TrainConfig
from dflash.train.distributed import Dist
from dflash.train.reporting import Reporter
from dflash.train.run.build import TrainError

if TYPE_CHECKING:  # the telemetry side is imported when a run starts it (none of it with --no-telemetry)
    import torch

    from dflash.telemetry import ProfileStats, Summary, TelemetryServer
    from dflash.telemetry.export.cluster import ClusterExchange
    from dflash.telemetry.export.prometheus import MetricsExporter
    from dflash.telemetry.verdict.watchdog import Watchdog
    from dflash.telemetry.wire.protocol import Bottleneck, Stall


class Monitoring:
    def __init__(self, cfg: TrainConfig, dist: Dist, stats: ProfileStats, report: Reporter,
                 device: torch.device | None = None):
        """`device`: the trainer's CUDA device (None on the host), which the publisher thread binds before
        it resolves any CUDA event."""
        self.cfg, self.dist, self.stats, self.report, self.device = cfg, dist, stats, report, device
        self.server: TelemetryServer | None = None
        self.exporter: MetricsExporter | None = None
        self.exchange: ClusterExchange | None = None
        self.watchdog: Watchdog | None = None
        # the watchdog's stall when --on-stall exit is to end the run: set on the publisher thread,
        # acted on by the main thread
        self.stall: Stall | None = None

    def start(self) -> None:
        from dflash.telemetry import TelemetryServer

        cfg, d = self.cfg, self.dist
        if cfg.telemetry.metrics_port is not None:
            self._serve_metrics()
        if d.enabled:
            from dflash.telemetry.export.cluster import ClusterExchange

            self.exchange = ClusterExchange(d.store, d.rank, d.world_size, self.latest,
                                            interval_s=cfg.telemetry.telemetry_interval)
        server = TelemetryServer(run=cfg.name, stats=self.stats, interval_s=cfg.telemetry.telemetry_interval,
                                 run_dir=Path(cfg.run.run_dir).resolve(), socket_dir=cfg.telemetry.socket_dir,
                                 rank=d.rank, world_size=d.world_size,
                                 on_publish=self.exporter.update if self.exporter else None,
                                 cluster_view=self.exchange.view if self.exchange and d.is_main else None,
                                 monitors=self._monitors(), thread_init=self._bind_publisher)
        try:
            server.start()
        except (OSError, RuntimeError) as e:
            raise TrainError(f"telemetry socket in {server.socket_dir}: {e} (use --socket-dir, or "
                             "--no-telemetry)") from None
        self.server = self.report.server = server
        self.report.say(f"telemetry: {server.path}")
        self.report.log(f"attach:    {top_command()} {shlex.quote(str(server.path))}")
        if self.exchange is not None:
            self.exchange.socket_path = str(server.path)
            self.exchange.start()

    def _bind_publisher(self) -> None:
        from dflash.train.device.binding import bind_thread

        bind_thread(self.device)

    def _serve_metrics(self) -> None:
        from dflash.telemetry.export.prometheus import MetricsExporter, MetricsServerError

        cfg, d = self.cfg, self.dist
        self.exporter = MetricsExporter(cfg.name, rank=d.rank)
        given = cfg.telemetry.metrics_port
        want = given + d.local_rank if given else 0  # one port per rank on a node; 0: any free one
        try:
            port = self.exporter.serve(want, addr=cfg.telemetry.metrics_addr)
        except MetricsServerError as e:
            raise TrainError(str(e)) from None
        self.report.say(f"metrics:   http://{cfg.telemetry.metrics_addr}:{port}/metrics")

    def _monitors(self) -> list:
        """The judges the telemetry server runs on each window (the watchdog unless --stall-timeout 0)."""
        from dflash.telemetry.verdict.anomalies import AnomalyDetector
        from dflash.telemetry.verdict.churn import ChurnMonitor
        from dflash.telemetry.verdict.gil import GilProbe
        from dflash.telemetry.verdict.watchdog import Watchdog

        cfg = self.cfg
        # the churn monitor adds its anomalies to those the detector sets on the window: it runs after it
        monitors: list = [AnomalyDetector(emit=self.report.event), ChurnMonitor(emit=self.report.event)]
        if cfg.telemetry.gil_probe:
            monitors.append(GilProbe())
        if cfg.health.stall_timeout == 0:
            return monitors

        def on_stall(st: Stall) -> None:  # publisher thread: only hand the stall to the main thread
            self.stall = st

        d = self.dist
        self.watchdog = Watchdog(Path(cfg.run.run_dir).resolve(), cfg.health.stall_timeout or None,
                                 emit=self.report.event, on_stall=on_stall if cfg.health.on_stall == "exit" else None,
                                 rank=d.rank if d.enabled else None)
        return [*monitors, self.watchdog]

    def latest(self) -> Summary | None:
        """The newest telemetry snapshot (None before the first, or with telemetry off)."""
        return self.server.latest() if self.server is not None else None

    def verdict(self, whole_run: Summary | None = None) -> Bottleneck | None:
        """The bottleneck verdict dflash-top shows (the last 10 s, held), or None; given the run's last
        summary, the whole run's, as the last snapshot will carry it (the machine's view included)."""
        if self.server is None:
            return None
        return self.server.verdict.final(whole_run) if whole_run is not None else self.server.verdict.current

    def publish_now(self) -> None:
        """A run shorter than one interval still ends with its table."""
        if self.server is not None:
            self.server.publish_now()

    def quiet_ranks(self) -> str:
        """Which ranks the cluster view saw go quiet, for a failure message (torchrun can only name the
        first process to exit, which is the one that noticed, not the one that hung)."""
        view = self.exchange.view() if self.exchange is not None else None
        if view is None or not view.stale:
            return ""
        ages = ", ".join(f"rank {r.rank} {r.age_s:.0f}s ago" for r in view.ranks if r.stale)
        return f" [cluster view: stopped reporting: {ages}]"

    def close(self, failed: bool, linger: bool) -> None:
        """Say goodbye on every channel; with `linger`, keep /metrics up for the last scrape."""
        if self.exchange is not None:
            self.exchange.close("failed" if failed else "finished")
        if self.server is not None:
            self.server.close(reason="error" if failed else "finished")  # its last publish reaches the exporter
        if self.exporter is not None:
            if linger:
                self._linger_for_scrape()
            self.exporter.close()

    def _linger_for_scrape(self) -> None:
        """Keep /metrics up until Prometheus has read the run's last snapshot (with the final
        evaluation's tau), at most --metrics-linger seconds: closing at once lost it every time."""
        wait = self.cfg.telemetry.metrics_linger
        if wait > 0 and self.exporter.port is not None:
            self.report.say(f"metrics:   serving the final numbers until the next scrape (at most {wait:g} s; "
                            "--metrics-linger 0 skips this)")
            if not self.exporter.wait_for_scrape(wait):
                self.report.say("metrics:   no scrape came; the final numbers are in telemetry.jsonl and "
                                "evals.jsonl")


def top_command() -> str:
    """How to start dflash-top so that the printed line works as printed: by name when the shell
    finds this environment's own dflash-top, else by its absolute path (a venv that is not active),
    else through this interpreter."""
    import shutil

    exe = Path(sys.executable).with_name("dflash-top")
    if not exe.is_file():
        return f"{shlex.quote(sys.executable)} -m dflash_tui"
    found = shutil.which("dflash-top")
    return "dflash-top" if found and Path(found).resolve() == exe.resolve() else shlex.quote(str(exe))
