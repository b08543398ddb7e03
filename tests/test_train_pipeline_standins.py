"""The pipeline on its own, driven by plain Python stand-in stages (no model, no torch work): how fast a
failure anywhere stops every thread, and that it counts time on the clock it is given."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from dflash.telemetry import ProfileStats
from dflash.train.config import TrainConfig
from dflash.train.config.schema import updated
from dflash.train.run.pipeline import Pipeline, TrainCounters

CPU = torch.device("cpu")


def _cfg(pipeline: bool = True, **kw) -> TrainConfig:
    return updated(TrainConfig(), **{"pipeline": pipeline, "batch_queue_size": 2, "hs_queue_size": 2, **kw})


class Boom(RuntimeError):
    pass


class StandIns:
    """A batch source, a target stage and a drafter stage as plain callables; ``fail_in`` names the one
    that raises (after a few calls, so the queues are busy), and the moment it raised is kept."""

    def __init__(self, stats: ProfileStats, fail_in: str | None = None, after: int = 3):
        self.fail_in, self.after, self.calls = fail_in, after, {"source": 0, "target": 0, "drafter": 0}
        self.raised_at = 0.0
        self.raised = threading.Event()
        self.target_tel = stats.worker("target-0")
        self.drafter = SimpleNamespace(device=CPU, tel=stats.worker("drafter-0"), step=self.step)

    def _tick(self, who: str) -> None:
        self.calls[who] += 1
        if who == self.fail_in and self.calls[who] > self.after:
            self.raised_at = time.monotonic()
            self.raised.set()
            raise Boom(f"boom in the {who}")

    def source(self, index: int) -> SimpleNamespace:
        self._tick("source")
        return SimpleNamespace(index=index)

    def forward(self, batch) -> SimpleNamespace:
        self._tick("target")
        return SimpleNamespace(batch=batch)

    def step(self, hidden, progress: float) -> SimpleNamespace:
        self._tick("drafter")
        return SimpleNamespace(progress=progress)


class TargetStandIn:
    """A target stage: a callable with the name, device and telemetry handle the pipeline reads."""

    def __init__(self, parts: StandIns):
        self.name, self.device, self.tel, self._forward = "target-0", CPU, parts.target_tel, parts.forward

    def __call__(self, batch):
        return self._forward(batch)


def _advance(state: TrainCounters):
    def on_step(r) -> bool:
        state.step += 1
        state.next_batch += 1
        return True
    return on_step


@pytest.mark.parametrize("fail_in,pipelined", [("source", True), ("target", True), ("drafter", True),
                                               ("drafter", False)])
def test_an_exception_in_any_stage_stops_every_thread_within_half_a_second(fail_in, pipelined):
    stats = ProfileStats()
    parts = StandIns(stats, fail_in=fail_in)
    state = TrainCounters()
    cfg = _cfg(pipelined)
    p = Pipeline(parts.source, [TargetStandIn(parts)], parts.drafter, cfg.pipeline, cfg.run, stats, state,
                 _advance(state))
    p.start()
    assert parts.raised.wait(10), f"the {fail_in} stand-in was never called {parts.after + 1} times"
    deadline = parts.raised_at + 5.0
    for t in p.threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stopped = time.monotonic() - parts.raised_at
    assert not p.running, "a worker outlived the failure"
    assert stopped < 0.5, f"the pipeline took {stopped:.2f} s to stop after the {fail_in} raised"
    assert p.stop.is_set() and isinstance(p.error, Boom)
    assert p.failure is not None and f"Boom: boom in the {fail_in}" in p.failure[1]
    assert p.shutdown(timeout=0.1) == []


def test_progress_counts_on_the_clock_it_is_given():
    """A multi-rank run passes the clock the ranks agreed on: the LR schedule's progress must follow
    that clock, not the pipeline's own."""
    stats = ProfileStats()
    parts = StandIns(stats)
    now = [0.0]
    seen: list[float] = []
    state = TrainCounters()
    advance = _advance(state)

    def on_step(r) -> bool:
        seen.append(r.progress)
        now[0] += 25.0  # the agreed clock moves 25 s per step whatever the wall clock does
        advance(r)
        return len(seen) < 4

    cfg = _cfg(max_time=100.0)
    p = Pipeline(parts.source, [TargetStandIn(parts)], parts.drafter, cfg.pipeline, cfg.run, stats, state,
                 on_step, clock=lambda: now[0])
    p.start()
    for t in p.threads:
        t.join(10)
    assert p.shutdown(timeout=1) == [] and p.failure is None
    assert seen == [0.0, 0.25, 0.5, 0.75]
    assert p.depths()[0] <= 2 and p.depths()[1] <= 2


def test_a_straggling_target_bounds_what_the_drafter_holds():
    """Two targets, one stuck on batch 3: the other may run ahead only reorder_window batches past the
    drafter (waiting in reorder_wait, seen live), so the batches held for in-order consumption stay
    bounded (unbounded, they were GPU-resident hidden states piling up); released, all train in order."""
    stats = ProfileStats()
    stuck, computed, consumed = threading.Event(), [], []

    class Target:
        def __init__(self, i: int):
            self.name, self.device, self.tel = f"target-{i}", CPU, stats.worker(f"target-{i}")

        def __call__(self, batch):
            if batch.index == 3:
                assert stuck.wait(30), "the stuck target was never released"
            computed.append(batch.index)
            return SimpleNamespace(batch=batch)

    state = TrainCounters()
    advance = _advance(state)

    def on_step(r) -> bool:
        advance(r)
        return state.step < 12

    def step(hidden, progress):
        consumed.append(hidden.batch.index)
        return SimpleNamespace()

    drafter = SimpleNamespace(device=CPU, tel=stats.worker("drafter-0"), step=step)
    cfg = _cfg()  # hs_queue_size 2, two targets: the window is 4
    p = Pipeline(lambda i: SimpleNamespace(index=i), [Target(0), Target(1)], drafter, cfg.pipeline, cfg.run,
                 stats, state, on_step)
    p.start()
    deadline = time.monotonic() + 30
    while not any(cat == "reorder_wait" for w in ("target-0", "target-1")
                  for cat, _ in stats.worker(w).open_spans()):
        assert time.monotonic() < deadline and p.failure is None, f"no target waited; computed {computed}"
        time.sleep(0.01)
    assert consumed == [0, 1, 2] and max(computed) <= 3 + 4, computed
    stuck.set()
    for t in p.threads:
        t.join(10)
    assert p.shutdown(timeout=1) == [] and p.failure is None
    assert consumed == list(range(12))
