"""Always-on, torch-free trainer telemetry: per-worker timing, a Unix-socket publisher and a recorder.

    stats = ProfileStats()
    w = stats.worker("target-0")          # once per thread
    with w.span("target_forward"): ...
    server = TelemetryServer("myrun", stats, run_dir=run_dir).start()

torch is only touched (never imported) by CUDA spans, when the trainer has already imported it.
"""

from dflash.telemetry.stats import ProfileStats, Worker
from dflash.telemetry.summary import Summary, format_profile_stats

__all__ = ["ProfileStats", "Summary", "TelemetryServer", "Worker", "format_profile_stats"]


def __getattr__(name: str) -> object:
    # The server pulls in psutil and the selector machinery; keep `import dflash.telemetry` light for
    # code that only times things.
    if name == "TelemetryServer":
        from dflash.telemetry.server import TelemetryServer

        return TelemetryServer
    raise AttributeError(f"module 'dflash.telemetry' has no attribute {name!r}")
