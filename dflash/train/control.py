"""The per-step decisions of a run: stop, checkpoint, evaluate, agreed across ranks; and when to log.

Kept apart from the Trainer (which carries them out) and torch-free, with the clock passed in, so the
rules read in one place and a test drives them with a clock it moves by hand. Rank 0's clock decides
checkpoints and evaluations for the whole job; in a multi-rank run every decision goes through the
per-step agreement (``distributed.Agreement``), which makes it take effect one step later on every
rank alike, and brings back the training clock all ranks follow.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class Agreement(Protocol):
    """What the control needs of the cross-rank exchange (distributed.Agreement)."""

    def exchange(self, flags: list[bool], clock: float) -> tuple[list[bool], float] | None: ...

    def finish(self) -> None: ...


class Interval:
    """Due every `every` seconds of `clock` since the last restart (0: every time; None: never)."""

    def __init__(self, every: float | None, clock: Callable[[], float]):
        self.every, self.clock = every, clock
        self.last = clock()

    def due(self) -> bool:
        return self.every is not None and self.clock() - self.last >= self.every

    def restart(self) -> None:
        self.last = self.clock()


@dataclass(frozen=True)
class Decision:
    """What to do after a step: all False means train on."""

    stop: bool = False  # end the run after this step (a final checkpoint follows)
    checkpoint: bool = False
    evaluate: bool = False


class StepControl:
    """Decides, after each step on the drafter thread, whether to stop, checkpoint or evaluate."""

    def __init__(self, max_steps: int | None, max_time: float | None, checkpoint_every: float,
                 eval_every: float, is_main: bool = True, agreement: Agreement | None = None,
                 trained: float = 0.0, clock: Callable[[], float] = time.monotonic):
        """`trained`: seconds trained before this process (a resume); `clock`: the wall clock the
        checkpoint and evaluation intervals are measured on."""
        self.max_steps, self.max_time, self.is_main, self.agreement = max_steps, max_time, is_main, agreement
        self.checkpoints = Interval(checkpoint_every, clock)
        self.evaluations = Interval(eval_every or None, clock)  # 0: only the final evaluation
        self._agreed_clock = trained  # the training clock every rank agreed on at the last exchange

    def agreed_clock(self) -> float:
        """The training clock of a multi-rank run: what its LR schedule and max_time count."""
        return self._agreed_clock

    def after_step(self, step: int, wants_stop: bool, trained: float) -> Decision:
        """`step`: steps done; `wants_stop`: this rank asks to stop (a signal, too many bad steps);
        `trained`: this process's training clock (its own seconds trained, resumes included)."""
        # The step budget is the same number on every rank; signals and the clock are not.
        steps_done = self.max_steps is not None and step >= self.max_steps
        clock = self._agreed_clock if self.agreement is not None else trained
        wants_stop = wants_stop or (self.max_time is not None and clock >= self.max_time)
        ckpt = self.is_main and self.checkpoints.due()
        ev = self.is_main and self.evaluations.due()
        if self.agreement is not None:
            # A proposal restarts its interval at once: it takes effect a step later, and proposing it
            # again meanwhile would fire a second checkpoint (or eval) on the step after that.
            if ckpt:
                self.checkpoints.restart()
            if ev:
                self.evaluations.restart()
            # Decisions proposed after step N take effect after step N+1 on every rank alike.
            agreed = self.agreement.exchange([wants_stop, ckpt, ev], trained)
            (wants_stop, ckpt, ev), self._agreed_clock = agreed or ((False, False, False), self._agreed_clock)
        stop = steps_done or wants_stop
        if stop and self.agreement is not None:
            self.agreement.finish()  # every rank stops at this step, so the last exchange completes
        return Decision(stop=stop, checkpoint=ckpt or stop, evaluate=ev and not stop)
