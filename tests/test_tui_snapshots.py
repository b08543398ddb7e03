"""Screenshots of the main screen from fixed data (pytest-textual-snapshot); update them with
`pytest tests/test_tui_snapshots.py --snapshot-update` and review the SVGs under tests/__snapshots__/.
"""

from __future__ import annotations

import os
import time

import pytest

from dflash_tui import synthetic
from dflash_tui.app import DFlashTop
from dflash_tui.sources import MemorySource


@pytest.fixture(autouse=True)
def utc() -> None:
    """Event times are shown in local time; fix the zone so the screenshots match everywhere."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    yield
    if old is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = old
    time.tzset()


def fixed_app(gpus: int, world_size: int = 1) -> DFlashTop:
    frames = synthetic.frames(80, workers=8, gpus=gpus, world_size=world_size)
    return DFlashTop(source=MemorySource(frames, path="runs/demo/telemetry.jsonl", detail="replay of runs/demo"),
                     pyspy_exe="py-spy")


async def settle(pilot) -> None:
    app = pilot.app
    while app.state.snapshot is None:
        await pilot.pause(0.05)
    await pilot.pause(0.3)  # one throttled refresh
    app.refresh_panels(slow=True)
    await pilot.pause()


def test_main_screen_80x24_without_gpus(snap_compare) -> None:
    assert snap_compare(fixed_app(gpus=0), terminal_size=(80, 24), run_before=settle)


def test_main_screen_160x50_with_gpus(snap_compare) -> None:
    assert snap_compare(fixed_app(gpus=2), terminal_size=(160, 50), run_before=settle)


def test_gpu_panel_zoomed_says_no_driver(snap_compare) -> None:
    async def zoom(pilot) -> None:
        await settle(pilot)
        await pilot.press("3")
        await pilot.pause()

    assert snap_compare(fixed_app(gpus=0), terminal_size=(80, 24), run_before=zoom)


def test_cluster_view_of_two_ranks_120x40(snap_compare) -> None:
    """Rank 0 of a 2-rank job: the cluster panel on top (rank 1 is the straggler), rank keys in the footer."""
    assert snap_compare(fixed_app(gpus=1, world_size=2), terminal_size=(120, 40), run_before=settle)
