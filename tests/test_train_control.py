"""The per-step decisions (stop, checkpoint, evaluate) on a clock the test moves by hand."""

from __future__ import annotations

from dflash.train.control import Decision, Interval, StepControl


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_checkpoints_and_evaluations_follow_their_intervals_on_the_given_clock():
    clock = Clock()
    c = StepControl(max_steps=None, max_time=None, checkpoint_every=60, eval_every=100, clock=clock)
    assert c.after_step(1, False, 0.0) == Decision()
    clock.now += 60
    assert c.after_step(2, False, 0.0) == Decision(checkpoint=True)
    c.checkpoints.restart()  # the trainer restarts the interval once the checkpoint is written
    clock.now += 40
    assert c.after_step(3, False, 0.0) == Decision(evaluate=True)
    c.evaluations.restart()
    assert c.after_step(4, False, 0.0) == Decision()


def test_a_stop_checkpoints_and_skips_the_evaluation():
    clock = Clock()
    c = StepControl(max_steps=5, max_time=None, checkpoint_every=1e9, eval_every=10, clock=clock)
    clock.now += 10
    assert c.after_step(5, False, 0.0) == Decision(stop=True, checkpoint=True)
    # a signal, or the training clock reaching max_time, stops the same way
    assert c.after_step(1, True, 0.0) == Decision(stop=True, checkpoint=True)
    timed = StepControl(max_steps=None, max_time=30.0, checkpoint_every=1e9, eval_every=0, clock=clock)
    assert timed.after_step(1, False, 29.9) == Decision()
    assert timed.after_step(2, False, 30.0) == Decision(stop=True, checkpoint=True)


def test_only_rank_0_proposes_checkpoints_and_zero_means_every_step_or_never():
    clock = Clock()
    other = StepControl(max_steps=None, max_time=None, checkpoint_every=0, eval_every=0, is_main=False, clock=clock)
    assert other.after_step(1, False, 0.0) == Decision()
    main = StepControl(max_steps=None, max_time=None, checkpoint_every=0, eval_every=0, clock=clock)
    clock.now += 1e6
    assert main.after_step(1, False, 0.0) == Decision(checkpoint=True)  # eval_every 0: only the final one
    never = Interval(None, clock)
    clock.now += 1e9
    assert not never.due()
