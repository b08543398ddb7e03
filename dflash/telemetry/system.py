"""Process, per-thread and GPU sampling for the publisher (psutil + NVML via nvidia-ml-py).

Every query degrades instead of raising (the nvitop habit): a field NVML cannot read is None, and a
machine without a driver reports `gpus=[]` with the reason in `gpu_error`. The sampler runs in the
publisher thread, never in a worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import psutil

from dflash.telemetry.protocol import GpuSample, SystemSample, ThreadSample

T = TypeVar("T")


def _na(fn: Callable[[], T]) -> T | None:
    """One NVML query, None when the device or driver does not support it."""
    try:
        return fn()
    except Exception:
        return None


def _nvml_reason(exc: BaseException) -> str:
    name = type(exc).__name__
    if "LibraryNotFound" in name:
        return "NVML library not found (no NVIDIA driver on this machine)"
    if "DriverNotLoaded" in name:
        return "NVIDIA driver not loaded"
    if isinstance(exc, ImportError):
        return "nvidia-ml-py (pynvml) is not installed"
    return f"NVML unavailable: {exc}"


class SystemSampler:
    """Samples CPU%, RSS and per-thread CPU% of one process, plus every NVIDIA GPU on the machine.

    Per-thread CPU% comes from differences of each thread's user+system time between calls, so the
    first call after construction already covers the time since construction.
    """

    def __init__(self, pid: int | None = None, *, nvml: bool = True, max_threads: int = 64) -> None:
        self._proc = psutil.Process(pid)
        self._pid = self._proc.pid
        self._max_threads = max_threads
        self._use_nvml = nvml
        self._nvml: Any = None  # None: not tried yet; False: failed (reason in _gpu_error)
        self._gpu_error: str | None = None if nvml else "GPU sampling disabled"
        self._comm: dict[int, str] = {}
        self._proc.cpu_percent(None)  # primes psutil's delta
        self._last_t = time.monotonic()
        self._last_cpu = self._thread_times()
        # NVML's first init loads the driver library (tens of ms): pay it at start-up, not in the
        # middle of training
        self._init_nvml()

    def _thread_times(self) -> dict[int, float]:
        try:
            return {t.id: t.user_time + t.system_time for t in self._proc.threads()}
        except (psutil.Error, OSError):
            return {}

    def _native_name(self, tid: int) -> str:
        """The kernel's name for a thread Python does not know (torch/CUDA/NCCL threads)."""
        name = self._comm.get(tid)
        if name is None:
            try:
                with open(f"/proc/{self._pid}/task/{tid}/comm") as f:
                    name = f.read().strip() or f"tid-{tid}"
            except OSError:
                name = f"tid-{tid}"
            self._comm[tid] = name
        return name

    def sample(self, thread_names: Mapping[int, str] | None = None) -> SystemSample:
        """One sample; `thread_names` maps native thread ids to Python thread names."""
        names = thread_names or {}
        now = time.monotonic()
        wall = max(now - self._last_t, 1e-9)
        cpu_now = self._thread_times()
        threads = []
        for tid, cpu in cpu_now.items():
            pct = max(0.0, (cpu - self._last_cpu.get(tid, 0.0)) / wall * 100.0)
            threads.append(ThreadSample(tid=tid, name=names.get(tid) or self._native_name(tid), cpu_percent=pct))
        # Forget names of threads that exited, so a recycled tid gets its new name.
        for tid in set(self._comm) - set(cpu_now):
            del self._comm[tid]
        self._last_cpu, self._last_t = cpu_now, now
        # Python-named threads always; the busiest native threads fill the rest of the budget.
        threads.sort(key=lambda t: t.cpu_percent, reverse=True)
        named = [t for t in threads if t.tid in names]
        others = [t for t in threads if t.tid not in names][: max(0, self._max_threads - len(named))]
        threads = sorted(named + others, key=lambda t: t.cpu_percent, reverse=True)

        try:
            cpu = self._proc.cpu_percent(None)
            rss = self._proc.memory_info().rss
        except (psutil.Error, OSError):
            cpu, rss = 0.0, 0
        gpus, err = self._gpus()
        return SystemSample(cpu_percent=cpu, rss_bytes=rss, threads=threads, gpus=gpus, gpu_error=err)

    def _init_nvml(self) -> Any:
        if self._nvml is None:
            if not self._use_nvml:
                self._nvml = False
                return False
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            except Exception as e:  # no driver, no library, container without the device: all fine
                self._nvml = False
                self._gpu_error = _nvml_reason(e)
        return self._nvml

    def _gpus(self) -> tuple[list[GpuSample], str | None]:
        nv = self._init_nvml()
        if not nv:
            return [], self._gpu_error
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as e:
            return [], f"NVML: {e}"
        gpus = []
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
            except Exception:
                continue
            name = _na(lambda h=h: nv.nvmlDeviceGetName(h))
            if isinstance(name, bytes):  # older bindings return bytes
                name = name.decode(errors="replace")
            util = _na(lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).gpu)
            mem = _na(lambda h=h: nv.nvmlDeviceGetMemoryInfo(h))
            power_mw = _na(lambda h=h: nv.nvmlDeviceGetPowerUsage(h))
            gpus.append(
                GpuSample(
                    index=i,
                    name=name or f"GPU {i}",
                    util_percent=float(util) if util is not None else None,
                    mem_used=int(mem.used) if mem is not None else None,
                    mem_total=int(mem.total) if mem is not None else None,
                    power_w=power_mw / 1000.0 if power_mw is not None else None,
                    temp_c=_float(_na(lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
                    sm_clock_mhz=_float(_na(lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
                    process_mem=self._process_mem(nv, h),
                )
            )
        return gpus, None

    def _process_mem(self, nv: Any, handle: Any) -> int | None:
        """This process's memory on one GPU; None when NVML does not list our pid (not using that
        GPU, or a container whose pid namespace differs from the driver's)."""
        procs = _na(lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        used = [p.usedGpuMemory for p in procs if p.pid == self._pid and p.usedGpuMemory is not None]
        return int(sum(used)) if used else None

    def close(self) -> None:
        if self._nvml:
            _na(self._nvml.nvmlShutdown)
            self._nvml = None


def _float(v: Any) -> float | None:
    return float(v) if v is not None else None
