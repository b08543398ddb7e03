"""The main thread's log lines, driven by a clock moved by hand and a stand-in pipeline: a line only
when steps were made, with the means of exactly the steps since the last line."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dflash.train.config import TrainConfig
from dflash.train.logline import LogLines
from dflash.train.metrics import StepMetrics
from dflash.train.pipeline import TrainCounters
from dflash.train.reporting import Reporter
from dflash.train.schema import updated


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


def test_a_line_per_interval_only_when_steps_were_made() -> None:
    now, out = [0.0], []
    state, metrics, stats = TrainCounters(), StepMetrics(), _Stats()
    lines = LogLines(updated(TrainConfig(), log_every=10.0, telemetry_interval=1.0), state, stats, metrics, _Pipeline(now),
                     latest=lambda: None, verdict=lambda: None, report=Reporter(out.append),
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
