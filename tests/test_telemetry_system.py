"""SystemSampler: real psutil readings of this process; NVML without a driver; NVML handling code
driven by a simulated device (no driver can exist on this machine)."""

from __future__ import annotations

import threading
import time
import types

import pynvml
import pytest

from dflash.telemetry.wire import protocol as P
from dflash.telemetry.wire.system import SystemSampler


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

    def nvmlDeviceGetProcessUtilization(self, h: int, since: int) -> list:
        """Per-process samples newer than `since` (us): our pid twice and another's on GPU 0."""
        if h == 1:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        samples = [types.SimpleNamespace(pid=self.pid, timeStamp=100, smUtil=40),
                   types.SimpleNamespace(pid=self.pid, timeStamp=200, smUtil=60),
                   types.SimpleNamespace(pid=1, timeStamp=300, smUtil=99)]
        return [x for x in samples if x.timeStamp > since]


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
    assert g0.process_util == 50.0 and g1.process_util is None  # the mean of our own samples; none on GPU 1
    assert sampler.sample({}).gpus[0].process_util is None  # only samples newer than the last read count
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


class _FakeMigBox:
    """NVML of a three-GPU box: GPU 1 in MIG mode with two instances (slot 1 empty), GPM on GPU 0
    only, and GPU 2 whose UUID query fails. Only what the driver answers; the sampler does the rest."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_GPM_METRICS_GET_VERSION = pynvml.NVML_GPM_METRICS_GET_VERSION
    NVML_GPM_METRIC_SM_UTIL = pynvml.NVML_GPM_METRIC_SM_UTIL
    NVML_GPM_METRIC_ANY_TENSOR_UTIL = pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL
    c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t
    UUIDS = ["GPU-aaaa1111-0000", "GPU-bbbb2222-0000", None]
    MIG = {0: "MIG-cccc3333-0000", 2: "MIG-dddd4444-0000"}

    def __init__(self) -> None:
        self.gpm_samples = 0
        self.freed = 0

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return 3

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def _unsupported(self):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetName(self, h) -> bytes:
        return b"NVIDIA H200" if isinstance(h, int) else b"NVIDIA H200 MIG 3g.71gb"

    def nvmlDeviceGetUUID(self, h) -> bytes:
        u = self.UUIDS[h] if isinstance(h, int) else self.MIG[h[1]]
        if u is None:
            self._unsupported()
        return u.encode()

    def nvmlDeviceGetUtilizationRates(self, h):
        if not isinstance(h, int) or h == 1:  # no utilisation for MIG
            self._unsupported()
        return types.SimpleNamespace(gpu=90, memory=50)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=2**30, total=(141 if isinstance(h, int) else 71) * 2**30, free=0)

    def nvmlDeviceGetPowerUsage(self, h) -> int:
        return 500_000

    def nvmlDeviceGetTemperature(self, h, sensor) -> int:
        return 50

    def nvmlDeviceGetClockInfo(self, h, clock) -> int:
        return 1980

    def nvmlDeviceGetComputeRunningProcesses(self, h) -> list:
        return []

    def nvmlDeviceGetMigMode(self, h) -> list[int]:
        if h == 2:
            self._unsupported()
        return [1, 1] if h == 1 else [0, 0]

    def nvmlDeviceGetMaxMigDeviceCount(self, h) -> int:
        return 3

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, k):
        if k not in self.MIG:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return (h, k)

    def nvmlGpmQueryDeviceSupport(self, h):
        return types.SimpleNamespace(isSupportedDevice=int(h == 0))

    def nvmlGpmSampleAlloc(self):
        return pynvml.c_nvmlGpmSample_t()

    def nvmlGpmSampleGet(self, h, sample):
        self.gpm_samples += 1
        return sample

    def nvmlGpmSampleFree(self, sample) -> None:
        self.freed += 1

    def nvmlGpmMetricsGet(self, req):
        assert req.version == pynvml.NVML_GPM_METRICS_GET_VERSION and req.numMetrics == 2
        values = {pynvml.NVML_GPM_METRIC_SM_UTIL: 71.5, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: 42.0}
        for m in req.metrics[:2]:
            m.value, m.nvmlReturn = values[m.metricId], 0
        return req


def _mig_box(monkeypatch: pytest.MonkeyPatch, visible: str | None) -> _FakeMigBox:
    fake = _FakeMigBox()
    for name in dir(fake):
        if name.startswith(("nvml", "NVML_", "c_nvml")):
            monkeypatch.setattr(pynvml, name, getattr(fake, name))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return fake


def _ordinals(sample: P.SystemSample) -> dict[str, int | None]:
    out = {}
    for g in sample.gpus:
        out[f"gpu{g.index}"] = g.cuda_index
        out.update({f"gpu{g.index}/mig{m.index}": m.cuda_index for m in g.mig})
    return out


@pytest.mark.parametrize("visible, want", [
    (None, {"gpu0": 0, "gpu1": 1, "gpu2": 2}),
    ("2,0", {"gpu2": 0, "gpu0": 1}),
    ("GPU-bbbb", {"gpu1": 0}),  # a unique UUID prefix, as CUDA accepts
    ("MIG-dddd4444-0000,0", {"gpu1/mig2": 0, "gpu0": 1}),
    ("0,7,1", {"gpu0": 0}),  # CUDA ignores everything from the first invalid entry
    ("1,1,0", {"gpu1": 0}),  # ... and a device named twice is invalid
    ("GPU-", {}),
    ("", {}),
])
def test_nvml_devices_mapped_to_cuda_ordinals(monkeypatch: pytest.MonkeyPatch, visible, want) -> None:
    _mig_box(monkeypatch, visible)
    sampler = SystemSampler()
    got = {k: v for k, v in _ordinals(sampler.sample({})).items() if v is not None}
    assert got == want
    sampler.close()


def test_mig_instances_uuids_and_na_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    _mig_box(monkeypatch, None)
    sample = SystemSampler().sample({})
    g0, g1, g2 = sample.gpus
    assert (g0.uuid, g1.uuid, g2.uuid) == ("GPU-aaaa1111-0000", "GPU-bbbb2222-0000", None)
    assert g0.mig == [] and g2.mig == []  # MIG off / MIG query unsupported: no instances, no error
    assert [(m.index, m.uuid, m.name, m.mem_total) for m in g1.mig] == [
        (0, "MIG-cccc3333-0000", "NVIDIA H200 MIG 3g.71gb", 71 * 2**30),
        (2, "MIG-dddd4444-0000", "NVIDIA H200 MIG 3g.71gb", 71 * 2**30),
    ]
    assert g1.util_percent is None and g1.mem_total == 141 * 2**30
    wire = P.decode(P.encode(P.Snapshot(seq=1, t=0.0, interval_s=1.0, system=sample)))
    assert wire.system.gpus[1].mig[1].uuid == "MIG-dddd4444-0000"


def test_torch_uuids_decide_the_mapping_when_cuda_is_up() -> None:
    """With the trainer's own CUDA UUIDs (torch spells them without the prefix) the environment is
    not consulted: CUDA's fastest-first order may differ from NVML's."""
    from dflash.telemetry.wire.system import cuda_ordinals

    devices = [("GPU-AAAA1111-0000", False), ("GPU-bbbb2222-0000", False), ("MIG-dddd4444-0000", True)]
    assert cuda_ordinals(devices, "0,1", ["bbbb2222-0000", "aaaa1111-0000"]) == {1: 0, 0: 1}
    assert cuda_ordinals(devices, None, ["dddd4444-0000"]) == {2: 0}


def test_gpm_sm_and_tensor_activity(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _mig_box(monkeypatch, None)
    sampler = SystemSampler()
    first = sampler.sample({})
    assert first.gpus[0].sm_active is None  # GPM needs two samples
    second = sampler.sample({})
    g0, g1, _ = second.gpus
    assert (g0.sm_active, g0.tensor_active) == (71.5, 42.0)
    assert g1.sm_active is None and g1.tensor_active is None  # no GPM on this GPU
    assert fake.gpm_samples == 2 and fake.freed == 1  # the older sample is released
    sampler.close()
    assert fake.freed == 2
