"""The shared vocabulary: every verdict reaches every reader (help, trackers, Prometheus), and the
verdict groups workers by the role they registered, not by their names."""

from __future__ import annotations

import time

import pytest

from dflash.telemetry import ProfileStats
from dflash.telemetry.summary import to_snapshot
from dflash.telemetry.verdict.evidence import analyze
from dflash.telemetry.wire import protocol as P
from dflash.telemetry.wire.verdicts import VERDICTS
from dflash.telemetry.wire.vocab import CATEGORIES, SAMPLED_CATEGORIES, Role
from dflash.train.reporting.trackers import interval_scalars
from dflash_tui.widgets import palette
from dflash_tui.widgets.help import verdicts as help_verdicts


def test_every_verdict_has_help_text_a_tracker_key_and_a_prometheus_value() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dflash.telemetry.export.prometheus import MetricsExporter

    helps = dict(help_verdicts())
    exporter = MetricsExporter("vocab", rank=0)
    try:
        for name in VERDICTS:
            assert len(helps.get(name, "")) > 20, f"{name} has no help text"
            scalars = interval_scalars(loss=1.0, accuracy=0.5, sim_tau=1.0, per_position=[], tokens_per_s=1.0,
                                       lr=1e-4, grad_norm=1.0, workers=None, verdict=name)
            # one-hot over every verdict: this one 1, every other one 0 (a verdict missing here reports zeros)
            assert {k: v for k, v in scalars.items() if k.startswith("bottleneck/")} == {
                v.tracker_key: float(v.name == name) for v in VERDICTS.values()}
            exporter.update(None, P.Snapshot(seq=1, t=time.time(), interval_s=1.0,
                                             bottleneck=P.Bottleneck(verdict=name)))
            text = generate_latest(exporter.registry).decode()
            series = {s.labels["verdict"]: s.value for fam in text_string_to_metric_families(text)
                      for s in fam.samples if s.name == "dflash_bottleneck"}
            assert series == {v: float(v == name) for v in VERDICTS}, name
    finally:
        exporter.close()


def test_the_tui_colours_the_trainers_categories_in_pipeline_order() -> None:
    # the trainer's own categories first, in pipeline order, then the ones only a sampled view tells apart
    assert palette.KNOWN == [*CATEGORIES, *SAMPLED_CATEGORIES]
    assert [palette.category_order(c)[0] for c in CATEGORIES] == list(range(len(CATEGORIES)))
    # each known category its own colour while the palette has enough; one more shares a colour instead of
    # indexing past the palette (which raised)
    colours = [palette.category_color(c) for c in [*palette.KNOWN, "x"]]
    assert len(set(colours[:-1])) == min(len(palette.KNOWN), len(palette._COLORS))
    palette.KNOWN.append("a_seventeenth_category")
    try:
        assert palette.category_color("a_seventeenth_category").startswith("#")
    finally:
        palette.KNOWN.pop()


def _cat(share: float) -> P.CategoryStats:
    return P.CategoryStats(n=10, total=share, mean=share / 10, p50=0.0, p95=0.0, max=0.0, share=share)


def test_the_verdict_groups_workers_by_their_registered_role_not_their_name() -> None:
    """A producer named for what it reads (a hidden-states cache) is a target by role; a thread named
    `target-...` that registered no role is not judged as one."""
    stats = ProfileStats()
    stats.worker("cache-reader-0", Role.TARGET).add("hs_queue_put", 0.0)
    stats.worker("drafter-0", Role.DRAFTER).add("drafter_forward", 0.0)
    stats.worker("target-helper")
    summary = stats.drain()
    assert summary.roles == {"cache-reader-0": "target", "drafter-0": "drafter"}
    snap = P.decode(P.encode(to_snapshot(summary, 1, 1.0)))
    assert isinstance(snap, P.Snapshot) and snap.roles == summary.roles  # on the wire

    workers = {"cache-reader-0": {"hs_queue_put": _cat(0.6)}, "drafter-0": {"drafter_forward": _cat(0.9)},
               "target-helper": {"batch_queue_wait": _cat(0.9)}}
    b = analyze(workers, snap.roles)
    assert b.verdict == "drafter-bound" and b.evidence["targets"] == 1.0
    # a recording from before roles were on the wire is still judged, by its thread names
    assert analyze(workers).verdict == "data-bound"


def test_every_verdict_can_be_checked_against_its_evidence() -> None:
    """The stability benchmark counts verdicts that contradict their evidence: each verdict has a rule for
    that (a verdict without one would pass whatever its numbers say)."""
    from dflash.telemetry.verdict.evidence import agrees_with_evidence

    empty = {name: agrees_with_evidence(P.Bottleneck(verdict=name, evidence={"threshold": 0.2})) for name in VERDICTS}
    # with no waits at all only balanced (and unknown, which claims nothing) agree
    assert {name for name, ok in empty.items() if ok} == {"balanced", "unknown"}, empty


@pytest.mark.parametrize("name", [*VERDICTS, "from-a-newer-trainer"])
async def test_every_verdict_is_shown_on_screen_in_its_own_style(name: str) -> None:
    """The verdict panel draws each verdict's name in the style the verdict table gives it; a verdict the
    table does not know (a newer trainer's) still shows, in a style that is none of the known ones."""
    from conftest import screen_styles, until
    from rich.style import Style

    from dflash.telemetry.wire import verdicts
    from dflash_tui import synthetic
    from dflash_tui.app import DFlashTop
    from dflash_tui.sources import MemorySource

    frames = synthetic.frames(3, workers=4, gpus=0)
    frames[-1].bottleneck = P.Bottleneck(verdict=name, reason="a reason")
    app = DFlashTop(source=MemorySource(frames), pyspy_exe="py-spy")
    async with app.run_test(size=(100, 30)) as pilot:
        label = f" {name.upper()} "
        await until(pilot, lambda: screen_styles(app, label), f"{label!r} on the screen")
        # the screen holds true colours (the terminal theme maps the named ones): compare those
        theme = app.ansi_theme

        def look(style: Style) -> tuple:
            return tuple(c.get_truecolor(theme) if c is not None else None for c in (style.bgcolor, style.color))

        shown = {look(s) for s in screen_styles(app, label)}
        known = {v.name: look(Style.parse(v.style)) for v in verdicts.VERDICTS.values()}
        assert len(set(known.values())) == len(known)  # no two verdicts look alike
        if name in known:
            assert shown == {known[name]}
        else:
            assert all(s.reverse for s in screen_styles(app, label)) and not shown & set(known.values())
