"""Launch-bound: a stage whose thread is busy while the GPU it computes on idles, its GPU waiting on the
host. Judged on constructed windows (no GPU here): each stage's host shares, CUDA-event device shares and
the NVML kernel time of the GPU it registered, as the publisher sees them; the edges where the verdict
must not fire; its place among the overlays; and the worker -> GPU map on the wire."""

from __future__ import annotations

import msgspec
import pytest

from dflash.telemetry import ProfileStats
from dflash.telemetry.summary import Summary, to_snapshot
from dflash.telemetry.verdict.evidence import (
    CpuFigures,
    agrees_with_evidence,
    analyze,
    gpu_kernel_shares,
    launch_bound,
    stage_gpu_busy,
)
from dflash.telemetry.verdict.published import PublishedVerdict, RecentWindows, refine
from dflash.telemetry.wire import protocol as P
from dflash.telemetry.wire import verdicts as V
from dflash.telemetry.wire.vocab import Role

ROLES = {"target-0": "target", "drafter-0": "drafter"}


def cs(share: float, device: float | None = None) -> P.CategoryStats:
    """A category's host share of a 1 s window and, for a CUDA span, its CUDA-event device share."""
    dev = None if device is None else P.DeviceStats(n=4, total=device, mean=device / 4, p50=device / 4,
                                                     p95=device / 4, max=device / 4, share=device)
    return P.CategoryStats(n=4, total=share, mean=share / 4, p50=share / 4, p95=share / 4, max=share / 4,
                           share=share, device=dev)


def launching_target(cuda: bool = True) -> dict[str, dict[str, P.CategoryStats]]:
    """The investigation's pipeline: the target thread busy launching (93% of its time, and on CUDA its
    event spans follow it: the stream is never ahead of the thread), the drafter waiting for it."""
    t_dev, d_dev = (0.93, 0.34) if cuda else (None, None)
    return {"target-0": {"target_forward": cs(0.93, t_dev), "pack_hidden": cs(0.01), "hs_queue_put": cs(0.02)},
            "drafter-0": {"hs_queue_wait": cs(0.6), "drafter_forward": cs(0.2, d_dev and d_dev * 0.6),
                          "drafter_backward": cs(0.1, d_dev and d_dev * 0.4)}}


def gpu(index: int, process_util: float | None, util: float | None = None) -> P.GpuSample:
    return P.GpuSample(index=index, name="NVIDIA H200", util_percent=util, process_util=process_util,
                       cuda_index=index)


def test_launch_bound_fires_when_the_thread_is_busy_and_its_gpu_idles() -> None:
    raw = analyze(launching_target(), ROLES)
    assert raw.verdict == "target-bound" and raw.evidence["device_time"] == 1.0
    b = launch_bound(raw, {"target": 0.30, "drafter": 0.30})
    assert b.verdict == "launch-bound" and agrees_with_evidence(b)
    assert b.evidence["target.gpu_busy"] == 0.30 and b.evidence["target.busy"] == 0.94
    assert V.launch_bound_stages(b.evidence) == ["target"]
    assert "target stage's thread is busy 94%" in b.reason and "only 30%" in b.reason
    assert "target-bound by device time" in b.reason and "CUDA graphs" in b.reason
    assert "larger batches" in b.reason and "--native" in b.reason


def test_launch_bound_does_not_fire_when_the_gpu_share_is_close_to_the_host_share() -> None:
    raw = analyze(launching_target(), ROLES)
    # the GPU ran kernels 80% of the time its thread worked 94%: the thread feeds it, it does not starve it
    busy_gpu = launch_bound(raw, {"target": 0.80})
    assert busy_gpu is raw and not agrees_with_evidence(msgspec.structs.replace(raw, verdict="launch-bound"))
    # the edge: at most LAUNCH_GPU_RATIO of the thread's busy share
    edge = V.LAUNCH_GPU_RATIO * 0.94
    assert launch_bound(raw, {"target": round(edge - 0.005, 4)}).verdict == "launch-bound"
    assert launch_bound(raw, {"target": round(edge + 0.005, 4)}).verdict == "target-bound"


def test_launch_bound_does_not_fire_without_device_time() -> None:
    """A CPU run (host spans only): no CUDA events, so no stage runs on a GPU, whatever a GPU reads."""
    raw = analyze(launching_target(cuda=False), ROLES)
    assert raw.verdict == "target-bound" and "device_time" not in raw.evidence
    assert launch_bound(raw, {"target": 0.05}) is raw
    assert not agrees_with_evidence(msgspec.structs.replace(raw, verdict="launch-bound",
                                                            evidence={**raw.evidence, "target.gpu_busy": 0.05}))
    # nor without NVML's reading of the stage's GPU (no driver, a MIG instance, an old recording)
    assert launch_bound(analyze(launching_target(), ROLES), {}).verdict == "target-bound"
    assert launch_bound(analyze(launching_target(), ROLES), None).verdict == "target-bound"


def test_a_stage_that_mostly_waits_is_not_launch_bound_and_data_bound_stays() -> None:
    # a drafter busy 30% on an idle GPU waits for the target: the target (busy, its GPU busy too) bounds it
    raw = analyze(launching_target(), ROLES)
    assert launch_bound(raw, {"target": 0.9, "drafter": 0.05}).verdict == "target-bound"
    # targets starved by the batch producer: their GPU idles because nothing comes in
    starved = launching_target()
    starved["target-0"] = {"target_forward": cs(0.55, 0.55), "batch_queue_wait": cs(0.4)}
    data = analyze(starved, ROLES)
    assert data.verdict == "data-bound" and launch_bound(data, {"target": 0.1}).verdict == "data-bound"
    unknown = analyze({"target-0": {"target_forward": cs(0.01, 0.01)}, "drafter-0": {}}, ROLES)
    assert launch_bound(unknown, {"target": 0.0}).verdict == "unknown"


def test_a_balanced_pipeline_names_the_stage_whose_gpu_idles() -> None:
    workers = {"target-0": {"target_forward": cs(0.9, 0.9)},
               "drafter-0": {"drafter_forward": cs(0.5, 0.5), "drafter_backward": cs(0.4, 0.4)}}
    raw = analyze(workers, ROLES)
    assert raw.verdict == "balanced"
    b = launch_bound(raw, {"target": 0.85, "drafter": 0.2})
    assert b.verdict == "launch-bound" and V.launch_bound_stages(b.evidence) == ["drafter"]
    assert "the drafter stage's thread is busy 90%" in b.reason and "balanced by device time" in b.reason


def test_the_machine_and_the_gil_win_over_launch_bound() -> None:
    """A thread kept off its core, or queued for the GIL, leaves its GPU idle too: the cause is then the
    machine or the lock, so those overlays come first (OVERLAY_ORDER), as refine applies them."""
    assert V.OVERLAY_ORDER == (V.CPU_STARVED, V.GIL_BOUND, V.LAUNCH_BOUND)
    raw = analyze(launching_target(), ROLES)
    idle_gpu = {"target": 0.2}
    assert refine(raw, None, None, None, idle_gpu).verdict == "launch-bound"
    assert refine(raw, None, 0.8, 100.0, idle_gpu).verdict == "GIL-bound"
    starved = CpuFigures(worker_cpu=0.3, worker_busy=0.95, cores=2, others_cores=1.6, idle_cores=0.0)
    assert refine(raw, starved, 0.8, 100.0, idle_gpu).verdict == "CPU-starved"


def test_each_stage_reads_the_gpu_it_registered() -> None:
    """The investigation's multi-GPU pipeline: targets on GPUs of their own, idle between tiny kernels,
    the drafter's GPU busy. A rule reading all GPUs at once (the busiest) would miss it."""
    roles = {"target-0": "target", "target-1": "target", "drafter-0": "drafter", "batch-producer": "data"}
    devices = {"target-0": 0, "target-1": 1, "drafter-0": 2}
    shares = gpu_kernel_shares(P.SystemSample(gpus=[gpu(0, 25.0), gpu(1, 35.0), gpu(2, 92.0),
                                                    P.GpuSample(index=3, name="other", util_percent=5.0)]))
    assert shares == {0: 0.25, 1: 0.35, 2: 0.92}  # a GPU the trainer does not see is not one of its stages'
    assert stage_gpu_busy(roles, devices, shares) == {"target": pytest.approx(0.30), "drafter": 0.92}
    # without the process's own samples, the whole GPU's utilisation (an upper bound of the trainer's)
    assert gpu_kernel_shares(P.SystemSample(gpus=[gpu(0, None, util=40.0)])) == {0: 0.4}
    assert gpu_kernel_shares(P.SystemSample(gpus=[gpu(0, None)])) == {} and gpu_kernel_shares(None) == {}
    # workers on the host register no GPU, and a GPU without a reading counts for nobody
    assert stage_gpu_busy(roles, {"target-0": 7}, shares) == {}


def _window(i: int, gpus: list[P.GpuSample], devices: dict[str, int] | None = None) -> tuple[Summary, P.SystemSample]:
    summary = Summary(t=float(i), window_s=1.0, roles=ROLES, counters={"steps": float(2 * i)},
                      workers=launching_target(), devices=devices if devices is not None else {"target-0": 0,
                                                                                               "drafter-0": 0})
    return summary, P.SystemSample(gpus=gpus)


def test_the_published_verdict_reads_nvml_over_its_span_and_the_whole_run() -> None:
    """Through the publisher's own path: windows with the GPU sample the sampler takes (one GPU both
    stages share), judged over the span, held, and the whole run at the end."""
    published = PublishedVerdict(span_s=10.0)
    shown = [published.update(*_window(i, [gpu(0, 28.0 if i % 2 else 34.0)])) for i in range(12)]
    b = shown[-1]
    assert b.verdict == "launch-bound" and agrees_with_evidence(b) and b.scope.startswith("last 10 s")
    assert b.evidence["target.gpu_busy"] == pytest.approx(0.31, abs=0.005)
    assert {s.verdict for s in shown} == {"launch-bound"}
    last = _window(12, [])[0]
    last.cumulative = launching_target()  # the whole run judges the cumulative shares
    whole = published.final(last)
    assert whole.verdict == "launch-bound" and whole.scope == "whole run" and agrees_with_evidence(whole)
    # the same windows with the GPU busy (NVML 85%): the thread feeds a busy GPU, target-bound as before
    busy = RecentWindows(span_s=10.0)
    for i in range(10):
        busy.add(*_window(i, [gpu(0, 85.0)]))
    assert busy.judge().verdict == "target-bound"
    # and without the worker -> GPU map (a recording from before it was on the wire), nothing is claimed
    old = RecentWindows(span_s=10.0)
    for i in range(10):
        old.add(*_window(i, [gpu(0, 20.0)], devices={}))
    assert old.judge().verdict == "target-bound"


def test_workers_register_their_gpu_and_it_travels_on_the_wire() -> None:
    stats = ProfileStats()
    stats.worker("target-0", Role.TARGET, device=1).add("target_forward", 0.01)
    stats.worker("drafter-0", Role.DRAFTER, device=0).add("drafter_forward", 0.01)
    stats.worker("batch-producer", Role.DATA).add("batch_build", 0.01)
    summary = stats.drain()
    assert summary.devices == {"target-0": 1, "drafter-0": 0}
    snap = P.decode(P.encode(to_snapshot(summary, 1, 1.0)))
    assert isinstance(snap, P.Snapshot) and snap.devices == {"target-0": 1, "drafter-0": 0}
    assert ProfileStats(enabled=False).worker("target-0", Role.TARGET, device=0).name == "target-0"


def test_the_trainer_registers_each_stage_on_its_device() -> None:
    """build() gives each pipeline worker its device's CUDA ordinal; on the host there is none."""
    import torch

    from dflash.train.device.binding import cuda_ordinal

    assert cuda_ordinal(torch.device("cuda", 3)) == 3 and cuda_ordinal(torch.device("cpu")) is None
