"""Always-on, torch-free trainer telemetry: per-worker timing, a Unix-socket publisher and a recorder.

    stats = ProfileStats()
    w = stats.worker("target-0")          # once per thread
    with w.span("target_forward"): ...
    server = TelemetryServer("myrun", stats, run_dir=run_dir).start()

torch is only touched (never imported) by CUDA spans, when the trainer has already imported it.
"""

from __future__ import annotations

import importlib

__all__ = ["ProfileStats", "Summary", "TelemetryServer", "Worker", "format_profile_stats"]

# Resolved on first use, so that importing the wire (dflash/telemetry/wire/: all dflash-top takes from
# this package) loads nothing else of it, and code that only times things never loads the server
# (psutil, selectors).
_WHERE = {"ProfileStats": "stats", "Worker": "stats", "Summary": "summary", "format_profile_stats": "summary",
          "TelemetryServer": "publish.server"}


def __getattr__(name: str) -> object:
    if name in _WHERE:
        return getattr(importlib.import_module(f"dflash.telemetry.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'dflash.telemetry' has no attribute {name!r}")
