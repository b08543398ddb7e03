"""The main thread's log lines, driven by a clock moved by hand and a stand-in pipeline: a line only
when steps were made, with the means of exactly the steps since the last line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash.telemetry.verdict.evidence import analyze
from dflash.telemetry.wire.protocol import CategoryStats, Snapshot
from dflash.train.config import TrainConfig
from dflash.train.config.schema import updated
from dflash.train.device.metrics import StepMetrics
from dflash.train.reporting import Reporter
from dflash.train.reporting.logline import LogLines
from dflash.train.run.pipeline import TrainCounters


class _Stats:
    def __init__(self) -> None:
        self.values: dict[str, object] = {}

    def gauge(self, name: str, value: object) -> None:
        self.values[name] = value

    metric = gauge


class _Pipeline:  # what LogLines reads of the pipeline
    def __init__(self, now: list[float]) -> None:
        self.now = now

    def clock(self) -> float:
        return self.now[0]

    def depths(self) -> tuple[int, int]:
        return 1, 2


def _step(state: TrainCounters, metrics: StepMetrics, loss: float, tokens: int) -> None:
    state.step += 1
    state.tokens += tokens
    state.last = SimpleNamespace(lr=1e-3)
    # loss, leading-correct runs, correct per position (2 positions); its gradient norm
    metrics.add(torch.tensor([loss, 3.0, 2.0, 1.0], dtype=torch.float64), torch.tensor(1.5), [4, 4], 4)


def cs(share: float) -> CategoryStats:
    return CategoryStats(n=10, total=share, mean=share / 10, p50=share / 10, p95=share / 10, max=share / 10,
                         share=share)


def shares(put: float) -> dict:
    return {"target-0": {"target_forward": cs(1 - put), "hs_queue_put": cs(put)},
            "drafter-0": {"drafter_forward": cs(0.4), "drafter_backward": cs(0.6)}}


def test_a_line_per_interval_only_when_steps_were_made() -> None:
    now, out = [0.0], []
    state, metrics, stats = TrainCounters(), StepMetrics(), _Stats()
    lines = LogLines(updated(TrainConfig(), log_every=10.0, telemetry_interval=1.0), state, stats, metrics,
                     _Pipeline(now),
                     latest=lambda: None, verdict=lambda whole_run=None: None, report=Reporter(out.append),
                     devices=[torch.device("cpu")], clock=lambda: now[0])
    now[0] = 10.0
    lines.tick()
    assert out == []  # due, but no step yet: no line
    _step(state, metrics, loss=2.0, tokens=100)
    now[0] = 15.0
    lines.tick()  # the harvest is due (telemetry interval), the line is not
    assert out == [] and stats.values["loss"] == 2.0 and stats.values["train_time_s"] == 15.0
    _step(state, metrics, loss=4.0, tokens=100)
    now[0] = 20.0
    lines.tick()
    assert len(out) == 1, out
    line = out[0]
    # the mean over both steps since the last line (one harvested early, one at the line), 200 tokens / 10 s
    assert "loss 3.000" in line and "| 20 tok/s |" in line and "gnorm 1.50" in line and "q batch 1/4 hs 2/2" in line
    now[0] = 40.0
    lines.tick()
    assert len(out) == 1  # nothing new to say


def test_the_last_line_judges_the_whole_run_not_its_wind_down_window() -> None:
    """(With --log-table, so that every line has its verdict and evidence.) Between intervals the line
    shows the verdict dflash-top shows (the window's); the last line of
    the run judges the cumulative shares: the last window is the wind-down, where a stage that waits
    on a stopped one looks blocked (84% there against 25% over the run, in a real `make train`)."""
    run, wind_down = shares(0.25), analyze(shares(0.84))
    assert "84%" in wind_down.reason and "25%" in analyze(run).reason
    now, out = [0.0], []
    state, metrics = TrainCounters(), StepMetrics()
    lines = LogLines(updated(TrainConfig(), log_table=True), state, _Stats(), metrics, _Pipeline(now),
                     latest=lambda: Snapshot(seq=1, t=0.0, interval_s=1.0, cumulative=run),
                     verdict=lambda whole_run=None: None if whole_run is not None else wind_down,
                     report=Reporter(out.append), devices=[], clock=lambda: now[0])
    for final in (False, True):
        _step(state, metrics, loss=2.0, tokens=100)
        now[0] += 10.0
        lines.write(final=final)
    verdicts = [line for line in out if line.startswith("bottleneck")]
    assert len(verdicts) == 2 and "84%" in verdicts[0] and "25%" in verdicts[1], verdicts
    assert verdicts[1].startswith("bottleneck (whole run): drafter-bound")
    # each verdict line is followed by its own evidence: the wind-down's 84%, then the run's 25%
    evidence = [line for line in out if line.startswith("  evidence:")]
    assert "target.hs_queue_put 84.0%" in evidence[0] and "target.hs_queue_put 25.0%" in evidence[1], evidence


def test_the_default_log_is_one_line_per_interval_and_a_table_every_few_minutes() -> None:
    """An hour at 10 s per line: 360 lines, each one line (progress, metrics, the verdict's name); the
    table, the verdict's reason and its evidence only every 5 minutes (the default) and at the end."""
    run = shares(0.25)
    now, out = [0.0], []
    state, metrics = TrainCounters(), StepMetrics()
    lines = LogLines(updated(TrainConfig(), log_every=10.0, telemetry_interval=1.0, max_steps=360), state, _Stats(),
                     metrics, _Pipeline(now), latest=lambda: Snapshot(seq=1, t=0.0, interval_s=1.0, cumulative=run),
                     verdict=lambda whole_run=None: analyze(run), report=Reporter(out.append), devices=[],
                     clock=lambda: now[0])
    per_write = []
    for i in range(360):
        _step(state, metrics, loss=2.0, tokens=100)
        now[0] += 10.0
        before = len(out)
        lines.write(final=i == 359)
        per_write.append(len(out) - before)
    progress = [line for line in out if line.startswith("step ")]
    assert len(progress) == 360 and all(line.endswith("| drafter-bound") for line in progress), progress[:2]
    tables = [i for i, n in enumerate(per_write) if n > 1][1:]
    assert tables == list(range(29, 359, 30)) + [359], tables  # every 300 s of the clock, and the last line
    assert per_write[0] == 3, out[:3]  # the first verdict is said with its reason and evidence when it appears
    assert all(n == 1 for i, n in enumerate(per_write) if i not in tables and i > 0)
    table = per_write[29] - 1  # the table, the verdict line and its evidence
    assert table >= 3 and len(out) == 360 + 2 + table * len(tables)
    assert sum(line.startswith("bottleneck") for line in out) == 1 + len(tables)


def test_a_verdict_that_changes_is_said_with_its_reason_at_once() -> None:
    """Between tables, a line names the verdict; when it changes, its reason and evidence follow that
    line at once (not minutes later with the next table), and only once."""
    drafter_bound, target_bound = shares(0.25), {"target-0": {"target_forward": cs(1.0)},
                                                 "drafter-0": {"hs_queue_wait": cs(0.5), "drafter_forward": cs(0.5)}}
    now, out, run = [0.0], [], [drafter_bound]
    state, metrics = TrainCounters(), StepMetrics()
    lines = LogLines(updated(TrainConfig(), log_every=10.0, telemetry_interval=1.0), state, _Stats(), metrics,
                     _Pipeline(now), latest=lambda: Snapshot(seq=1, t=0.0, interval_s=1.0, cumulative=run[0]),
                     verdict=lambda whole_run=None: analyze(run[0]), report=Reporter(out.append), devices=[],
                     clock=lambda: now[0])
    for i in range(10):
        run[0] = target_bound if i >= 5 else drafter_bound
        _step(state, metrics, loss=2.0, tokens=100)
        now[0] += 10.0
        lines.write()
    said = [line for line in out if line.startswith("bottleneck")]
    assert [line.split(" - ")[0] for line in said] == ["bottleneck: drafter-bound", "bottleneck: target-bound"], said
    changed = out.index(said[1])
    assert out[changed - 1].endswith("| target-bound") and out[changed + 1].startswith("  evidence: ")
    assert len([line for line in out if line.startswith("step ")]) == 10


def test_a_step_budget_says_up_front_how_long_it_takes_here() -> None:
    """Once, from the rate of the steps after the first (which pays for the warm-up)."""
    now, out = [0.0], []
    state, metrics = TrainCounters(), StepMetrics()
    lines = LogLines(updated(TrainConfig(), log_every=1e9, max_steps=400, eval_prompts=8), state, _Stats(), metrics,
                     _Pipeline(now), latest=lambda: None, verdict=lambda whole_run=None: None,
                     report=Reporter(out.append), devices=[], clock=lambda: now[0])
    now[0] = 30.0  # start-up
    _step(state, metrics, loss=2.0, tokens=100)
    lines.tick()
    for _ in range(30):  # then 2 steps/s
        now[0] += 0.5
        _step(state, metrics, loss=2.0, tokens=100)
        lines.tick()
    assert len(out) == 1, out
    assert out[0] == ("[phase] training: 400 steps at 2.00 steps/s here (steps 1-21): about 3:10 more, 3:50 in "
                      "all, then the final evaluation"), out


def test_the_run_ends_with_its_table_even_when_the_last_line_came_before() -> None:
    """The last interval's line may already show the last step (a short or fast run): the end of the
    run still has the table and the whole run's verdict, and no second line for the same step."""
    run = shares(0.25)
    now, out = [0.0], []
    state, metrics = TrainCounters(), StepMetrics()
    lines = LogLines(updated(TrainConfig(), log_every=10.0), state, _Stats(), metrics, _Pipeline(now),
                     latest=lambda: Snapshot(seq=1, t=0.0, interval_s=1.0, cumulative=run),
                     verdict=lambda whole_run=None: analyze(run), report=Reporter(out.append), devices=[],
                     clock=lambda: now[0])
    _step(state, metrics, loss=2.0, tokens=100)
    now[0] = 10.0
    lines.write()
    assert out[0].startswith("step ") and out[1].startswith("bottleneck")  # the first verdict, with its reason
    out.clear()
    lines.write(final=True)
    assert [line.startswith("step ") for line in out].count(True) == 0
    assert any(line.startswith("bottleneck") for line in out), out


def test_the_line_shows_model_tflops_and_mfu_against_the_peak_and_na_without_one() -> None:
    """A step of 4 TFLOP a second: `4 TFLOP/s MFU 40.0%` against a 10 TFLOP/s peak, `MFU n/a` without a
    known peak (the host), published as gauges too (MFU only with a peak); a run that counts no FLOPs (a
    target the count refuses) shows neither."""
    for peak, shown in ((10e12, "| 4 TFLOP/s MFU 40.0% |"), (None, "| 4 TFLOP/s MFU n/a |"), (None, None)):
        now, out = [0.0], []
        state, metrics, stats = TrainCounters(), StepMetrics(), _Stats()
        pipeline = _Pipeline(now)
        lines = LogLines(updated(TrainConfig(), log_every=10.0, telemetry_interval=1.0), state, stats, metrics,
                         pipeline, latest=lambda: None, verdict=lambda whole_run=None: None,
                         report=Reporter(out.append), devices=[torch.device("cpu")], clock=pipeline.clock,
                         peak_flops=peak)
        for t in range(1, 11):
            _step(state, metrics, loss=2.0, tokens=100)
            state.flops += 4e12 if shown else 0.0  # what on_step adds from each batch's count
            now[0] = float(t)
            lines.tick()
        assert len(out) == 1, out
        if shown is None:
            assert "TFLOP/s" not in out[0] and "MFU" not in out[0] and "tflops" not in stats.values, out[0]
            continue
        assert shown in out[0] and out[0].index("tok/s") < out[0].index("TFLOP/s") < out[0].index("| lr "), out[0]
        assert stats.values["tflops"] == pytest.approx(4.0)
        if peak is None:
            assert "mfu" not in stats.values and "peak_tflops" not in stats.values
        else:
            assert stats.values["mfu"] == pytest.approx(0.4) and stats.values["peak_tflops"] == 10
