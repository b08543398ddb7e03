"""Bottleneck verdicts from per-worker shares: one test per rule, plus the edges between them."""

from __future__ import annotations

import msgspec

from dflash.telemetry.verdict.evidence import agrees_with_evidence, analyze
from dflash.telemetry.wire.protocol import CategoryStats, DeviceStats, Snapshot
from dflash.telemetry.wire.vocab import roles_of


def cs(share: float, wall: float = 1.0) -> CategoryStats:
    total = share * wall
    return CategoryStats(n=10, total=total, mean=total / 10, p50=total / 10, p95=total / 10, max=total / 10,
                         share=share)


def pipeline(
    *, t_fwd: float, t_batch: float, t_put: float, d_wait: float, d_fwd: float, targets: int = 2, drafters: int = 2
) -> dict[str, dict[str, CategoryStats]]:
    workers = {}
    for i in range(targets):
        workers[f"target-{i}"] = {
            "target_forward": cs(t_fwd),
            "batch_queue_wait": cs(t_batch),
            "hs_queue_put": cs(t_put),
        }
    for i in range(drafters):
        workers[f"drafter-{i}"] = {
            "hs_queue_wait": cs(d_wait),
            "drafter_forward": cs(d_fwd / 2),
            "drafter_backward": cs(d_fwd / 2),
        }
    workers["batch-producer"] = {"pack_batch": cs(0.3)}
    return workers


def test_roles_of_a_recording_from_before_roles_were_on_the_wire() -> None:
    names = {"target-3": {}, "drafter-0": {}, "batch-producer": {}, "MainThread": {}}
    assert roles_of(names, None) == {"target-3": "target", "drafter-0": "drafter", "batch-producer": "data",
                                     "MainThread": None}
    assert roles_of(names, {"MainThread": "drafter", "target-3": "bogus"})["MainThread"] == "drafter"
    assert roles_of(names, {"MainThread": "drafter", "target-3": "bogus"})["target-3"] is None


def test_target_bound() -> None:
    b = analyze(pipeline(t_fwd=0.95, t_batch=0.0, t_put=0.02, d_wait=0.6, d_fwd=0.35))
    assert b.verdict == "target-bound"
    assert b.evidence["drafter.hs_queue_wait"] == 0.6
    assert b.evidence["target.hs_queue_put"] == 0.02
    assert "60%" in b.reason and "hs_queue_wait" in b.reason


def test_drafter_bound() -> None:
    b = analyze(pipeline(t_fwd=0.4, t_batch=0.0, t_put=0.55, d_wait=0.01, d_fwd=0.97))
    assert b.verdict == "drafter-bound"
    assert b.evidence["target.hs_queue_put"] == 0.55
    assert "hs_queue_put" in b.reason and "55%" in b.reason


def test_data_bound_even_though_drafters_starve_too() -> None:
    # a slow producer starves the targets, and through them the drafters
    b = analyze(pipeline(t_fwd=0.3, t_batch=0.65, t_put=0.0, d_wait=0.7, d_fwd=0.28))
    assert b.verdict == "data-bound"
    assert b.evidence["target.batch_queue_wait"] == 0.65
    assert b.evidence["data.busy"] == 0.3
    assert "batch_queue_wait" in b.reason


def test_blocked_puts_outweigh_batch_waits() -> None:
    b = analyze(pipeline(t_fwd=0.2, t_batch=0.25, t_put=0.5, d_wait=0.0, d_fwd=0.99))
    assert b.verdict == "drafter-bound"


def test_balanced() -> None:
    b = analyze(pipeline(t_fwd=0.9, t_batch=0.03, t_put=0.05, d_wait=0.08, d_fwd=0.9))
    assert b.verdict == "balanced"
    assert "hs_queue_wait 8%" in b.reason


def test_threshold_is_a_parameter() -> None:
    w = pipeline(t_fwd=0.9, t_batch=0.0, t_put=0.0, d_wait=0.15, d_fwd=0.8)
    assert analyze(w).verdict == "balanced"
    assert analyze(w, threshold=0.1).verdict == "target-bound"


def test_unknown_without_pipeline_workers_or_work() -> None:
    assert analyze({}).verdict == "unknown"
    assert analyze({"MainThread": {"eval": cs(0.9)}}).verdict == "unknown"
    idle = analyze(pipeline(t_fwd=0.0, t_batch=0.0, t_put=0.0, d_wait=0.01, d_fwd=0.0))
    assert idle.verdict == "unknown" and "too little" in idle.reason


def test_only_targets_starving_on_puts_is_drafter_bound() -> None:
    w = pipeline(t_fwd=0.3, t_batch=0.0, t_put=0.6, d_wait=0.0, d_fwd=0.0, drafters=0)
    assert analyze(w).verdict == "drafter-bound"


def test_the_verdict_does_not_flip_on_noise_around_a_threshold() -> None:
    from dflash.telemetry.verdict.published import SteadyVerdict

    steady = SteadyVerdict(hold=3)
    # drafters wait 19-21%: the raw verdict alternates balanced / target-bound every window
    raw = [analyze(pipeline(t_fwd=0.9, t_batch=0.0, t_put=0.0, d_wait=w, d_fwd=0.7)) for w in [0.21, 0.19] * 5 + [0.21]]
    assert {b.verdict for b in raw} == {"target-bound", "balanced"}
    shown = [steady.update(b) for b in raw]
    assert {b.verdict for b in shown} == {"target-bound"}  # the first real verdict, then held
    held = shown[1]
    assert "held: the latest judgement looks balanced, 1 of 3 in a row needed to change" in held.scope
    # the standing verdict's own numbers: a held verdict never sits beside evidence that says otherwise
    assert held.evidence == raw[0].evidence and held.reason == raw[0].reason
    assert all(agrees_with_evidence(b) for b in shown) and not agrees_with_evidence(
        msgspec.structs.replace(raw[0], evidence=raw[1].evidence))
    # a real change wins after three windows in a row
    calm = analyze(pipeline(t_fwd=0.9, t_batch=0.0, t_put=0.0, d_wait=0.05, d_fwd=0.7))
    assert [steady.update(calm).verdict for _ in range(3)] == ["target-bound", "target-bound", "balanced"]
    assert steady.current.verdict == "balanced"


def test_after_unknown_the_next_verdict_shows_at_once() -> None:
    from dflash.telemetry.verdict.published import SteadyVerdict

    steady = SteadyVerdict(hold=3)
    idle = analyze({"target-0": {"target_forward": cs(0.01)}, "drafter-0": {"eval": cs(0.0)}})
    assert steady.update(idle).verdict == "unknown"
    busy = analyze(pipeline(t_fwd=0.5, t_batch=0.0, t_put=0.4, d_wait=0.02, d_fwd=0.9))
    assert steady.update(busy).verdict == "drafter-bound"


def with_device(cats: dict[str, CategoryStats], shares: dict[str, float]) -> dict[str, CategoryStats]:
    """The same host timings plus CUDA-event device time for some categories (share of wall time)."""
    out = dict(cats)
    for name, share in shares.items():
        c = out[name]
        out[name] = CategoryStats(n=c.n, total=c.total, mean=c.mean, p50=c.p50, p95=c.p95, max=c.max, share=c.share,
                                  device=DeviceStats(n=c.n, total=share, mean=share / c.n, p50=share / c.n,
                                                     p95=share / c.n, max=share / c.n, share=share))
    return out


def gpu_pipeline(target_device: float | None, drafter_device: float | None) -> dict[str, dict[str, CategoryStats]]:
    """What a GPU run without host syncs looks like on the host: the target thread queues its kernels
    in no time and then sits blocked on the full hidden-state queue, the drafter thread is always busy
    launching; from host time alone that is drafter-bound, whichever GPU is actually the slow one."""
    workers = pipeline(t_fwd=0.05, t_batch=0.0, t_put=0.9, d_wait=0.0, d_fwd=0.98)
    for name in list(workers):
        if name.startswith("target") and target_device is not None:
            workers[name] = with_device(workers[name], {"target_forward": target_device})
        if name.startswith("drafter") and drafter_device is not None:
            workers[name] = with_device(workers[name], {"drafter_forward": drafter_device / 2,
                                                        "drafter_backward": drafter_device / 2})
    return workers


def test_device_time_decides_on_a_gpu_run() -> None:
    """Host time says drafter-bound; the target's GPU is busy 95% and the drafter's 45%: target-bound."""
    assert analyze(gpu_pipeline(None, None)).verdict == "drafter-bound"  # what host time alone says
    b = analyze(gpu_pipeline(0.95, 0.45))
    assert b.verdict == "target-bound", b
    assert b.evidence["target.device_busy"] == 0.95 and b.evidence["drafter.device_busy"] == 0.45
    assert "95%" in b.reason and "device time" in b.reason
    b = analyze(gpu_pipeline(0.40, 0.97))
    assert b.verdict == "drafter-bound" and b.evidence["drafter.device_busy"] == 0.97
    assert analyze(gpu_pipeline(0.9, 0.85)).verdict == "balanced"


def test_a_cpu_stage_counts_its_host_time_against_a_gpu_stage() -> None:
    """A CPU target (synchronous: host time is its compute) feeding a CUDA drafter."""
    workers = gpu_pipeline(None, 0.5)
    for name in workers:
        if name.startswith("target"):
            workers[name] = {"target_forward": cs(0.93), "hs_queue_put": cs(0.05)}
    b = analyze(workers)
    assert b.verdict == "target-bound" and b.evidence["target.device_busy"] == 0.93


def test_device_share_survives_the_wire_and_old_frames_still_decode() -> None:
    from dflash.telemetry.wire.protocol import decode, encode

    snap = Snapshot(seq=1, t=0.0, interval_s=1.0, workers=gpu_pipeline(0.95, 0.45))
    back = decode(encode(snap))
    assert analyze(back.workers).verdict == "target-bound"
    old = encode(snap).replace(b',"share":0.95}', b"}").replace(b',"share":0.225}', b"}")  # before the field
    workers = decode(old).workers
    assert workers["target-0"]["target_forward"].device.share == 0.0
    assert workers["drafter-0"]["drafter_forward"].device.share == 0.0
    assert analyze(workers).verdict == "drafter-bound"  # judged on host waits, as when it was recorded


def test_input_bound_when_a_followed_cache_is_not_written_yet() -> None:
    """Training from a cache still being written (--follow): the reader waits for files, the drafters
    wait for it; the verdict names the producer, not the target forward."""
    workers = pipeline(t_fwd=0.0, t_batch=0.0, t_put=0.02, d_wait=0.7, d_fwd=0.25)
    for i in range(2):
        workers[f"target-{i}"].update({"cache_read": cs(0.1), "cache_wait": cs(0.8)})
    b = analyze(workers)
    assert b.verdict == "input-bound"
    assert b.reason.startswith("waiting for hidden states: the cache reader waits 80% of its time")
    assert b.evidence["target.cache_wait"] == 0.8
    # the same run once the files are there ahead of it: the reader keeps up, nothing waits
    for i in range(2):
        workers[f"target-{i}"]["cache_wait"] = cs(0.01)
    assert analyze(workers).verdict == "target-bound"


def test_device_shares_that_sum_past_one_are_judged_by_the_time_each_stage_ran_alone() -> None:
    """Target and drafter on one GPU, each on its own stream: their spans overlap and the shares sum
    past 100%. The overlap counts in both, so the verdict follows what each ran without the other, and
    the reason says how much was shared rather than presenting 150% of the time."""
    b = analyze(gpu_pipeline(0.97, 0.55))  # at least 52% shared; alone: target 45%, drafter 3%
    assert b.verdict == "target-bound", b
    assert b.evidence["device.overlap"] == 0.52
    assert "both at once at least 52%" in b.reason and "target ran 45%, the drafter 3%" in b.reason
    b = analyze(gpu_pipeline(0.95, 0.9))  # a saturated shared GPU, both stages equally heavy
    assert b.verdict == "balanced" and b.evidence["device.overlap"] == 0.85
    # apart: no overlap claimed
    b = analyze(gpu_pipeline(0.6, 0.3))
    assert b.evidence["device.overlap"] == 0.0 and "both at once" not in b.reason


def test_each_stages_device_ms_per_step_when_the_window_counts_steps() -> None:
    """The publisher passes the window's steps: each stage's device time per step is in the evidence,
    and in the reason where the stages shared the GPU. One window of 1 s, 10 steps, two workers per
    stage: the targets' 2 x 0.97 s of device time is 194 ms per step, the drafters' 2 x 0.55 s 110 ms."""
    b = analyze(gpu_pipeline(0.97, 0.55), steps=10)
    assert b.evidence["target.device_ms_per_step"] == 194.0 and b.evidence["drafter.device_ms_per_step"] == 110.0
    assert "per step the target's kernels spanned 194.0 ms, the drafter's 110.0 ms" in b.reason
    assert "target.device_ms_per_step" not in analyze(gpu_pipeline(0.97, 0.55)).evidence  # no steps: no figure
