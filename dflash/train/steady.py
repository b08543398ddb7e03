"""Run a few steady-state training steps under a guard: how the tests (CPU) and scripts/gpu_check.py
(CUDA) prove that a training step never waits for the device.

The guard is entered when step ``warmup`` has finished and left just before the last step's
bookkeeping (which checkpoints): between the two only the worker threads run, because the run has
no telemetry publisher, log line, evaluation or checkpoint to read the device meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from dflash.train.config import TrainConfig
from dflash.train.schema import updated
from dflash.train.stages import StepResult
from dflash.train.trainer import Trainer


def run_steady(cfg: TrainConfig, warmup: int, steps: int,
               guard: Callable[[], AbstractContextManager]) -> Trainer:
    """Train ``warmup + steps`` steps of ``cfg`` with ``guard()`` active around the last ``steps``.

    Returns the finished Trainer; a worker that raised (e.g. a CUDA sync error) makes it fail the
    usual way, with that worker's traceback.
    """
    cfg = updated(cfg, max_steps=warmup + steps, max_time=None, telemetry=False, metrics_port=None,
                  log_every=1e9, eval_every=0, eval_prompts=0, checkpoint_every=1e9)
    active: list[AbstractContextManager] = []

    class Steady(Trainer):
        def on_step(self, r: StepResult) -> bool:
            if active and self.state.step + 1 == warmup + steps:
                active.pop().__exit__(None, None, None)
            go_on = super().on_step(r)
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
