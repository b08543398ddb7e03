"""The non-finite guard: an optimizer step whose loss or gradient norm is NaN/inf is skipped, counted
and reported; too many in a row stop the run with the last good state checkpointed.

Why it is shaped like this: the trainer must not synchronise with the GPU in a step, so on CUDA the
decision never reaches the host. The fused AdamW kernel takes a `found_inf` tensor (the hook AMP's
grad scaler uses) and, when it is 1, leaves parameters, both moments and the step count untouched, all
on the device; dflash's Muon (dflash/objectives/optim.py) honours the same tensor. A plain "zero the
gradients" would not do: AdamW would still decay the moments and apply weight decay. The counters
(skipped steps, the current run of them, the last bad step and
batch) are device tensors too, updated with `torch.where`, and read on the host once per log interval
(`read`). Where the optimizer is not fused (the CPU default), the check is a host branch: on the CPU
reading a tensor is not a device synchronisation, and then every bad step is reported at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash.objectives.optim import skips_on_device
from dflash.train.control import Interval

#: non-finite steps in a row that stop the run (a transient spike skips one or two)
DEFAULT_LIMIT = 3


@dataclass
class GuardReading:
    """The guard's counters as of one read."""

    skipped: int  # steps skipped since the start of this process
    new: int  # of which since the previous read
    in_a_row: int  # the current run of consecutive skipped steps (0: the last step was good)
    last_batch: int  # batch index of the latest skipped step (-1: none yet); it was step last_batch + 1

    @property
    def last_step(self) -> int:
        """The step number the log shows for that step (steps count from 1, batches from 0)."""
        return self.last_batch + 1


class NonFiniteGuard:
    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, limit: int = DEFAULT_LIMIT) -> None:
        self.optimizer, self.limit = optimizer, limit
        # on the device when the optimizer can take the decision there (fused AdamW on CUDA and the CPU,
        # and dflash's Muon: dflash/objectives/optim.py)
        self.on_device = skips_on_device(optimizer)
        if self.on_device:
            z = torch.zeros((), dtype=torch.long, device=device)
            self._skipped, self._run, self._last_batch = z.clone(), z.clone(), z - 1
        else:
            self._skipped = self._run = 0
            self._last_batch = -1
        self._read_skipped = 0

    def step(self, loss: torch.Tensor, grad_norm: torch.Tensor, batch: int) -> None:
        """`optimizer.step()` unless the loss or the (pre-clip) gradient norm is not finite."""
        ok = torch.isfinite(loss.detach()) & torch.isfinite(grad_norm)
        if self.on_device:
            bad = ~ok
            self.optimizer.found_inf = bad.float()  # type: ignore[attr-defined]  # read by the fused kernel
            self.optimizer.step()
            self._skipped += bad
            self._run = torch.where(ok, 0, self._run + 1)
            self._last_batch = torch.where(ok, self._last_batch, batch)
        elif bool(ok):  # a host tensor: no device synchronisation
            self.optimizer.step()
            self._run = 0
        else:
            self._skipped += 1
            self._run += 1
            self._last_batch = batch

    def read(self) -> GuardReading:
        """The counters on the host: one small copy on CUDA, so call it once per log interval."""
        if self.on_device:
            skipped, run, last_batch = torch.stack([self._skipped, self._run, self._last_batch]).tolist()
        else:
            skipped, run, last_batch = self._skipped, self._run, self._last_batch
        new, self._read_skipped = skipped - self._read_skipped, skipped
        return GuardReading(skipped=skipped, new=new, in_a_row=run, last_batch=last_batch)

    @property
    def reads_free(self) -> bool:
        """Whether `read` costs nothing (host counters), so the trainer may read after every step."""
        return not self.on_device or self._skipped.device.type == "cpu"


class NonFiniteWatch:
    """The drafter thread's look at the guard after a step: skipped steps become events, and too many
    in a row end the run. On CUDA the counters live on the device, so they are read once per `every`
    seconds there (after every step on the CPU, where a read costs nothing)."""

    def __init__(self, guard: NonFiniteGuard, stats: Any, event: Callable[..., None], every: Interval):
        """`every`: when a read is due where it costs a synchronisation (the log interval)."""
        self.guard, self.stats, self.event, self.every = guard, stats, event, every
        self.stop_line: str | None = None  # what the run ends with, once the limit is reached

    def too_many(self) -> bool:
        """Report what is new; True when the limit of bad steps in a row is reached."""
        g = self.guard
        if not (g.reads_free or self.every.due()):
            return False
        self.every.restart()
        r = g.read()
        if r.new:
            self.stats.gauge("nonfinite_skipped", r.skipped)
            more = f" ({r.new} since the last report)" if r.new > 1 else ""
            self.event("nonfinite", f"non-finite loss or gradient norm at step {r.last_step} (batch "
                       f"{r.last_batch}): optimizer step skipped{more}, {r.skipped} skipped in all",
                       step=r.last_step, batch=r.last_batch, skipped=r.skipped, in_a_row=r.in_a_row)
        if r.in_a_row < g.limit or self.stop_line is not None:
            return False
        first = r.last_batch - r.in_a_row + 1
        self.stop_line = (f"{r.in_a_row} non-finite steps in a row (steps {first + 1}-{r.last_step}, "
                          f"batches {first}-{r.last_batch}), limit {g.limit}: stopping; the checkpoint "
                          f"holds the last good state (step {first})")
        return True
