"""The anomaly detector on window statistics: a sustained slowdown is one event, noise is none."""

from __future__ import annotations

import random

from dflash.telemetry.summary import Summary
from dflash.telemetry.verdict.anomalies import AnomalyDetector
from dflash.telemetry.wire.protocol import CategoryStats


def _window(t: float, cats: dict[str, float]) -> Summary:
    stats = {c: CategoryStats(n=10, total=10 * v, mean=v, p50=v, p95=v * 1.3, max=v * 1.6, share=min(1.0, 10 * v))
             for c, v in cats.items()}
    return Summary(t=t, window_s=1.0, workers={"target-0": stats})


def _run(det: AnomalyDetector, values: list[dict[str, float]], start: float = 1000.0) -> list[tuple[str, str]]:
    """Feed one 1 s window per entry; the events raised."""
    events: list[tuple[str, str]] = []
    det.emit = lambda kind, msg, **data: events.append((kind, msg))
    for i, cats in enumerate(values):
        det.check(_window(start + i, cats))
    return events


def test_a_sustained_slowdown_is_one_event_and_its_end_another() -> None:
    rng = random.Random(1)
    base = [{"target_forward": 0.012 * rng.uniform(0.9, 1.1)} for _ in range(40)]
    slow = [{"target_forward": 0.041 * rng.uniform(0.95, 1.05)} for _ in range(20)]
    back = [{"target_forward": 0.012 * rng.uniform(0.9, 1.1)} for _ in range(20)]
    det = AnomalyDetector()
    events = _run(det, base + slow[:10])
    assert [k for k, _ in events] == ["anomaly"]
    msg = events[0][1]
    assert msg.startswith("target-0/target_forward p95 3.") and "its baseline (" in msg and " vs 15" in msg
    assert det.active and det.active[0].ratio > 3
    events = _run(det, slow[10:] + back, start=1050.0)
    assert [k for k, _ in events] == ["anomaly_end"] and not det.active


def test_noise_spikes_and_waits_raise_nothing() -> None:
    rng = random.Random(2)
    values = []
    for i in range(300):
        v = 0.012 * rng.uniform(0.8, 1.25)
        if i % 7 == 0:
            v *= 5  # a single slow window now and then (GC, a checkpoint elsewhere)
        wait = 0.001 if i < 150 else 0.05  # a wait that grows 50x: the consequence of someone else
        values.append({"target_forward": v, "hs_queue_put": wait})
    assert _run(AnomalyDetector(), values) == []


def test_no_judgement_before_a_baseline() -> None:
    values = [{"target_forward": 0.01}] * 5 + [{"target_forward": 1.0}] * 30
    assert _run(AnomalyDetector(), values) == []  # the slow part became the baseline before judging


def _slow_after_baseline(rng: random.Random, slow: list[bool], mean: float = 0.012) -> list[dict[str, float]]:
    """40 normal windows, then one per entry of `slow`: 3.4x slower where it is True."""
    return ([{"target_forward": mean * rng.uniform(0.9, 1.1)} for _ in range(40)]
            + [{"target_forward": mean * (3.4 if s else 1.0) * rng.uniform(0.95, 1.05)} for s in slow])


def test_a_category_too_small_to_matter_raises_nothing() -> None:
    """batch_build at 0.3% of its worker's time, 3.4x slower for 20 s: nothing worth a banner; the same
    slowdown of a category that takes 12% of the time is one."""
    tiny = [{"batch_build": v["target_forward"] / 40} for v in _slow_after_baseline(random.Random(3), [True] * 20)]
    assert all(10 * w["batch_build"] < 0.02 for w in tiny[:40])
    assert _run(AnomalyDetector(), tiny) == []
    big = _slow_after_baseline(random.Random(3), [True] * 20)
    assert [k for k, _ in _run(AnomalyDetector(), big)] == ["anomaly"]


def test_a_stage_hovering_at_the_edge_is_one_anomaly_not_a_flapping_one() -> None:
    """Slow for 8 s, normal for 6 s, over and over: before the end needed 10 s of calm, this started and
    ended an anomaly every cycle."""
    pattern = ([True] * 8 + [False] * 6) * 6
    events = _run(AnomalyDetector(), _slow_after_baseline(random.Random(4), pattern))
    assert [k for k, _ in events] == ["anomaly"], events


def test_every_anomaly_ends_at_a_phase_change_and_at_the_end_of_the_run() -> None:
    det = AnomalyDetector()
    events = _run(det, _slow_after_baseline(random.Random(5), [True] * 10))
    assert [k for k, _ in events] == ["anomaly"] and det.active
    evaluation = _window(2000.0, {"target_forward": 0.041})
    evaluation.gauges = {"eval_done": 0.0, "eval_total": 8.0}
    assert det.check(evaluation) == [] and events[-1] == ("anomaly_end", "target-0/target_forward ended: "
                                                                         "an evaluation began")
    events = _run(det, _slow_after_baseline(random.Random(6), [True] * 10)[40:], start=3000.0)
    # training again (the evaluation's end is a phase change too), still slow: a new one
    assert [k for k, _ in events] == ["anomaly"]
    last = _window(4000.0, {"target_forward": 0.041})
    last.final = True
    assert det.check(last) == [] and last.anomalies == []
    assert events[-1] == ("anomaly_end", "target-0/target_forward ended: the run ended")
