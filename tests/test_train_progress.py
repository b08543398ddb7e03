"""Progress and ETA: one computation for the log line and the gauges dflash-top shows."""

from __future__ import annotations

from dflash.train.reporting.progress import EvalProgress, Progress, clock


def test_clock():
    assert [clock(v) for v in (0, 65, 600, 3723, None, -1)] == ["0:00", "1:05", "10:00", "1:02:03", "?", "?"]


def test_steps_limit_uses_the_runs_rate():
    p = Progress(step=120, elapsed=60.0, max_steps=240, rate=2.0)
    assert p.fraction == 0.5 and p.eta_s == 60.0
    assert p.text() == "step    120/240 (50%) | 1:00 | ETA 1:00"
    assert p.gauges() == {"train_time_s": 60.0, "max_steps": 240.0, "progress": 0.5, "eta_s": 60.0}


def test_the_nearer_limit_ends_the_run():
    # 10 % of the steps but 90 % of the time: the time limit comes first
    p = Progress(step=100, elapsed=270.0, max_steps=1000, max_time=300.0, rate=0.5)
    assert p.fraction == 0.9 and p.eta_s == 30.0
    assert p.text() == "step    100/1000 (90%) | 4:30 of 5:00 | ETA 0:30"


def test_no_limit_known_yet_says_so():
    p = Progress(step=3, elapsed=2.0)
    assert p.fraction is None and p.eta_s is None and p.text() == "step      3 | 0:02 | ETA ?"
    assert p.gauges() == {"train_time_s": 2.0}


def test_eval_progress_counts_prompts():
    assert EvalProgress(0, 8, 0.0).eta_s is None
    p = EvalProgress(2, 8, 30.0)
    assert p.eta_s == 90.0 and p.text() == "prompt 2/8 | 0:30 | ETA 1:30"
    assert p.gauges() == {"eval_done": 2.0, "eval_total": 8.0, "eval_time_s": 30.0, "eval_eta_s": 90.0}
