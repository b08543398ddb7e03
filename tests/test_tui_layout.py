"""What dflash-top puts on the screen at the sizes the README names (80x24 over ssh, 160x50): every
number whole, labelled, and no box of empty rows; asserted on the rendered screen, not a widget's text."""

from __future__ import annotations

import re
import time

import pytest
from conftest import screen_text
from test_tui_snapshots import settle, utc  # noqa: F401 (utc: autouse fixture)

from dflash.telemetry.wire.protocol import CategoryStats, Snapshot
from dflash_tui import synthetic
from dflash_tui.app import DFlashTop
from dflash_tui.pyspy import FunctionStat, RecordReport
from dflash_tui.sources import MemorySource
from dflash_tui.widgets.record import ProfileScreen


def app_of(frames: list) -> DFlashTop:
    return DFlashTop(source=MemorySource(frames, path="runs/demo/telemetry.jsonl", detail="replay of runs/demo"),
                     pyspy_exe="py-spy")


def lines_of(app: DFlashTop) -> list[str]:
    return screen_text(app).splitlines()


def box(lines: list[str], title: str) -> list[str]:
    """The inside of the bordered box titled `title` (its rows, borders cut off), the first found."""
    top = next(i for i, line in enumerate(lines) if f"╭─ {title}" in line)
    left = lines[top].index(f"╭─ {title}")
    right = lines[top].index("╮", left)
    inside = []
    for line in lines[top + 1:]:
        if line[left] == "╰":
            return inside
        inside.append(line[left + 1:right])
    raise AssertionError(f"the {title!r} box has no bottom border on the screen")


async def test_the_80x24_header_keeps_every_number_whole_and_says_the_tau_is_simulated() -> None:
    app = app_of(synthetic.frames(80, workers=8, gpus=0))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        header = lines_of(app)[1]
        assert re.search(r"trained \d+:\d\d\s*$", header), header  # `trained 0:4` was cut at the edge
        assert "sim tau 2.97" in header, header


@pytest.mark.parametrize("width", [80, 88])
async def test_a_narrow_header_with_mfu_drops_the_training_clock_whole_rather_than_cut(width: int) -> None:
    frames = synthetic.frames(80, workers=8, gpus=1)
    for f in frames:
        if hasattr(f, "gauges"):
            f.gauges.update({"mfu": 0.412, "tflops": 407.0, "max_time_s": 300.0})
    app = app_of(frames)
    async with app.run_test(size=(width, 24)) as pilot:
        await settle(pilot)
        header = lines_of(app)[1]
        assert "MFU 41.2%" in header and "ETA " in header, header
        # the clock goes whole (`trained 0:40/5:00` does not fit), never `trained 0:4`
        assert "trained" not in header and re.search(r"sim tau \d\.\d\d\s*$", header), header


async def test_the_160x50_table_shows_whole_columns_and_no_empty_rows() -> None:
    app = app_of(synthetic.frames(80, workers=3, gpus=2, categories=6))
    async with app.run_test(size=(160, 50)) as pilot:
        await settle(pilot)
        lines = lines_of(app)
        table = box(lines, "per-category timings")
        header = table[0].split()
        assert header[-2:] == ["p50", "max"], table[0]
        rows = [r for r in table[1:] if r.strip()]
        assert len(rows) == 18 and len(table) == 19, "a row per worker and category, no empty rows below"
        for row in rows:  # every max whole: a duration with its unit, before the border
            assert re.search(r"\d(ns|µs|ms|s)\s*$", row), row
        curves = "\n".join(box(lines, "training curves"))
        assert "sim tau 2.97" in curves and "\ntau" not in curves


async def test_the_time_bars_head_their_now_column() -> None:
    app = app_of(synthetic.frames(80, workers=3, gpus=0))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        bars = box(lines_of(app), "where time goes")
        assert re.fullmatch(r"\s+now \(open span\)\s+for\s*", bars[0]), bars[0]
        assert re.search(r"target_forward\s+\d", bars[1]), bars[1]


async def test_events_wrap_instead_of_being_cut() -> None:
    app = app_of(synthetic.frames(80, workers=3, gpus=2))
    async with app.run_test(size=(160, 50)) as pilot:
        await settle(pilot)
        events = box(lines_of(app), "events")
        assert any("path=ckpt/step-160" in line for line in events), events  # was cut at `step=160 pa`


async def test_a_span_still_open_reads_open_not_zero() -> None:
    frames = synthetic.frames(20, workers=1, gpus=0, categories=4)
    last = [f for f in frames if isinstance(f, Snapshot)][-1]
    # one long call that has not ended in this window: its time is in the share, no span finished
    last.workers["target-0"]["target_forward"] = CategoryStats(n=0, total=0.0, mean=0.0, p50=0.0, p95=0.0,
                                                              max=0.0, share=0.9)
    app = app_of(frames)
    async with app.run_test(size=(160, 50)) as pilot:
        await settle(pilot)
        row = next(r for r in box(lines_of(app), "per-category timings") if "target_forward" in r)
        assert re.search(r"target_forward\s+90\.0%\s+open\s", row), row


@pytest.mark.parametrize("size", [(80, 24), (160, 50)])
async def test_the_speedscope_path_never_breaks_mid_name(size, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "runs" / "train-20261201-093000" / "pyspy" / "record-20261201-093512-123.speedscope.json"
    report = RecordReport(pid=4242, seconds=10, gil=False, native=False, path=str(path), samples=1000,
                          top=[FunctionStat(name="forward", where="dflash/model/drafter.py:120", python=True,
                                            self_samples=400, total_samples=900)])
    app = app_of(synthetic.frames(5, workers=1, gpus=0))
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        app.push_screen(ProfileScreen(report))
        await pilot.pause()
        await pilot.pause()
        lines = lines_of(app)
        for part in (f"{path.parent.relative_to(tmp_path)}/", path.name):  # each whole, on a line of its own
            assert any(part in line for line in lines), screen_text(app)


@pytest.mark.parametrize("key, title", [("5", "training curves"), ("6", "events")])
async def test_a_zoomed_panel_fills_the_80x24_screen(key, title) -> None:
    app = app_of(synthetic.frames(80, workers=3, gpus=0))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        await pilot.press(key)
        await settle(pilot)
        # 24 rows: 2 of header, the status line and the keys; the box and its borders take the rest
        assert len(box(lines_of(app), title)) == 24 - 4 - 2, screen_text(app)


async def _until_screen(pilot, cond, what: str) -> list[str]:
    """The screen's lines once `cond(lines)` holds (the hint follows the layout a refresh later)."""
    import time

    deadline = time.monotonic() + 30
    while not cond(lines := lines_of(pilot.app)):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(lines))
        await pilot.pause()
    return lines


def _hint(lines: list[str]) -> str | None:
    return next((line.strip() for line in lines if line.strip().startswith("out of view:")), None)


async def test_at_80x24_every_panel_shows_or_is_named_with_its_zoom_key() -> None:
    """The stacked panels do not fit 24 rows: those out of view are named on a line of their own with
    the number that zooms each; scrolled down, the ones above are; at 160x50 all fit and no line shows."""
    from dflash_tui.layout import ZOOMABLE

    titles = {"bars": "where time goes", "table": "per-category timings", "GPUs": "GPUs", "threads": "threads",
              "curves": "training curves", "events": "events"}
    assert set(titles) == {p.zoom for p in ZOOMABLE}

    def accounted(lines: list[str]) -> bool:
        hint = _hint(lines) or ""
        shown = {name for name, title in titles.items() if any(f"╭─ {title}" in line for line in lines)}
        named = {p.zoom for i, p in enumerate(ZOOMABLE, 1) if f"{i} {p.zoom}" in hint}
        return hint.endswith("its number zooms it") and shown | named == set(titles) and named

    app = app_of(synthetic.frames(80, workers=3, gpus=2))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        lines = await _until_screen(pilot, accounted, "every panel on screen or named in the hint")
        assert "3 GPUs" in _hint(lines) and "1 bars" not in _hint(lines), _hint(lines)
        await pilot.press("3")  # the key the hint names brings the panel up
        lines = await _until_screen(pilot, lambda ls: any("╭─ GPUs" in line for line in ls), "the zoomed GPUs")
        assert _hint(lines) is None  # a zoomed panel fills the screen
        await pilot.press("3")
        app.query_one("#body").scroll_end(animate=False)
        lines = await _until_screen(pilot, lambda ls: accounted(ls) and "1 bars" in (_hint(ls) or ""),
                                    "the panels scrolled above named")
    app = app_of(synthetic.frames(80, workers=3, gpus=2))
    async with app.run_test(size=(160, 50)) as pilot:
        await settle(pilot)
        lines = lines_of(app)
        assert all(any(f"╭─ {title}" in line for line in lines) for title in titles.values()), "\n".join(lines)
        assert _hint(lines) is None


def _with_gauges(frames: list, gauges: dict) -> list:
    """The frames with ``gauges`` added to every snapshot's."""
    import msgspec

    return [msgspec.structs.replace(f, gauges={**f.gauges, **gauges}) if isinstance(f, Snapshot) else f
            for f in frames]


def _with_terms(frames: list, **terms: float) -> list:
    """The frames with the objective's term gauges a trainer publishes (`loss_<term>`) on every snapshot."""
    return _with_gauges(frames, {f"loss_{k}": v for k, v in terms.items()})


async def header_of(frames: list, size: tuple[int, int]) -> str:
    """The header line dflash-top draws for ``frames`` on a screen of ``size``."""
    app = app_of(frames)
    async with app.run_test(size=size) as pilot:
        await settle(pilot)
        return lines_of(app)[1]


async def test_the_header_names_the_objective_and_shows_its_terms() -> None:
    header = await header_of(_with_terms(synthetic.frames(80, workers=3, gpus=0), ce=2.1, selector=0.42), (160, 50))
    assert re.search(r"loss [\d.]+ \(ce 2\.1 \+ selector 0\.42\)  sim tau", header), header
    frames = _with_terms(synthetic.frames(80, workers=8, gpus=0), kl=2.5)
    header = await header_of(frames, (80, 24))
    # at 80 columns the term's name gives way before any number is cut
    assert re.search(r"trained \d+:\d\d\s*$", header), header
    header = await header_of(frames, (100, 24))
    assert re.search(r"loss [\d.]+ \(kl\)  sim tau", header), header


async def test_a_new_event_draws_what_a_full_layout_would() -> None:
    """An event redraws the log and its scrollbar without laying the screen out again (a full layout
    redrew every panel per event). Before the log overflows, as its scrollbar appears and after, the
    screen is the one a full layout then draws; the newest event is at the bottom, the first is a
    scroll away."""
    app = app_of(synthetic.frames(80, workers=3, gpus=0))
    async with app.run_test(size=(160, 50)) as pilot:
        await settle(pilot)
        room = len(box(lines_of(app), "events"))
        for i in range(room + 6):
            app.state.note("info", f"event number {i:02d}")
            await settle(pilot)
            shown = box(lines_of(app), "events")
            assert f"event number {i:02d}" in [r for r in shown if r.strip()][-1], shown
            if i in (0, room - 4, room - 3, room - 2, room + 5):  # the scrollbar comes around room - 3
                app.screen.refresh(layout=True)
                await settle(pilot)
                assert box(lines_of(app), "events") == shown, f"after event {i}"
        log = app.query_one("#events")
        assert log.show_vertical_scrollbar
        log.scroll_home(animate=False)
        deadline = time.monotonic() + 60
        while not any("event number 00" in r for r in box(lines_of(app), "events")):
            assert time.monotonic() < deadline, "the first event is never scrolled back to"
            await pilot.pause(0.05)


@pytest.mark.parametrize("unzoom", ["1", "escape"])
async def test_panels_behind_a_zoomed_one_catch_up_when_it_unzooms(unzoom) -> None:
    """A zoomed panel hides the others, which are not drawn meanwhile: zoomed out (its number key, or
    escape), each shows the data that came in while it was hidden, with no new data to prompt it."""
    app = app_of(synthetic.frames(80, workers=3, gpus=0))
    async with app.run_test(size=(160, 50)) as pilot:
        await settle(pilot)
        await pilot.press("1")  # the time bars fill the screen; the events box is hidden
        await _until_screen(pilot, lambda lines: not any("╭─ events" in x for x in lines), "the zoom")
        app.state.note("info", "noted while zoomed")
        app.refresh_panels()  # as a snapshot would: the zoomed panel is drawn, the hidden ones wait
        await pilot.press(unzoom)
        await _until_screen(pilot, lambda lines: any("╭─ events" in x for x in lines)
                            and any("noted while zoomed" in r for r in box(lines, "events")),
                            "the hidden events box to show the note once shown again")


async def test_panels_scrolled_out_of_view_catch_up_when_scrolled_back() -> None:
    """At 80x24 the lower panels are out of view and are not drawn: scrolled into view, each shows the
    data that came in meanwhile, with no new data to prompt it."""
    app = app_of(synthetic.frames(80, workers=3, gpus=0))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert not any("╭─ events" in x for x in lines_of(app)), "the events box starts out of view"
        app.state.note("info", "noted out of view")
        app.refresh_panels()  # as a snapshot would: the shown panels are drawn, the others wait
        app.query_one("#body").scroll_end(animate=False)
        await _until_screen(pilot, lambda lines: any("noted out of view" in r for r in box(lines, "events"))
                            if any("╭─ events" in x for x in lines) else False,
                            "the events box to show the note once scrolled into view")


async def test_the_header_shows_mfu_and_na_without_a_known_peak() -> None:
    """On a GPU with a known peak the trainer publishes `mfu`: the header shows it with the model TFLOP/s
    beside the tokens/s, and at 80 columns the TFLOP/s gives way before the MFU or any other number is
    cut (the training clock at the end of the line goes whole, as the header crops it). On the host (no
    peak: `tflops` alone) it says `MFU n/a`, never a figure; a trainer that sends neither (a recording
    from before, a target whose FLOPs are not counted) gets no MFU at all."""
    gpu = _with_gauges(synthetic.frames(80, workers=3, gpus=0), {"tflops": 407.4, "mfu": 0.412, "peak_tflops": 989.0})
    header = await header_of(gpu, (160, 50))
    assert re.search(r"tok/s \S+ \S+  MFU 41\.2% 407 TFLOP/s  loss [\d.]+  sim tau", header), header
    header = await header_of(gpu, (80, 24))
    assert "  MFU 41.2%  loss " in header and "TFLOP/s" not in header, header
    # the training clock, last on the line, is what a narrow terminal loses: whole, or not at all
    assert re.search(r"sim tau [\d.]+\s*$", header), header
    header = await header_of(_with_gauges(synthetic.frames(80, workers=3, gpus=0), {"tflops": 0.0213}), (160, 50))
    assert "  MFU n/a 0.0213 TFLOP/s  loss " in header, header
    header = await header_of(synthetic.frames(80, workers=3, gpus=0), (160, 50))
    assert "tok/s" in header and "MFU" not in header and "TFLOP/s" not in header, header
