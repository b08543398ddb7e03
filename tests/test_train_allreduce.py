"""The gradient all-reduce is timed once per step, however many buckets DDP splits it into: a real DDP
over a real gloo process group (one rank, in this process) around a model of many small buckets."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from dflash.train.distributed import wrap_ddp


class Booked:
    """The two calls the timer books through (ProfileStats.count / count_device), recorded per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.lock = threading.Lock()

    def count(self, name: str, value: float) -> None:
        with self.lock:
            self.calls.append((name, value))

    def count_device(self, name: str, start, end) -> None:  # CUDA only; never reached on the CPU
        raise AssertionError("a CPU all-reduce must be timed on the host")


class Layers(torch.nn.Module):
    def __init__(self, n: int, width: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))
        self.config = None  # wrap_ddp copies the module's config onto the wrapper

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.fixture
def one_rank():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_interval_per_step_spanning_every_bucket(one_rank) -> None:
    torch.manual_seed(0)
    model = Layers(12, 64)  # 12 x 16.6 KB of parameters: a bucket each at 0.01 MB
    booked = Booked()
    ddp = wrap_ddp(model, torch.device("cpu"), booked, bucket_mb=0.01)
    x = torch.randn(8, 64)
    backward_s = []
    for _ in range(4):
        loss = ddp(x).square().mean()
        t0 = time.perf_counter()
        loss.backward()
        backward_s.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
    assert buckets >= 6, f"only {buckets} buckets: the test needs many"
    names = [name for name, _ in booked.calls]
    assert names == ["allreduce_seconds"] * 4, f"{len(names)} intervals booked for 4 steps"
    # each interval lies inside its step's backward (the buckets are reduced while it runs)
    for (_, seconds), wall in zip(booked.calls, backward_s, strict=True):
        assert 0 < seconds <= wall
