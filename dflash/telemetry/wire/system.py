"""Process, per-thread and GPU sampling of one process (psutil + NVML via nvidia-ml-py).

Both sides use it, so it is part of the wire: the trainer's publisher samples its own process, and
dflash-top's sampled source (`dflash-top --pid`) samples a process it does not own. Every query degrades
instead of raising: a field NVML cannot read is None, and a machine without a driver reports `gpus=[]`
with the reason in `gpu_error`. In the trainer the sampler runs in the publisher thread, never in a worker.

NVML numbers GPUs in PCI bus order; CUDA numbers the devices a process may see, after
``CUDA_VISIBLE_DEVICES`` (indices, ``GPU-``/``MIG-`` UUIDs or unique UUID prefixes) and in its own
order. Each sample therefore carries the GPU's UUID and its CUDA ordinal in the trainer
(``cuda_index``), matched by UUID: from torch when the trainer has already initialised CUDA, else from
``CUDA_VISIBLE_DEVICES`` (an index there is taken as an NVML index: exact with
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical GPUs, CUDA's fastest-first order otherwise).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import psutil

from dflash.telemetry.wire.protocol import GpuSample, MachineSample, MigSample, SystemSample, ThreadSample

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


def _uuid(u: Any) -> str | None:
    """NVML/CUDA UUID in one spelling: lower case, no ``GPU-``/``MIG-`` prefix."""
    if u is None:
        return None
    u = (u.decode(errors="replace") if isinstance(u, bytes) else str(u)).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if u.startswith(prefix):
            return u[len(prefix):]
    return u


def cuda_ordinals(gpus: list[tuple[str | None, bool]], visible: str | None,
                  cuda_uuids: list[str] | None = None) -> dict[int, int]:
    """CUDA ordinal of each device, as {position in ``gpus``: ordinal}.

    ``gpus``: (uuid, is_mig) of every device NVML lists, GPUs in NVML index order. ``cuda_uuids``: the
    UUIDs of the trainer's CUDA devices by ordinal (from torch); when known they decide alone.
    Otherwise ``visible`` (``CUDA_VISIBLE_DEVICES``) is read as CUDA reads it: entries in order, an
    index names the NVML GPU of that index, a ``GPU-``/``MIG-`` entry the device whose UUID starts with
    it, and the first entry that names nothing (or a device again) ends the list. Unset: every GPU
    (not MIG instance), ordinal = NVML index.
    """
    norm = [_uuid(u) for u, _ in gpus]
    if cuda_uuids is not None:
        wanted = [_uuid(u) for u in cuda_uuids]
        return {pos: wanted.index(u) for pos, u in enumerate(norm) if u is not None and u in wanted}
    physical = [pos for pos, (_, mig) in enumerate(gpus) if not mig]
    if visible is None:
        return {pos: i for i, pos in enumerate(physical)}
    out: dict[int, int] = {}
    for entry in visible.split(","):
        entry = entry.strip()
        low = entry.lower()
        if entry.isdigit():
            pos = physical[int(entry)] if int(entry) < len(physical) else None
        elif low.startswith(("gpu-", "mig-")) and len(low) > 4:
            mig, key = low.startswith("mig-"), _uuid(low)
            hits = [p for p, u in enumerate(norm) if u and gpus[p][1] == mig and u.startswith(key)]
            pos = hits[0] if len(hits) == 1 else None
        else:
            pos = None
        if pos is None or pos in out:
            break
        out[pos] = len(out)
    return out


def _torch_cuda_uuids() -> list[str] | None:
    """UUIDs of the trainer's CUDA devices, only if torch is loaded and has initialised CUDA already
    (never imports torch, never creates a context)."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    except Exception:
        return None


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
        self._gpm: dict[int, Any] = {}  # NVML index -> last GPM sample (metrics need two)
        self._util_seen: dict[int, int] = {}  # NVML index -> newest per-process utilisation sample read (us)
        self._proc.cpu_percent(None)  # primes psutil's delta
        self._last_t = time.monotonic()
        self._last_cpu = self._thread_times()
        self._last_machine = _machine_times()
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
        return SystemSample(cpu_percent=cpu, rss_bytes=rss, threads=threads, gpus=gpus, gpu_error=err,
                            machine=self._machine(wall, cpu))

    def _machine(self, wall: float, own_percent: float) -> MachineSample | None:
        """The machine's CPU over the same window as the process' (differences of the kernel's counters),
        so "other processes" is the machine's busy time minus ours, not two clocks compared."""
        now = _machine_times()
        last, self._last_machine = self._last_machine, now
        if now is None or last is None:
            return None
        busy = max(0.0, (now[0] - last[0]) / wall * 100.0)
        steal = None if now[1] is None or last[1] is None else max(0.0, (now[1] - last[1]) / wall * 100.0)
        try:
            load1 = os.getloadavg()[0]
        except OSError:
            load1 = 0.0
        return MachineSample(cores=psutil.cpu_count() or 1, load1=round(load1, 2), busy_percent=round(busy, 1),
                             others_percent=round(max(0.0, busy - own_percent), 1),
                             steal_percent=None if steal is None else round(steal, 1))

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
        gpus: list[GpuSample] = []
        handles: list[tuple[GpuSample | MigSample, Any]] = []  # every device, for the CUDA mapping
        for i in range(count):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
            except Exception:
                continue
            util = _na(lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).gpu)
            mem = _na(lambda h=h: nv.nvmlDeviceGetMemoryInfo(h))
            power_mw = _na(lambda h=h: nv.nvmlDeviceGetPowerUsage(h))
            sm_active, tensor_active = self._gpm_metrics(nv, i, h)
            g = GpuSample(
                index=i,
                name=_name(nv, h) or f"GPU {i}",
                util_percent=float(util) if util is not None else None,
                mem_used=int(mem.used) if mem is not None else None,
                mem_total=int(mem.total) if mem is not None else None,
                power_w=power_mw / 1000.0 if power_mw is not None else None,
                temp_c=_float(_na(lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
                sm_clock_mhz=_float(_na(lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))),
                process_mem=self._process_mem(nv, h),
                process_util=self._process_util(nv, i, h),
                uuid=_text(_na(lambda h=h: nv.nvmlDeviceGetUUID(h))),
                sm_active=sm_active,
                tensor_active=tensor_active,
                mig=self._mig_instances(nv, h),
            )
            gpus.append(g)
            handles.append((g, h))
            handles.extend((m, None) for m in g.mig)
        ordinals = cuda_ordinals([(d.uuid, isinstance(d, MigSample)) for d, _ in handles],
                                 os.environ.get("CUDA_VISIBLE_DEVICES"), _torch_cuda_uuids())
        for pos, ordinal in ordinals.items():
            handles[pos][0].cuda_index = ordinal
        return gpus, None

    def _mig_instances(self, nv: Any, handle: Any) -> list[MigSample]:
        """The GPU's MIG instances, or [] when MIG is off or unsupported."""
        mode = _na(lambda: nv.nvmlDeviceGetMigMode(handle))
        if not mode or mode[0] != getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1):
            return []
        out = []
        for k in range(_na(lambda: nv.nvmlDeviceGetMaxMigDeviceCount(handle)) or 0):
            m = _na(lambda k=k: nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, k))
            if m is None:  # empty slot
                continue
            mem = _na(lambda m=m: nv.nvmlDeviceGetMemoryInfo(m))
            out.append(MigSample(index=k, name=_name(nv, m) or f"MIG {k}",
                                 uuid=_text(_na(lambda m=m: nv.nvmlDeviceGetUUID(m))),
                                 mem_used=int(mem.used) if mem is not None else None,
                                 mem_total=int(mem.total) if mem is not None else None))
        return out

    def _gpm_metrics(self, nv: Any, index: int, handle: Any) -> tuple[float | None, float | None]:
        """SM-active and tensor-active percent between this sample and the last, from NVML GPM
        (GPU performance monitoring: Hopper and later). None on GPUs/drivers without it, and on the
        first sample (a GPM metric needs two)."""
        if index not in self._gpm:
            ok = _na(lambda: nv.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
            self._gpm[index] = None if not ok else False  # False: supported, no sample yet
        prev = self._gpm[index]
        if prev is None:
            return None, None
        cur = _na(nv.nvmlGpmSampleAlloc)
        if cur is None or _na(lambda: nv.nvmlGpmSampleGet(handle, cur)) is None:
            if cur is not None:
                _na(lambda: nv.nvmlGpmSampleFree(cur))
            self._gpm[index] = None
            return None, None
        self._gpm[index] = cur
        if prev is False:
            return None, None
        try:
            req = nv.c_nvmlGpmMetricsGet_t()
            req.version, req.numMetrics, req.sample1, req.sample2 = nv.NVML_GPM_METRICS_GET_VERSION, 2, prev, cur
            req.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
            req.metrics[1].metricId = nv.NVML_GPM_METRIC_ANY_TENSOR_UTIL
            nv.nvmlGpmMetricsGet(req)
            return tuple(float(m.value) if m.nvmlReturn == 0 else None for m in req.metrics[:2])
        except Exception:
            return None, None
        finally:
            _na(lambda: nv.nvmlGpmSampleFree(prev))

    def _process_mem(self, nv: Any, handle: Any) -> int | None:
        """This process's memory on one GPU; None when NVML does not list our pid (not using that
        GPU, or a container whose pid namespace differs from the driver's)."""
        procs = _na(lambda: nv.nvmlDeviceGetComputeRunningProcesses(handle)) or []
        used = [p.usedGpuMemory for p in procs if p.pid == self._pid and p.usedGpuMemory is not None]
        return int(sum(used)) if used else None

    def _process_util(self, nv: Any, index: int, handle: Any) -> float | None:
        """Percent of the time this process had a kernel running on one GPU since the last sample (the
        mean of NVML's per-process samples); None when NVML keeps none for it or cannot say."""
        since = self._util_seen.get(index, 0)
        samples = _na(lambda: nv.nvmlDeviceGetProcessUtilization(handle, since))
        if samples is None:
            return None
        ours = [s for s in samples if s.pid == self._pid]
        if samples:
            self._util_seen[index] = max(int(s.timeStamp) for s in samples)
        return sum(float(s.smUtil) for s in ours) / len(ours) if ours else None

    def close(self) -> None:
        if self._nvml:
            for sample in self._gpm.values():
                if sample is not None and sample is not False:  # (a ctypes sample handle is falsy)
                    _na(lambda sample=sample: self._nvml.nvmlGpmSampleFree(sample))
            self._gpm.clear()
            _na(self._nvml.nvmlShutdown)
            self._nvml = None


def _machine_times() -> tuple[float, float | None] | None:
    """(CPU seconds all processes used, seconds stolen by the hypervisor) since boot, over every core."""
    try:
        t = psutil.cpu_times()
    except (psutil.Error, OSError):
        return None
    # user includes guest time on Linux; idle and iowait are not busy; steal is the hypervisor's
    busy = t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return busy, getattr(t, "steal", None)


def _float(v: Any) -> float | None:
    return float(v) if v is not None else None


def _text(v: Any) -> str | None:
    """NVML strings: older bindings return bytes."""
    return v.decode(errors="replace") if isinstance(v, bytes) else (str(v) if v is not None else None)


def _name(nv: Any, handle: Any) -> str | None:
    return _text(_na(lambda: nv.nvmlDeviceGetName(handle)))
