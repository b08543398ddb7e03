"""Which device each worker thread works on, and binding it there.

CUDA's "current device" is per thread and a new thread starts on device 0: a worker that does not
bind its device launches its kernels, records its timing events and pins its memory against GPU 0
whatever its tensors say (and, under torchrun, rank r >= 1 opens a second context on GPU 0). So every
worker calls ``bind_thread`` first.
"""

from __future__ import annotations

import torch


def resolve(spec: str) -> torch.device:
    """A device with its index: a bare ``cuda`` means the current CUDA device (torchrun ranks map it to
    their own GPU before this, see distributed.localize)."""
    dev = torch.device(spec)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def thread_device(*devices: torch.device) -> torch.device | None:
    """The device a thread that touches ``devices`` binds to: the first CUDA one (a CPU target feeding
    a CUDA drafter still copies to that GPU), or None when all are on the host."""
    return next((d for d in devices if d.type == "cuda"), None)


def bind_thread(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for None: a host-only thread
    must not initialise CUDA)."""
    if device is not None:
        torch.cuda.set_device(device)
