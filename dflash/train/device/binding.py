"""Which device each thread works on, binding it there, and the stream it launches on.

CUDA's "current device" is per thread and a new thread starts on device 0: a thread that does not
bind its device launches its kernels, records its timing events and pins its memory against GPU 0
whatever its tensors say (and, under torchrun, rank r >= 1 opens a second context of ~0.5 GiB on
GPU 0). So every thread that touches CUDA calls ``bind_thread`` first: the pipeline's workers, and
the trainer's helpers (the telemetry publisher, which resolves CUDA events; the main thread, which
evaluates and checkpoints; any background writer).

The current *stream* is per thread and per device too, and every thread starts on the device's
default stream: two workers on one GPU would queue their kernels behind each other in one queue, so
each stage's CUDA-event span would also time the other's kernels and the two could never overlap. A
worker that launches compute therefore gets a stream of its own (``own_streams``); the hand-over
between workers is already explicit (the copy's event, ``record_stream``), so nothing else changes.
"""

from __future__ import annotations

import threading

import torch

# thread name -> the device it bound ("cpu" for a host-only thread): what the thread_device check in
# scripts/gpu_check.py reports, and what the tests read (one entry per thread name, the latest wins)
_bound: dict[str, str] = {}
_bound_lock = threading.Lock()


def resolve(spec: str) -> torch.device:
    """A device with its index: a bare ``cuda`` means the current CUDA device (torchrun ranks map it to
    their own GPU before this, see distributed.place_devices)."""
    dev = torch.device(spec)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def cuda_ordinal(device: torch.device) -> int | None:
    """A device's CUDA ordinal (``cuda:N`` -> N), None on the host: what a worker registers with its
    telemetry, so the verdict knows whose GPU a stage's kernels run on."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def thread_device(*devices: torch.device) -> torch.device | None:
    """The device a thread that touches ``devices`` binds to: the first CUDA one (a CPU target feeding
    a CUDA drafter still copies to that GPU), or None when all are on the host."""
    return next((d for d in devices if d.type == "cuda"), None)


def cuda_devices(*devices: torch.device) -> list[torch.device]:
    """The distinct CUDA devices among ``devices``, in order: where a compute worker needs a stream."""
    out: list[torch.device] = []
    for d in devices:
        if d.type == "cuda" and d not in out:
            out.append(d)
    return out


def bind_thread(device: torch.device | None, own_streams: list[torch.device] | tuple = ()) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for None: a host-only thread
    must not initialise CUDA), and give the thread a fresh current stream on each of ``own_streams``."""
    if device is not None:
        torch.cuda.set_device(device)
    for dev in own_streams:
        torch.cuda.set_stream(torch.cuda.Stream(device=dev))
    with _bound_lock:
        _bound[threading.current_thread().name] = str(device) if device is not None else "cpu"


def bindings() -> dict[str, str]:
    """Every thread that bound itself so far, by name, with its device ("cpu": host-only)."""
    with _bound_lock:
        return dict(_bound)
