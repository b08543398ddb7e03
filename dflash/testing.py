"""Run a few steady-state training steps under a guard: how the tests (CPU) and scripts/gpu_check.py
(CUDA) prove that a training step never waits for the device.

The guard is entered when step ``warmup`` has finished and left just before the last step's
bookkeeping (which checkpoints): between the two only the worker threads run, because the run has
no log line, evaluation or checkpoint to read the device meanwhile, and no telemetry publisher
unless asked for (scripts/gpu_check.py's host_gap check keeps it, as a real run does).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from dflash.train.config import TrainConfig
from dflash.train.config.schema import updated
from dflash.train.run.stages import StepResult
from dflash.train.trainer import Trainer


def run_steady(cfg: TrainConfig, warmup: int, steps: int, guard: Callable[[], AbstractContextManager],
               telemetry: bool = False, join_ranks: Callable[[Trainer], None] | None = None,
               after_step: Callable[[Trainer, int], None] | None = None) -> Trainer:
    """Train ``warmup + steps`` steps of ``cfg`` with ``guard()`` active around the last ``steps``.

    ``telemetry``: keep the publisher running (it resolves CUDA events meanwhile); ``join_ranks``:
    replaces Trainer.join_ranks (a one-rank DDP world); ``after_step(trainer, step)``: called on the
    drafter thread after each step. Returns the finished Trainer; a worker that raised (e.g. a CUDA
    sync error) makes it fail the usual way, with that worker's traceback.
    """
    cfg = updated(cfg, max_steps=warmup + steps, max_time=None, telemetry=telemetry, metrics_port=None,
                  log_every=1e9, eval_every=0, eval_prompts=0, checkpoint_every=1e9)
    active: list[AbstractContextManager] = []

    class Steady(Trainer):
        def join_ranks(self) -> None:
            if join_ranks is None:
                super().join_ranks()
            else:
                join_ranks(self)

        def on_step(self, r: StepResult) -> bool:
            if active and self.state.step + 1 == warmup + steps:
                active.pop().__exit__(None, None, None)
            go_on = super().on_step(r)
            if after_step is not None:
                after_step(self, self.state.step)
            if self.state.step == warmup:
                ctx = guard()
                ctx.__enter__()
                active.append(ctx)
            return go_on

    trainer = Steady(cfg, log=lambda s: None)
    try:
        code = trainer.run()
    finally:
        while active:
            active.pop().__exit__(None, None, None)
    if code != 0:
        name, tb = trainer.pipeline.failure or ("?", "")
        raise RuntimeError(f"steady-state run failed in {name}:\n{tb}")
    return trainer


@contextmanager
def cuda_sync_errors() -> Iterator[None]:
    """Every synchronising CUDA call raises while active (torch.cuda.set_sync_debug_mode("error"))."""
    import torch

    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)
