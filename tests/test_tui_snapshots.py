"""Screenshots of the main screen from fixed data (pytest-textual-snapshot); update them with
`pytest tests/test_tui_snapshots.py --snapshot-update` and review the SVGs under tests/__snapshots__/.
"""

from __future__ import annotations

import os
import time

import pytest
from textual.widgets._footer import FooterKey

from dflash_tui import synthetic
from dflash_tui.app import DFlashTop
from dflash_tui.sources import MemorySource
from dflash_tui.widgets.base import TextPanel
from dflash_tui.widgets.events import EventsLog


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


def footer_current(app) -> bool:
    """The footer shows the keys the bindings say it should (it recomposes a moment after a change,
    e.g. when the rank keys appear for a multi-rank run)."""
    want = {(b.action, not enabled) for _, b, enabled, _ in app.screen.active_bindings.values()
            if b.show and b.action != "command_palette"}  # the palette key has a place of its own
    shown = {(k.action, k.disabled) for k in app.screen.query(FooterKey)
             if k.is_mounted and k.action != "command_palette"}
    return want == shown


def panels_current(app) -> bool:
    """Every shown text panel has been drawn for its current width and laid out at its text's height
    (a panel whose text changed height waits for the next layout pass)."""
    shown = [p for p in app._main.query(TextPanel) if p.display and p.parent.display and p.content_size.width > 0]
    return all(p._width == max(10, p.content_size.width or 80) for p in shown) and all(
        p.size.height == max(1, len(p._strips)) and p.parent.content_size.height == p.outer_size.height
        for p in shown if p.styles.height.is_auto and p.parent.styles.height.is_auto)


def log_current(app) -> bool:
    """The events log has written every line at the panel's present width and scrolled to the newest
    (each waits for a refresh or a layout pass)."""
    log = app._main.query_one(EventsLog)
    width = log.scrollable_content_region.width  # 0: hidden (another panel zoomed), nothing to wait for
    return not width or (not log._deferred_renders and log.wrapped_at == width and log.scroll_y == log.max_scroll_y)


async def settle(pilot) -> None:
    """Until the data is in, every panel is drawn at its final size, the footer is up to date and two
    renders of the screen in a row are the same (styles of a screen just pushed, say, land a pass
    later): a busy machine delays each of these by an unknown time, so the test waits on them, not on
    a pause."""
    app = pilot.app
    deadline = time.monotonic() + 60
    previous = None
    while True:
        await pilot.pause()
        waiting = ["the first snapshot"]
        if app.state.snapshot is not None:
            app.refresh_panels(slow=True)
            await pilot.wait_for_scheduled_animations()
            checks = {"the refresh timer": app._refresh_timer is None, "the footer": footer_current(app),
                      "the panels": panels_current(app), "the events log": log_current(app),
                      "the cluster panel": app._cluster_box.display == (app.state.cluster is not None)}
            waiting = [what for what, ok in checks.items() if not ok]
            shown = app.export_screenshot() if not waiting else None
            if shown is not None and shown == previous:
                return
            previous = shown
            waiting = waiting or ["two equal renders"]
        assert time.monotonic() < deadline, f"the screen never settled: waiting for {', '.join(waiting)}"
        await pilot.pause(0.05)


def test_main_screen_80x24_without_gpus(snap_compare) -> None:
    assert snap_compare(fixed_app(gpus=0), terminal_size=(80, 24), run_before=settle)


def test_main_screen_160x50_with_gpus(snap_compare) -> None:
    assert snap_compare(fixed_app(gpus=2), terminal_size=(160, 50), run_before=settle)


def test_gpu_panel_zoomed_says_no_driver(snap_compare) -> None:
    async def zoom(pilot) -> None:
        await settle(pilot)
        await pilot.press("3")
        await settle(pilot)

    assert snap_compare(fixed_app(gpus=0), terminal_size=(80, 24), run_before=zoom)


def test_cluster_view_of_two_ranks_120x40(snap_compare) -> None:
    """Rank 0 of a 2-rank job: the cluster panel on top (rank 1 is the straggler), rank keys in the footer."""
    assert snap_compare(fixed_app(gpus=1, world_size=2), terminal_size=(120, 40), run_before=settle)
