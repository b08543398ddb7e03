"""Multi-process training on torch.distributed: one pipeline replica per rank, drafters in DDP.

Launched by torchrun (or `dflash train --nproc N`, which runs torchrun). Each rank trains on its own
shard of every batch index and the drafters' gradients are averaged by DistributedDataParallel (NCCL
on CUDA, gloo on CPU). Besides the default group, a small gloo group carries the per-step control
exchange (stop / checkpoint / evaluate decisions and the training clock), so CPU tensors work whatever
the training backend, and every collective has a timeout: a rank that dies or hangs ends the job
with a message instead of blocking the others forever.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class DistError(RuntimeError):
    """Another rank failed, hung, or disagrees; the message is one line for the user."""


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1  # ranks on this machine (torchrun's LOCAL_WORLD_SIZE)
    control: Any = None  # the gloo group for control messages
    store: Any = None  # a client of the job's TCPStore (the cluster view's reports)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_env() -> Dist:
    """The rank layout torchrun put in the environment (a plain process is rank 0 of 1)."""
    values = {}
    for key, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0), ("LOCAL_WORLD_SIZE", 1)):
        raw = os.environ.get(key)
        try:
            values[key] = int(raw) if raw is not None else default
        except ValueError:
            raise DistError(f"environment variable {key}={raw!r} is not an integer") from None
    d = Dist(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"])
    if d.world_size < 1 or not 0 <= d.rank < d.world_size:
        raise DistError(f"RANK={d.rank} does not fit WORLD_SIZE={d.world_size}")
    return d


def place_devices(targets: list[str], drafter: str, d: Dist, gpus: int) -> tuple[list[str], str]:
    """This rank's target and drafter devices, from a config that names one rank's devices.

    A bare ``cuda`` means this rank's own GPU (cuda:LOCAL_RANK), so one config serves every rank. Explicit
    indices name the GPUs of one rank, counted from 0: a config that uses ``span`` GPUs (its highest
    index + 1) puts local rank r on GPUs r*span ... r*span+span-1, so ``--target-devices cuda:1
    --drafter-device cuda:0`` gives every rank a GPU for its target and one for its drafter, instead of
    piling every rank's work onto GPUs 0 and 1. ``gpus``: the GPUs on this machine."""
    if not d.enabled:
        return targets, drafter
    specs = [*targets, drafter]
    cuda = [s for s in specs if s.startswith("cuda")]
    indexed = [s for s in cuda if s != "cuda"]
    if not indexed:
        return [_bare(s, d.local_rank) for s in targets], _bare(drafter, d.local_rank)
    if len(indexed) < len(cuda):
        raise DistError(f"devices {', '.join(dict.fromkeys(cuda))} mix a bare cuda (this rank's GPU) with numbered "
                        "GPUs: under torchrun give all as cuda (one GPU per rank) or all numbered (each rank's own)")
    span = max(torch.device(s).index for s in indexed) + 1
    if d.local_world_size * span > gpus:
        raise DistError(f"the devices {', '.join(dict.fromkeys(indexed))} name {span} GPU(s) per rank: "
                        f"{d.local_world_size} ranks on this machine need {d.local_world_size * span}, it has {gpus}; "
                        "name fewer GPUs per rank or start fewer ranks (--nproc)")
    base = d.local_rank * span

    def own(s: str) -> str:
        return f"cuda:{base + torch.device(s).index}" if s.startswith("cuda") else s

    return [own(s) for s in targets], own(drafter)


def _bare(spec: str, local_rank: int) -> str:
    return f"cuda:{local_rank}" if spec == "cuda" else spec


def init(d: Dist, device: torch.device | str, timeout_s: float) -> None:
    """Join the job's process groups; ``device``: this rank's drafter device (see place_devices). On
    CUDA the calling thread binds that GPU first: NCCL sets up on the current device, and binding
    cuda:LOCAL_RANK instead would open a context on another rank's GPU when each rank has several."""
    if not d.enabled:
        return
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    for key in ("MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise DistError(f"WORLD_SIZE={d.world_size} but {key} is not set: launch with torchrun or --nproc")
    timeout = timedelta(seconds=timeout_s)
    try:
        if cuda:
            torch.cuda.set_device(dev if dev.index is not None else torch.device("cuda", d.local_rank))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        d.control = dist.new_group(backend="gloo", timeout=timeout)
        d.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                timeout=timedelta(seconds=10))
    except (RuntimeError, ValueError) as e:
        raise DistError(f"cannot join the process group: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@contextmanager
def collective(d: Dist, what: str) -> Iterator[None]:
    """A collective that fails or times out is, almost always, another rank's failure: say so."""
    try:
        yield
    except RuntimeError as e:
        raise _peer_failure(d.rank, what, _first_line(e)) from None


def _peer_failure(rank: int, what: str, detail: str) -> DistError:
    return DistError(f"rank {rank}: {what} failed - another rank died or hung "
                     f"(see its log and torchrun's summary): {detail}")


class Agreement:
    """The per-step control exchange: every rank leaves with the same decisions (any rank's `True`
    wins) and the same training clock (the slowest rank's), so they stop, checkpoint and follow the
    LR schedule in step.

    The all-reduce started after step N is read after step N+1: it runs during a whole step of
    compute instead of adding its round trip (about 1 ms between two local gloo processes, more
    across nodes) to every step. Decisions therefore take effect one step later, on all ranks alike.
    """

    def __init__(self, d: Dist) -> None:
        self.d = d
        self._work = None
        self._values: torch.Tensor | None = None

    def exchange(self, flags: list[bool], clock: float) -> tuple[list[bool], float] | None:
        """Start this step's exchange; return the previous step's agreed values (None after the first)."""
        previous = self._collect()
        self._values = torch.tensor([float(f) for f in flags] + [clock], dtype=torch.float64)
        with collective(self.d, "the per-step control exchange"):
            self._work = dist.all_reduce(self._values, op=dist.ReduceOp.MAX, group=self.d.control, async_op=True)
        return previous

    def finish(self) -> None:
        """Wait for the exchange in flight (before the ranks part ways)."""
        self._collect()

    def _collect(self) -> tuple[list[bool], float] | None:
        if self._work is None:
            return None
        with collective(self.d, "the per-step control exchange"):
            self._work.wait()
        self._work = None
        t = self._values
        return [bool(v) for v in t[:-1].tolist()], float(t[-1])


def gather(d: Dist, obj: Any) -> list[Any]:
    out: list[Any] = [None] * d.world_size
    with collective(d, "gathering state from all ranks"):
        dist.all_gather_object(out, obj, group=d.control)
    return out


def barrier(d: Dist, what: str) -> None:
    if d.enabled:
        with collective(d, what):
            dist.barrier(group=d.control)


def param_digest(module: torch.nn.Module) -> str:
    """Exact fingerprint of a module's parameters: replicas in sync have identical digests."""
    h = hashlib.sha1()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


class StepAllReduce:
    """Times a step's gradient all-reduce as one interval, from the first bucket's start to the last
    bucket's end, booked as the counter `allreduce_seconds`: mostly waiting for the slowest rank, which
    is how the cluster view finds it.

    One interval per bucket would not do: DDP reduces ~170 buckets per step for a 1B fp32 drafter (at
    25 MB), each waiting for the slowest rank, so their sum counts a 2 ms skew 170 times (and overlapping
    buckets more than once) and reads as most of the step on every rank alike.

    gloo completes a bucket's future when its reduction is done, so host time measures it. NCCL
    completes it as soon as the collective is queued, so on CUDA the interval is bracketed by two CUDA
    events instead (the end is recorded on the stream the last bucket's callback runs on, made to wait
    for that NCCL work) and the telemetry drain adds their device time once they have completed,
    without waiting for them. Hooks run on the backward's thread, callbacks on the backend's: a lock."""

    def __init__(self, stats) -> None:
        self.stats = stats
        self._lock = threading.Lock()
        self._pending = 0  # buckets started and not done in this step
        self._last_seen = False  # DDP has handed over the step's last bucket
        self._t0: float | None = None
        self._start: Any = None  # the CUDA start event

    def started(self, bucket, cuda: bool) -> None:
        """Called from the comm hook before the bucket's all-reduce is launched."""
        with self._lock:
            if self._t0 is None:
                self._t0 = time.perf_counter()
                if cuda:
                    self._start = torch.cuda.Event(enable_timing=True)
                    self._start.record()
            self._pending += 1
            self._last_seen = self._last_seen or bucket.is_last()

    def done(self) -> None:
        """Called when a bucket's all-reduce has completed; books the step's interval after the last."""
        with self._lock:
            self._pending -= 1
            if not self._last_seen or self._pending > 0:
                return
            t0, start = self._t0, self._start
            self._t0, self._start, self._last_seen = None, None, False
        if start is None:
            self.stats.count("allreduce_seconds", time.perf_counter() - t0)
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats.count_device("allreduce_seconds", start, end)


def wrap_ddp(module: torch.nn.Module, device: torch.device, stats, bucket_mb: float = 25.0) -> torch.nn.Module:
    """DDP around the drafter, with a comm hook that times each step's all-reduce (StepAllReduce)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # The drafter's buffers (RoPE frequencies) are the same constants on every rank: syncing them at
    # each forward would only add a collective per step (and one more place to time out).
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False})
    ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb,
              **no_buffer_sync)
    ddp.config = module.config  # the objective reads block size and mask token from the module it runs
    # DDP's logger times iterations 1-10 and then every 100th with CUDA events that it reads back, a
    # host sync in the step (which set_sync_debug_mode does not see): after the warm-up, never.
    ddp._set_ddp_runtime_logging_sample_rate(2**31 - 1)
    world = dist.get_world_size()
    timer = StepAllReduce(stats)

    def timed_allreduce(state, bucket):
        buf = bucket.buffer().div_(world)
        timer.started(bucket, buf.is_cuda)
        fut = dist.all_reduce(buf, async_op=True).get_future()

        def done(f):
            timer.done()
            try:
                return f.value()[0]
            except Exception as e:
                # Autograd re-raises this as a generic RuntimeError; remembering it here lets the
                # drafter stage say "another rank failed" instead of printing a backward traceback.
                ddp.comm_error = _first_line(e)
                raise

        return fut.then(done)

    ddp.register_comm_hook(None, timed_allreduce)
    return ddp


def explain_backward_error(module: torch.nn.Module, e: BaseException, rank: int) -> BaseException:
    """A backward that failed because the gradient all-reduce failed is another rank's failure."""
    comm = getattr(module, "comm_error", None)
    if comm is None:
        return e
    return _peer_failure(rank, "the gradient all-reduce", comm)


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError:
            pass  # a peer already gone: nothing left to tidy
