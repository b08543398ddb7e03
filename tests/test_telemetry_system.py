"""SystemSampler: real psutil readings of this process; NVML without a driver; NVML handling code
driven by a simulated device (no driver can exist on this machine)."""

from __future__ import annotations

import threading
import time
import types

import pynvml
import pytest

from dflash.telemetry import protocol as P
from dflash.telemetry.system import SystemSampler


def _spin(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        x += 1


def test_process_and_named_thread_cpu() -> None:
    sampler = SystemSampler(nvml=False)
    stop = threading.Event()
    t = threading.Thread(target=_spin, args=(stop,), name="drafter-0")
    t.start()
    try:
        time.sleep(0.4)
        sample = sampler.sample({t.native_id: t.name, threading.main_thread().native_id: "MainThread"})
    finally:
        stop.set()
        t.join()
    names = {th.tid: th.name for th in sample.threads}
    assert names[t.native_id] == "drafter-0"
    spin = next(th for th in sample.threads if th.tid == t.native_id)
    # the spinning thread competes with other load on a 2-core box, but it is clearly busy
    assert spin.cpu_percent > 10
    assert sample.threads[0].cpu_percent >= sample.threads[-1].cpu_percent  # busiest first
    assert sample.rss_bytes > 10 * 1024 * 1024
    assert sample.cpu_percent > 5
    assert sample.gpus == [] and sample.gpu_error == "GPU sampling disabled"
    # idle next interval: the spinner has exited, the main thread slept
    time.sleep(0.1)
    again = sampler.sample({})
    assert all(th.tid != t.native_id for th in again.threads)


def test_unnamed_threads_get_the_kernel_name() -> None:
    sampler = SystemSampler(nvml=False)
    sample = sampler.sample({})
    main = next(th for th in sample.threads if th.tid == threading.main_thread().native_id)
    assert main.name and not main.name.startswith("tid-")  # /proc comm, e.g. "python"


def test_no_driver_reports_reason_without_raising() -> None:
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver")
    except pynvml.NVMLError:
        pass
    sampler = SystemSampler()
    sample = sampler.sample({})
    assert sample.gpus == []
    assert sample.gpu_error and "NVML" in sample.gpu_error
    # and the frame carrying it round-trips
    snap = P.decode(P.encode(P.Snapshot(seq=1, t=0.0, interval_s=1.0, system=sample)))
    assert snap.system.gpu_error == sample.gpu_error
    sampler.close()


class _FakeNvml:
    """Just enough of NVML's behaviour to drive the sampler: two GPUs, the second one without power
    or clock readings (as on some boards), and our pid using memory on GPU 0."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.inited = False

    def nvmlInit(self) -> None:
        self.inited = True

    def nvmlShutdown(self) -> None:
        self.inited = False

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str | bytes:
        return "NVIDIA H100 80GB HBM3" if h == 0 else b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> object:
        return types.SimpleNamespace(gpu=87 if h == 0 else 3, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> object:
        return types.SimpleNamespace(used=(h + 1) * 2**30, total=80 * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if h == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 412_345

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 61

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        if h == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 1980

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list:
        if h == 0:
            return [
                types.SimpleNamespace(pid=self.pid, usedGpuMemory=3 * 2**30),
                types.SimpleNamespace(pid=1, usedGpuMemory=2**30),
            ]
        return []


def test_simulated_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    fake = _FakeNvml(os.getpid())
    for name in dir(fake):
        if name.startswith("nvml") or name.startswith("NVML_"):
            monkeypatch.setattr(pynvml, name, getattr(fake, name))
    sampler = SystemSampler()
    sample = sampler.sample({})
    assert sample.gpu_error is None
    g0, g1 = sample.gpus
    assert (g0.index, g0.name, g0.util_percent, g0.power_w, g0.temp_c, g0.sm_clock_mhz) == (
        0,
        "NVIDIA H100 80GB HBM3",
        87.0,
        412.345,
        61.0,
        1980.0,
    )
    assert (g0.mem_used, g0.mem_total, g0.process_mem) == (2**30, 80 * 2**30, 3 * 2**30)
    assert g1.name == "NVIDIA H100 80GB HBM3"  # bytes decoded
    assert g1.power_w is None and g1.sm_clock_mhz is None and g1.process_mem is None
    assert g1.util_percent == 3.0
    wire = P.decode(P.encode(P.Snapshot(seq=1, t=0.0, interval_s=1.0, system=sample)))
    assert wire.system.gpus[1].power_w is None
    sampler.close()
    assert not fake.inited


def test_device_count_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)

    def boom() -> int:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", boom)
    sample = SystemSampler().sample({})
    assert sample.gpus == [] and sample.gpu_error.startswith("NVML:")
