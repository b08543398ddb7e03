"""dflash-top's help screen, escape, sorting and names: pilot tests of the real app on fixed frames,
and screenshots (update with `pytest tests/test_tui_help.py --snapshot-update`, review the SVGs)."""

from __future__ import annotations

import pytest
from conftest import screen_text
from test_tui_snapshots import fixed_app, settle, utc  # noqa: F401 (utc: autouse fixture)

from dflash.telemetry.verdict.published import SteadyVerdict
from dflash.telemetry.wire import verdicts
from dflash_tui.app import DFlashTop
from dflash_tui.state import RunState
from dflash_tui.widgets import help as help_screen
from dflash_tui.widgets.categories import CategoryTable
from dflash_tui.widgets.gpus import gpu_text
from dflash_tui.widgets.help import HelpScreen, help_rows
from dflash_tui.widgets.timebars import TimeBars


def test_the_help_states_the_analysis_thresholds():
    assert help_screen.HOLD_WINDOWS == SteadyVerdict().hold
    assert f">= {verdicts.THRESHOLD:.0%}" in dict(help_screen.verdicts())["target-bound"]


def test_the_help_lists_every_key_and_term():
    sections = dict(help_rows(DFlashTop.BINDINGS))
    keys = dict(sections["keys"])
    for b in DFlashTop.BINDINGS:
        assert any(text.startswith(b.tooltip or b.description) for text in keys.values()), b
    assert "?, f1" in keys and "escape" in keys and keys["space"].endswith("(replay only)")
    assert {"window", "share", "untracked"} <= set(dict(sections["what the numbers mean"]))
    verdicts = dict(sections["bottleneck verdicts"])
    assert {"data-bound", "target-bound", "drafter-bound", "balanced", "unknown", "hysteresis"} <= set(verdicts)
    assert ">= 20%" in verdicts["target-bound"] and "less than 5%" in verdicts["unknown"]
    assert ">= 50% of its time" in verdicts["launch-bound"] and "at most 50% of that" in verdicts["launch-bound"]


async def test_question_mark_opens_help_and_escape_closes_every_overlay():
    app = fixed_app(gpus=0)
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("3")  # zoom the GPU panel
        assert app.screen.maximized is not None
        await pilot.press("escape")
        assert app.screen.maximized is None


async def test_worker_names_are_never_cut_and_the_table_sorts():
    app = fixed_app(gpus=0)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        names = list(app.state.known)
        assert "batch-producer" in names
        table = app.query_one(CategoryTable)
        rows = [table.row_text(i) for i in range(table.row_count)]
        assert any(r.startswith("batch-producer ") for r in rows)
        bars = app.query_one(TimeBars).content.plain
        assert all(f"{n} " in bars for n in names if n in app.state.workers)
        await pilot.press("o")
        assert table.sort == "share"
        shares = [st.share for _, _, st in sorted(
            ((w, c, app.state.workers[w][c]) for w in app.state.workers for c in app.state.workers[w]),
            key=lambda x: -x[2].share)]
        first = table.row_text(0)
        worker = first.split()[0]
        top = max(app.state.workers[worker].values(), key=lambda st: st.share)
        assert top.share == shares[0]  # the hottest row of all comes first, with its worker named
        for expected in ("p95", "name", "pipeline"):
            await pilot.press("o")
            assert table.sort == expected
        cats = [table.row_text(i) for i in range(table.row_count)]
        assert cats == rows  # back to the stable pipeline order


def test_the_no_driver_text_fits_80_columns():
    import msgspec

    from dflash_tui import synthetic

    state = RunState()
    for f in synthetic.frames(3, workers=4, gpus=0):
        state.apply(f)
    t = gpu_text(state, 76)
    assert not t.no_wrap  # the panel wraps it at its width instead of cropping
    assert "libnvidia-ml.so.1 not found" in t.plain
    assert msgspec  # (imported to keep synthetic's frames typed)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)])
def test_help_screen(snap_compare, size) -> None:
    async def open_help(pilot) -> None:
        await settle(pilot)
        await pilot.press("question_mark")
        await settle(pilot)

    assert snap_compare(fixed_app(gpus=0), terminal_size=size, run_before=open_help)


def test_table_sorted_by_share_160x50(snap_compare) -> None:
    async def sort(pilot) -> None:
        await settle(pilot)
        await pilot.press("o")
        await pilot.press("2")
        await settle(pilot)

    assert snap_compare(fixed_app(gpus=2), terminal_size=(160, 50), run_before=sort)


@pytest.mark.parametrize("size", [(80, 24), (160, 50)])
async def test_replay_status_is_on_screen_and_angle_keys_seek(tmp_path, size):
    """The replay's position / length / speed is on the screen (the footer once covered it), and `<`
    and `>`, the keys footer, help and README name, move in the recording."""
    from dflash_tui import synthetic

    rec = synthetic.write_recording(tmp_path / "telemetry.jsonl", 121, interval_s=0.5)
    app = DFlashTop(rec, paused=True)
    async with app.run_test(size=size) as pilot:

        async def until(text: str) -> None:
            for _ in range(200):
                app.refresh_panels(slow=True)
                await pilot.pause(0.05)
                if text in screen_text(app):
                    return
            raise AssertionError(f"{text!r} never on the screen:\n{screen_text(app)}")

        await until("replay 0:00 / 1:00 at 1x, paused")
        await pilot.press("greater_than_sign")
        await until("replay 0:10 / 1:00 at 1x, paused")
        await pilot.press("greater_than_sign")
        await until("replay 0:20 / 1:00 at 1x, paused")
        await pilot.press("less_than_sign")
        await until("replay 0:10 / 1:00 at 1x, paused")
        await pilot.press("comma")  # the old keys still work
        await until("replay 0:00 / 1:00 at 1x, paused")
        await pilot.press("j")
        await pilot.press(*"0:30", "enter")
        await until("replay 0:30 / 1:00 at 1x, paused")
        assert app.state.step == 61 * 4  # the state followed: snapshot 61 (of 4 steps each) is at 0:30
        # every event, the TUI's own notes included, is stamped with the run's time, not today's
        assert app.state.events and all(synthetic.T0 <= ev.t <= synthetic.T0 + 100 for ev in app.state.events)
