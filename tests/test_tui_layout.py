"""What dflash-top puts on the screen at the sizes the README names (80x24 over ssh, 160x50): every
number whole, labelled, and no box of empty rows; asserted on the rendered screen, not a widget's text."""

from __future__ import annotations

import re

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


def _with_terms(frames: list, **terms: float) -> list:
    """The frames with the objective's term gauges a trainer publishes (`loss_<term>`) on every snapshot."""
    import msgspec

    extra = {f"loss_{k}": v for k, v in terms.items()}
    return [msgspec.structs.replace(f, gauges={**f.gauges, **extra}) if isinstance(f, Snapshot) else f
            for f in frames]


async def test_the_header_names_the_objective_and_shows_its_terms() -> None:
    app = app_of(_with_terms(synthetic.frames(80, workers=3, gpus=0), ce=2.1, selector=0.42))
    async with app.run_test(size=(160, 50)) as pilot:
        await settle(pilot)
        header = lines_of(app)[1]
        assert re.search(r"loss [\d.]+ \(ce 2\.1 \+ selector 0\.42\)  sim tau", header), header
    frames = _with_terms(synthetic.frames(80, workers=8, gpus=0), kl=2.5)
    app = app_of(frames)
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        header = lines_of(app)[1]
        # at 80 columns the term's name gives way before any number is cut
        assert re.search(r"trained \d+:\d\d\s*$", header), header
    app = app_of(frames)
    async with app.run_test(size=(100, 24)) as pilot:
        await settle(pilot)
        header = lines_of(app)[1]
        assert re.search(r"loss [\d.]+ \(kl\)  sim tau", header), header
