"""One-shot proof of dflash's CUDA paths on one GPU (written for an H200; <= 7 minutes), as JSON lines.

    python scripts/gpu_check.py --jsonl $OUT/gpu_check.jsonl --json $OUT/gpu_check.json  # on the GPU box
    python scripts/gpu_check.py --cpu-smoke --json smoke.json # every check that can run on CPU, tiny
    python scripts/gpu_check.py --plan                        # the checks and their budgets, as JSON
    python scripts/gpu_check.py --summarize gpu_check.jsonl   # the report of a run, also one cut short

On the lent GPU machine, ``scripts/device_run.sh`` runs it (``scripts/device_bundle.sh`` prints the
call; docs/gpu.md). Each check is an independent function with its own time budget. On CUDA each runs
in its own child process, forked from this one after it imported torch, transformers, Inductor and
dflash (without touching CUDA): the start-up is paid once, and a sticky CUDA error, a hang or the
CUDA sanitizer stay inside the child; the budget (plus a small allowance for the child's CUDA
context) is a hard limit, at which the child first dumps every thread's stack into its log. With
``--cpu-smoke`` the checks run in this process at tiny shapes, to prove the script itself before a
GPU is lent. A failing check never hides the others. Each result is written to ``--jsonl`` as it
finishes (flushed), so a run stopped at its limit still returns what it did; the report (``--json``,
and ``--summarize`` later) is derived from those lines. Without CUDA (and without ``--cpu-smoke``)
the script prints one line and exits 0.

The checks run by importance, so that a run cut short still answers the questions that matter most,
and their budgets with the allowances sum to the total. The first, ``prewarm``, compiles
FlexAttention forward and backward into an Inductor cache directory (``--cache-dir``, default a fresh
one per run) that every child shares: the compile-heavy checks then load kernels instead of compiling
them cold.

Checks (see docs/gpu.md; ``--plan`` lists them with their budgets): prewarm, flex_uneven,
host_gap, sync_free, thread_device, device_shares, flex_vs_sdpa, memory_recipe, dflash2_vocab,
throughput, fp8_cache_cuda, eval_temperature, muon_real_shape, dspark, eval_lossless, checkpoint_1b,
side_stream_copy, cuda_spans, ddp_resume, compile_count, verdicts, launch_bound, mask_build, nvml.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The whole run's wall time (the parent's imports, each child's start and its check): with the lent
# machine's start (~2 min) and the call around it this leaves 15 minutes of device time enough for one
# rerun of what failed on a fresh machine (docs/gpu.md, "Time").
TOTAL_BUDGET_S = 420.0
# Each forked child's own start (its CUDA context and first allocation) before its check's clock
# starts: outside each check's budget, inside the total (the budgets and allowances sum to <= the total).
START_ALLOWANCE_S = 1.0
# --cpu-smoke proves the script, not the GPU's timings: its per-check time limits are the GPU budgets
# times this (a CPU shared with other work starts a child process in seconds, not one)
SMOKE_SLACK = 10.0

# Qwen3-8B's config.json (public): what the throughput check builds with random weights.
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1_000_000.0,
                max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, rope_theta=1_000_000.0,
            max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)


@dataclass
class Ctx:
    """Where and how big: ``smoke`` means CPU at tiny shapes."""

    device: str
    smoke: bool
    tmp: Path

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


class Skip(Exception):
    """The check cannot run here (the reason is reported, it is not a failure)."""


# --------------------------------------------------------------------------------------------------
# Building blocks: the real target/drafter/stages at a chosen size
# --------------------------------------------------------------------------------------------------


def make_target(ctx: Ctx, shape: dict, layers: int | None = None, device: str | None = None):
    """A Qwen3-shaped target from a config with random weights (nothing downloaded)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.model.drafter import default_target_layer_ids
    from dflash.targets.hf import HFTarget

    device = device or ctx.device
    cfg = Qwen3Config(**{**shape, "num_hidden_layers": layers or shape["num_hidden_layers"]})
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.eval().requires_grad_(False)
    return HFTarget(model, None, default_target_layer_ids(cfg.num_hidden_layers, 5))


def make_parts(ctx: Ctx, target, drafter_layers: int, seq_len: int, num_anchors: int, batch_size: int,
               samples: int = 16, target_device: str | None = None, **recipe):
    """Real stages around ``target``, made by the trainer's own build(): a BatchSource over random token
    sequences (second half is the response), a TargetStage and a DrafterStage with the recipe's optimizer.
    On a GPU build() fits the batch and anchors to its memory: the returned cfg holds what will run
    (``ran(cfg)``), which every figure must be computed from, not what was asked. ``recipe``: other
    settings (``drafter_type="dflash2"``, ...)."""
    import torch

    from dflash.data import Sample
    from dflash.train.config import TrainConfig
    from dflash.train.config.schema import updated
    from dflash.train.distributed import Dist
    from dflash.train.run.build import build

    vocab = target.vocab_size
    g = torch.Generator().manual_seed(1)
    rows = [Sample(torch.randint(0, vocab - 1, (seq_len,), generator=g).tolist(),
                   [0] * (seq_len // 2) + [1] * (seq_len - seq_len // 2)) for _ in range(samples)]
    cfg = updated(TrainConfig(), num_anchors=num_anchors, batch_size=batch_size, max_steps=10**6, eval_prompts=0,
                  drafter_layers=drafter_layers, target_devices=[str(target.device)], drafter_device=ctx.device,
                  **recipe)
    parts = build(cfg, Dist(), target, samples=rows, log=lambda line: None)
    return parts.source, parts.targets[0], parts.drafter, cfg, parts.stats


def ran(cfg, asked_batch: int, asked_anchors: int) -> dict:
    """The batch and anchors a check's steps ran with (build() may lower them to fit the device), beside
    what it asked for."""
    out = {"batch": cfg.data.batch_size, "anchors": cfg.model.num_anchors}
    if (cfg.data.batch_size, cfg.model.num_anchors) != (asked_batch, asked_anchors):
        out.update(asked_batch=asked_batch, asked_anchors=asked_anchors)
    return out


def run_pipeline(source, tstage, dstage, cfg, stats, steps: int, pipeline: bool, on_step_extra=None,
                 timeout_s: float = 120.0, flops: list[float] | None = None) -> list[float]:
    """Runs the real Pipeline for ``steps`` steps; returns the host time at the end of every step (and
    appends each step's model FLOPs, as the trainer counts them, to ``flops``)."""
    from dflash.train.config.schema import updated
    from dflash.train.run.pipeline import Pipeline, TrainCounters

    state, stamps = TrainCounters(), []

    def on_step(r) -> bool:
        state.step += 1
        state.next_batch += 1
        stamps.append(time.perf_counter())
        if flops is not None:
            flops.append(r.flops)
        if on_step_extra is not None:
            on_step_extra(state.step)
        return state.step < steps

    p = Pipeline(source, [tstage], dstage, updated(cfg, pipeline=pipeline).pipeline, cfg.run, stats, state, on_step)
    p.start()
    deadline = time.monotonic() + timeout_s
    while p.running and time.monotonic() < deadline:
        time.sleep(0.01)
    stuck = p.shutdown()
    if p.failure is not None:
        raise RuntimeError(f"worker {p.failure[0]} failed: " + _where(p.failure[1]))
    if stuck or len(stamps) < steps:
        raise TimeoutError(f"{len(stamps)}/{steps} steps in {timeout_s:.0f}s")
    return stamps


def _where(traceback: str, frames: int = 4) -> str:
    """A traceback's last line with the innermost ``frames`` of its frames: which op raised, and where
    in dflash (a sync error's message alone does not say which call synchronised)."""
    lines = traceback.strip().splitlines()
    at = [ln.strip() for ln in lines if ln.lstrip().startswith("File ")][-frames:]
    return " <- ".join([lines[-1].strip()[:300], *reversed(at)]) if lines else ""


def _sync(ctx: Ctx) -> None:
    if ctx.cuda:
        import torch

        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------------
# The checks: each returns a dict with "ok" (True/False) and its measurements, or raises Skip
# --------------------------------------------------------------------------------------------------



_REGISTERED: dict[str, tuple[Callable[[Ctx], dict], float]] = {}


def check(budget_s: float) -> Callable[[Callable[[Ctx], dict]], Callable[[Ctx], dict]]:
    """Register `check_<name>` as the check <name> with its time limit on a GPU (seconds)."""
    def register(fn: Callable[[Ctx], dict]) -> Callable[[Ctx], dict]:
        _REGISTERED[fn.__name__.removeprefix("check_")] = (fn, budget_s)
        return fn
    return register


@check(budget_s=15)
def check_sync_free(ctx: Ctx) -> dict:
    """20 steady pipelined steps under set_sync_debug_mode("error"), of the real stages and Pipeline at
    8B-layer shapes, and of the whole trainer on the tiny target: any host sync in a worker raises
    there and fails the run (the traceback's last line names the op)."""
    import torch

    shape = TINY if ctx.smoke else {**QWEN3_8B, "vocab_size": 32768}
    target = make_target(ctx, shape, layers=2 if ctx.smoke else 8)
    seq = 96 if ctx.smoke else 2048
    parts = make_parts(ctx, target, 1 if ctx.smoke else 2, seq, 8 if ctx.smoke else 128, 2)
    warm, steady = (2, 3) if ctx.smoke else (5, 20)

    def arm(step: int) -> None:
        if ctx.cuda and step == warm:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")

    out: dict = {"steady_steps": steady}
    try:
        run_pipeline(*parts, steps=warm + steady, pipeline=True, on_step_extra=arm)
        out["stages"] = "no sync"
    except RuntimeError as e:
        out["stages"] = str(e)[:1200]
    finally:
        if ctx.cuda:
            torch.cuda.set_sync_debug_mode(0)
    out["trainer"] = _steady_trainer(ctx, warm, steady)
    # the other objectives and Muon: KL's verifier logits, D-PACE's weights, Muon's guarded step
    out["trainer_kl_muon"] = _steady_trainer(ctx, warm, steady, loss="kl", optimizer="muon")
    out["trainer_dpace"] = _steady_trainer(ctx, warm, steady, position_weight="dpace")
    if not ctx.cuda:
        return {"ok": None, **out, "note": "ran on CPU: the sync assertion needs CUDA"}
    trainers = (out["trainer"], out["trainer_kl_muon"], out["trainer_dpace"])
    return {"ok": out["stages"] == "no sync" and all(t in ("no sync", "unavailable") for t in trainers), **out}


def _steady_trainer(ctx: Ctx, warm: int, steady: int, **recipe) -> str:
    """The whole trainer (producer planning, pinned batches, metrics) on the built-in tiny target,
    through dflash.testing where this checkout has it; ``recipe``: settings beside the default
    objective and optimizer (a checkout without them answers "unavailable")."""
    try:
        from dflash.testing import CudaSyncLog, run_steady
    except ImportError:
        return "unavailable"
    from dflash.train.config.schema import make_config

    dev = "cuda" if ctx.cuda else "cpu"
    name = "-".join(f"{v}" for v in recipe.values()) or "default"
    try:
        cfg = make_config({}, dict(target="tiny", data="demo", run_dir=str(ctx.tmp / f"steady-{name}"),
                                   batch_size=4, num_anchors=16, max_steps=1, drafter_layers=1, target_devices=[dev],
                                   drafter_device=dev, max_seq_len=256, **recipe))
    except ValueError:  # ConfigError: a checkout before the objectives
        return "unavailable"
    log = CudaSyncLog()
    try:
        run_steady(cfg, warm, steady, lambda: log)
    except RuntimeError as e:
        return _where(str(e))
    return _worker_syncs(log)


def _worker_syncs(log) -> str:
    """'no sync' when no worker thread synchronised, else each such thread with its first sync's place."""
    found = log.workers()
    return "; ".join(f"{t}: {len(w)} sync(s), first at {w[0]}" for t, w in found.items()) or "no sync"


def _grads_of(drafter) -> list:
    return [p.grad.detach().float().clone() for p in drafter.parameters()]


def _flex_against_sdpa(ctx: Ctx, target, dstage, seq: int, n: int, pad: int, seed: int) -> dict:
    """Loss and gradients of the drafter on one batch of 2 rows (row 1 padded by ``pad`` tokens, one
    anchor on a tile edge) under compiled FlexAttention vs SDPA, in bf16 autocast on CUDA; CPU: the
    forward only (torch has no flex backward there)."""
    import torch
    import torch.nn.functional as F

    from dflash.model.blocks import forward_blocks

    dev = torch.device(ctx.device)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size - 1, (2, seq), generator=g).to(dev)
    with torch.no_grad():
        hidden = target.tap_states(ids.to(target.device)).to(dev)
    anchors = torch.stack([torch.randperm(seq // 2 - 16, generator=g)[:n].sort().values + seq // 2
                           for _ in range(2)]).to(dev)
    anchors[0, 0] = 128 if seq > 200 else anchors[0, 0]  # an anchor on a tile boundary
    attn = torch.ones(2, seq, dtype=torch.long, device=dev)
    if pad:
        attn[1, -pad:] = 0  # a padded tail in row 1
    bs = dstage.drafter.config.block_size
    slots = (anchors[:, :, None] + torch.arange(1, bs, device=dev)).view(2, -1)
    labels = torch.gather(ids, 1, slots).view(2, n, bs - 1)
    out = {}
    for backend in ("sdpa", "flex"):
        dstage.drafter.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, torch.bfloat16, enabled=ctx.cuda), torch.set_grad_enabled(ctx.cuda):
            h = forward_blocks(dstage.drafter, dstage.embed, ids, hidden, anchors, attn, attn_backend=backend)
            logits = dstage.lm_head(h[:, :, 1:].to(dstage.lm_head.weight.dtype)).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        if ctx.cuda:
            loss.backward()
        out[backend] = (loss.detach().float(), _grads_of(dstage.drafter) if ctx.cuda else [])
    ls, lf = out["sdpa"][0], out["flex"][0]
    loss_rel = float((lf - ls).abs() / ls.abs().clamp(min=1e-6))
    grad_rel = max((float((a - b_).norm() / b_.norm().clamp(min=1e-12))
                    for a, b_ in zip(out["flex"][1], out["sdpa"][1], strict=True)), default=0.0)
    return {"seq": seq, "anchors": n, "pad": pad, "loss_sdpa": float(ls), "loss_flex": float(lf),
            "loss_rel_diff": loss_rel, "max_grad_rel_diff": grad_rel,
            "ok": loss_rel < 1e-2 and grad_rel < 5e-2}


@check(budget_s=11)
def check_flex_vs_sdpa(ctx: Ctx) -> dict:
    """Loss and gradients of the packed-block drafter under compiled FlexAttention (block mask from
    tile metadata) vs SDPA (dense mask), in bf16 autocast. CPU: forward only (no flex backward there)."""
    from dflash.model import masks

    target = make_target(ctx, TINY if ctx.smoke else {**QWEN3_8B, "vocab_size": 32768}, layers=2 if ctx.smoke else 4)
    seq, n = (96, 6) if ctx.smoke else (1024, 48)
    _, _, dstage, _, _ = make_parts(ctx, target, 1 if ctx.smoke else 2, seq, n, 2)
    r = _flex_against_sdpa(ctx, target, dstage, seq, n, pad=5, seed=3)
    ok = r.pop("ok") and masks._flex_failed is None
    return {"ok": ok, **r, "backward_compared": ctx.cuda, "flex_fallback": masks._flex_failed}


@check(budget_s=18)
def check_flex_uneven(ctx: Ctx) -> dict:
    """Flex vs SDPA, forward and backward in bf16, where tiles and shapes do not line up: anchor counts
    not a multiple of 8, lengths not a multiple of 128, padded rows; and no fallback to SDPA."""
    from dflash.model import masks

    target = make_target(ctx, TINY if ctx.smoke else {**QWEN3_8B, "vocab_size": 32768}, layers=2 if ctx.smoke else 4)
    shapes = [(97, 5, 3), (150, 7, 11)] if ctx.smoke else [(1000, 37, 13), (1537, 101, 129), (2001, 250, 1)]
    _, _, dstage, _, _ = make_parts(ctx, target, 1 if ctx.smoke else 2, shapes[0][0], shapes[0][1], 2, samples=2)
    runs = [_flex_against_sdpa(ctx, target, dstage, seq, n, pad, seed=i) for i, (seq, n, pad) in enumerate(shapes)]
    ok = all(r.pop("ok") for r in runs) and masks._flex_failed is None
    return {"ok": ok, "shapes": runs, "backward_compared": ctx.cuda, "flex_fallback": masks._flex_failed}


@check(budget_s=12)
def check_compile_count(ctx: Ctx) -> dict:
    """Compiled FlexAttention over varying sequence lengths and anchor counts (forward + backward):
    at most 2 compilations (torch._dynamo's unique graphs), and no fallback to SDPA."""
    import torch
    from torch._dynamo.utils import counters

    from dflash.model import masks
    from dflash.model.blocks import forward_blocks

    if not ctx.cuda:
        raise Skip("compiled flex has no CPU backward; the forward count is tests/test_model_masks.py's")
    target = make_target(ctx, {**QWEN3_8B, "vocab_size": 32768}, layers=4)
    _, _, dstage, _, _ = make_parts(ctx, target, 2, 64, 8, 1, samples=1)
    torch._dynamo.reset()
    counters.clear()
    dev = torch.device(ctx.device)
    shapes = [(1024, 64), (1536, 96), (3000, 200), (4096, 512), (777, 33), (2048, 128)]
    times = []
    for t, n in shapes:
        g = torch.Generator().manual_seed(t)
        ids = torch.randint(0, 32000, (2, t), generator=g).to(dev)
        anchors = torch.stack([torch.randperm(t - 16, generator=g)[:n].sort().values for _ in range(2)]).to(dev)
        with torch.no_grad():
            hidden = target.tap_states(ids)
        t0 = time.perf_counter()
        with torch.autocast("cuda", torch.bfloat16):
            h = forward_blocks(dstage.drafter, dstage.embed, ids, hidden, anchors, attn_backend="flex")
        h.float().square().mean().backward()
        torch.cuda.synchronize()
        times.append(round(time.perf_counter() - t0, 3))
    graphs = int(counters["stats"]["unique_graphs"])
    return {"ok": graphs <= 2 and masks._flex_failed is None, "unique_graphs": graphs, "shapes": shapes,
            "seconds_per_shape": times, "flex_fallback": masks._flex_failed}


@check(budget_s=2)
def check_mask_build(ctx: Ctx) -> dict:
    """The recipe-size block mask (512 anchors x 16, 4096 tokens, batch 2): build time, peak memory
    (vs the dense mask's bytes) and, on CUDA, no host sync while building."""
    import torch

    from dflash.model.masks import flex_block_mask

    n, bs, t = (512, 16, 4096)
    dev = torch.device(ctx.device)
    g = torch.Generator().manual_seed(0)
    anchors = torch.stack([torch.randperm(t - bs, generator=g)[:n].sort().values for _ in range(2)]).to(dev)
    valid = torch.ones(2, t, dtype=torch.long, device=dev)
    valid[1, 3000:] = 0
    flex_block_mask(anchors, bs, t, valid)  # warm-up
    _sync(ctx)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error")
    try:
        t0 = time.perf_counter()
        for _ in range(10):
            bm = flex_block_mask(anchors, bs, t, valid)
    finally:
        if ctx.cuda:
            torch.cuda.set_sync_debug_mode(0)
    _sync(ctx)
    ms = (time.perf_counter() - t0) / 10 * 1e3
    q, kv = n * bs, t + n * bs
    out = {"ok": True, "build_ms": round(ms, 3), "dense_mask_bytes": 2 * q * kv, "tiles": list(bm.kv_indices.shape),
           "partial_tiles": int(bm.kv_num_blocks.sum()), "full_tiles": int(bm.full_kv_num_blocks.sum())}
    if ctx.cuda:
        peak = torch.cuda.max_memory_allocated() - base
        out.update(peak_bytes=int(peak), ok=peak < 2 * q * kv / 100)
    return out


@check(budget_s=7)
def check_side_stream_copy(ctx: Ctx) -> dict:
    """Hidden states handed from target to drafter through the side-stream copy (CPU target -> GPU
    drafter: pinned, non-blocking; GPU -> same GPU) equal a direct forward, checksum for checksum,
    under the CUDA sanitizer (torch.cuda._sanitizer: reports unsynchronised stream access)."""
    import torch

    from dflash.telemetry import ProfileStats
    from dflash.train.run.stages import TargetStage

    if ctx.cuda:
        from torch.cuda._sanitizer import enable_cuda_sanitizer

        enable_cuda_sanitizer()
    dev = torch.device(ctx.device)
    results = {}
    for where in (["cpu", ctx.device] if ctx.cuda else ["cpu"]):
        target = make_target(ctx, TINY, layers=2, device=where)
        source, _, _, _, _ = make_parts(ctx, target, 1, 128, 8, 2, samples=8)
        stage = TargetStage(target, dev, ProfileStats().worker(f"target-{where}"), "target-x")
        diffs = []
        for i in range(3):
            batch = source(i)
            hb = stage(batch)
            if hb.ready is not None:
                torch.cuda.current_stream(dev).wait_event(hb.ready)
            got = hb.hidden.double().sum(dim=(1, 2))
            want = target.tap_states(batch.input_ids, batch.attention_mask).to(dev).double().sum(dim=(1, 2))
            diffs.append(float((got - want).abs().max()))
        results[f"{where}->{ctx.device}"] = diffs
    return {"ok": all(d == 0.0 for v in results.values() for d in v), "max_abs_checksum_diff": results,
            "sanitizer": ctx.cuda}


@check(budget_s=2)
def check_cuda_spans(ctx: Ctx) -> dict:
    """CUDA spans from a worker thread on its own stream resolve to device times via query(), and
    after the GPU is idle one drain leaves nothing pending."""
    import torch

    from dflash.telemetry import ProfileStats

    stats = ProfileStats()
    dev = torch.device(ctx.device)
    n = 64 if ctx.cuda else 8

    def work() -> None:
        if ctx.cuda:
            torch.cuda.set_device(dev)
        w = stats.worker("drafter-0")
        side = torch.cuda.Stream(dev) if ctx.cuda else None
        a = torch.randn(1024, 1024, device=dev)
        for _ in range(n):
            with w.cuda_span("drafter_forward"):
                a = (a @ a).tanh()
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side), w.cuda_span("h2d", side):
                    (a + 1).sum()
        _sync(ctx)

    t = threading.Thread(target=work, name="drafter-0")
    t.start()
    t.join()
    summary = stats.drain()
    cats = summary.cumulative.get("drafter-0", {})
    pending = sum(len(v) for v in stats._unresolved.values())
    dev_n = {c: (s.device.n if getattr(s, "device", None) is not None else 0) for c, s in cats.items()}
    ok = pending == 0 and (not ctx.cuda or all(v == n for v in dev_n.values()))
    return {"ok": ok, "host_spans": {c: s.n for c, s in cats.items()}, "device_spans": dev_n, "pending": pending,
            "dropped": summary.dropped}


def _verdict(ctx: Ctx, target_layers: int, drafter_layers: int, anchors: int, shape: dict, seq: int) -> dict:
    from dflash.telemetry.verdict.evidence import analyze

    target = make_target(ctx, shape, layers=target_layers)
    parts = make_parts(ctx, target, drafter_layers, seq, anchors, 2)
    stats = parts[-1]
    warm, steps = (2, 8) if ctx.smoke else (5, 30)
    run_pipeline(*parts, steps=warm, pipeline=True)
    _sync(ctx)
    stats.drain()  # forget the warm-up (compilation)
    run_pipeline(*parts, steps=steps, pipeline=True)
    _sync(ctx)
    summary = stats.drain()
    b = analyze(summary.workers, summary.roles, steps=steps)  # the steps this window measured
    return {"verdict": b.verdict, "reason": b.reason}


@check(budget_s=13)
def check_verdicts(ctx: Ctx) -> dict:
    """The bottleneck verdict on a target-heavy run (deep target, one small drafter layer, few
    anchors) and a drafter-heavy one (shallow target, deep drafter, many anchors)."""
    shape = TINY if ctx.smoke else {**QWEN3_8B, "vocab_size": 32768}
    seq = 128 if ctx.smoke else 2048
    heavy_t = _verdict(ctx, 12 if ctx.smoke else 24, 1, 4 if ctx.smoke else 16, shape, seq)
    heavy_d = _verdict(ctx, 1, 4 if ctx.smoke else 5, 24 if ctx.smoke else 512, shape, seq)
    ok = heavy_t["verdict"] == "target-bound" and heavy_d["verdict"] == "drafter-bound"
    return {"ok": ok, "target_heavy": heavy_t, "drafter_heavy": heavy_d}


def _tiny_kernel_pipeline(ctx: Ctx, seconds: float, window_s: float) -> dict:
    """A target thread launching many tiny kernels (one 16-float add each: ~2 us on the GPU, several times
    that to launch from Python) in its target_forward span and a drafter thread waiting for it, judged
    over `seconds` of `window_s` windows by the published verdict with the NVML sample of each window."""
    import queue

    import torch

    from dflash.telemetry import ProfileStats
    from dflash.telemetry.verdict.published import RecentWindows
    from dflash.telemetry.wire.system import SystemSampler
    from dflash.telemetry.wire.vocab import Role

    dev = torch.device(ctx.device)
    index = (dev.index or 0) if ctx.cuda else None
    stats, stop, handoff = ProfileStats(), threading.Event(), queue.Queue(maxsize=2)

    def bind() -> None:  # as the trainer's workers: their device, a stream of their own
        if ctx.cuda:
            torch.cuda.set_device(dev)
            torch.cuda.set_stream(torch.cuda.Stream(dev))

    def target() -> None:
        bind()
        w, x = stats.worker("target-0", Role.TARGET, index), torch.zeros(16, device=dev)
        while not stop.is_set():
            with w.cuda_span("target_forward"):
                for _ in range(200):
                    x.add_(1.0)
            with w.span("hs_queue_put"):
                with contextlib.suppress(queue.Full):
                    handoff.put(x, timeout=0.1)

    def drafter() -> None:
        bind()
        w, y = stats.worker("drafter-0", Role.DRAFTER, index), torch.zeros(16, device=dev)
        while not stop.is_set():
            with w.span("hs_queue_wait"):
                try:
                    x = handoff.get(timeout=0.1)
                except queue.Empty:
                    continue
            with w.cuda_span("drafter_forward"):
                y.add_(x)

    threads = [threading.Thread(target=f, name=f.__name__ + "-0", daemon=True) for f in (target, drafter)]
    sampler, recent = SystemSampler(nvml=ctx.cuda), RecentWindows(span_s=seconds)
    for t in threads:
        t.start()
    try:
        time.sleep(window_s)  # warm-up: the first launches and the allocator's first blocks
        sampler.sample({})  # NVML's per-process samples count from here
        stats.drain()
        for _ in range(round(seconds / window_s)):
            time.sleep(window_s)
            recent.add(stats.drain(), sampler.sample({}))
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        sampler.close()
    b = recent.judge()
    return {"verdict": b.verdict, "reason": b.reason, "evidence": b.evidence, "gpu_busy": recent.gpu_busy()}


def _churn(seconds: float) -> dict:
    """The caching allocator emptied after every allocation (empty_cache in the loop): its driver calls a
    second from the counts the trainer reads (dflash.train.device.memory.segment_calls)."""
    import torch

    from dflash.telemetry.verdict.churn import CHURN_HIGH
    from dflash.train.device.memory import segment_calls

    before, t0 = segment_calls(torch.cuda.memory_stats()), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del block
        torch.cuda.empty_cache()
    after, dt = segment_calls(torch.cuda.memory_stats()), time.perf_counter() - t0
    rate = (after[0] - before[0] + after[1] - before[1]) / dt
    return {"calls_per_s": round(rate, 1), "limit_per_s": CHURN_HIGH,
            "keys": "num_device_alloc" in torch.cuda.memory_stats(), "high": rate >= CHURN_HIGH}


@check(budget_s=6)
def check_launch_bound(ctx: Ctx) -> dict:
    """Launch-bound, provoked: many tiny kernels from a target thread keep it busy while its GPU idles
    between them, and the published verdict (NVML's kernel time over 3 s) says launch-bound; then the
    allocator emptied after every allocation reads as churn. On the CPU the same pipeline runs with
    host spans: no device time, so no launch-bound (what it says instead is reported)."""
    out = _tiny_kernel_pipeline(ctx, seconds=1.0 if ctx.smoke else 3.0, window_s=0.25 if ctx.smoke else 0.5)
    if not ctx.cuda:
        return {"ok": None, **out, "note": "ran on CPU: launch-bound needs CUDA events and NVML"}
    out["churn"] = _churn(1.0)
    return {"ok": out["verdict"] == "launch-bound" and out["churn"]["high"], **out}


@check(budget_s=4)
def check_nvml(ctx: Ctx) -> dict:
    """NVML sample of this GPU under load: fields present, the GPU found as this process's cuda:0 by
    UUID, and GPM SM-active / tensor-active where the GPU supports it."""
    import torch

    from dflash.telemetry.wire.system import SystemSampler

    sampler = SystemSampler()
    first = sampler.sample({})
    if not first.gpus:
        raise Skip(first.gpu_error or "no GPUs")
    stop = threading.Event()
    dev = torch.device(ctx.device)

    def load() -> None:
        torch.cuda.set_device(dev)
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        while not stop.is_set():
            a = a @ a
            a = a / a.norm()
            torch.cuda.synchronize()

    th = threading.Thread(target=load)
    th.start()
    try:
        time.sleep(2.0)
        s = sampler.sample({})
    finally:
        stop.set()
        th.join()
        sampler.close()
    uuid = str(torch.cuda.get_device_properties(dev).uuid).lower().removeprefix("gpu-")
    mine = [g for g in s.gpus if g.cuda_index == (dev.index or 0)]
    g = mine[0] if mine else None
    # required; then the ones a container (pid namespace) or an older GPU may legitimately lack
    need = ["name", "util_percent", "mem_used", "mem_total", "power_w", "temp_c", "sm_clock_mhz", "uuid"]
    got = {f: getattr(g, f) for f in [*need, "process_mem", "sm_active", "tensor_active"]} if g else {}
    empty = [f for f in need if got.get(f) is None]
    mapped = g is not None and (g.uuid or "").lower().removeprefix("gpu-") == uuid
    return {"ok": mapped and not empty, "gpu": got, "empty_fields": empty, "mapped_by_uuid": mapped,
            "gpm": got.get("sm_active") is not None, "gpus_seen": len(s.gpus)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def one_rank_world() -> Iterator[type]:
    """torchrun's environment for a world of one rank (restored afterwards); yields a Dist class whose
    multi-rank path (DDP, agreement, process groups) is on with that one rank."""
    from dflash.train import distributed

    class WorldOfOne(distributed.Dist):
        @property
        def enabled(self) -> bool:
            return True

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield WorldOfOne
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@check(budget_s=15)
def check_ddp_resume(ctx: Ctx) -> dict:
    """The trainer's multi-rank path (DDP, agreed stops, process groups) with one rank, NCCL on CUDA
    (gloo on CPU): 6 steps straight equal stop after a few, resume, run to 6 (drafter weights)."""
    import torch

    from dflash.train import distributed
    from dflash.train.config.schema import make_config
    from dflash.train.trainer import Trainer

    class OneRankTrainer(Trainer):
        def join_ranks(self) -> None:
            self.dist = d = world()
            pipe = self.cfg.pipeline
            pipe.target_devices, pipe.drafter_device = distributed.place_devices(
                pipe.target_devices, pipe.drafter_device, d, torch.cuda.device_count())
            distributed.init(d, pipe.drafter_device, 120.0)

    dev = "cuda" if ctx.cuda else "cpu"

    def cfg(run: str):
        return make_config({}, dict(target="tiny", data="demo", run_dir=str(ctx.tmp / run), batch_size=2,
                                    num_anchors=8, max_steps=6, log_every=1e9, telemetry=False, eval_prompts=0,
                                    checkpoint_every=1e9, drafter_layers=1, target_devices=[dev],
                                    drafter_device=dev, max_seq_len=128))

    class StopEarly(OneRankTrainer):
        def on_step(self, r):
            if self.state.step == 1:
                self.stop_requested.set()
            return super().on_step(r)

    def params(t) -> dict:
        return {k: v.detach().float().cpu() for k, v in t.drafter.drafter.state_dict().items()}

    with one_rank_world() as world:
        straight = OneRankTrainer(cfg("a"), log=lambda s: None)
        assert straight.run() == 0
        os.environ["MASTER_PORT"] = str(_free_port())
        first = StopEarly(cfg("b"), log=lambda s: None)
        # (a stop is agreed across ranks one step later, so it lands after step 3)
        assert first.run() == 0 and 0 < first.state.step < 6, first.state.step
        os.environ["MASTER_PORT"] = str(_free_port())
        second = OneRankTrainer(cfg("b"), resume=True, log=lambda s: None)
        assert second.run() == 0 and second.state.step == 6
    a, b = params(straight), params(second)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    scale = max(float(v.abs().max()) for v in a.values())
    bitwise = all(torch.equal(a[k], b[k]) for k in a)
    return {"ok": diff <= 1e-6 * scale, "bitwise": bitwise, "max_abs_diff": diff,
            "stopped_at": first.state.step, "backend": "nccl" if ctx.cuda else "gloo",
            "ddp": type(second.drafter.forward_module).__name__}


def device_peak(ctx: Ctx) -> float | None:
    """The GPU's dense bf16 peak, FLOP/s, from the trainer's own table (None on the host or a GPU not in
    it: no MFU then)."""
    import torch

    from dflash.train.device.flops import devices_peak

    return devices_peak([torch.device(ctx.device)])[0]


@check(budget_s=36)
def check_throughput(ctx: Ctx) -> dict:
    """Qwen3-8B-shaped target (random weights), the recipe drafter (5 layers, 512 anchors, block 16),
    4096-token sequences: tokens/s pipelined vs --pipeline off, and MFU against the GPU's dense bf16 peak,
    each step's FLOPs as the trainer counts them (dflash/train/device/flops.py)."""
    import torch

    layers = int(os.environ.get("GPU_CHECK_TARGET_LAYERS", "36"))
    shape = TINY if ctx.smoke else QWEN3_8B
    seq, n, bsz = (128, 8, 2) if ctx.smoke else (4096, 512, int(os.environ.get("GPU_CHECK_BATCH", "2")))
    target = make_target(ctx, shape, layers=2 if ctx.smoke else layers)
    parts = make_parts(ctx, target, 1 if ctx.smoke else 5, seq, n, bsz, samples=8)
    warm, steps = (1, 3) if ctx.smoke else (3, 10)
    out: dict = {"target_layers": target.num_layers, "seq_len": seq, **ran(parts[3], bsz, n)}
    bsz = out["batch"]  # the rates are of the batch that ran
    peak = device_peak(ctx)
    for mode in (True, False):
        counted: list[float] = []  # each step's model FLOPs, as the trainer counts them (train/device/flops.py)
        stamps = run_pipeline(*parts, steps=warm + steps, pipeline=mode, timeout_s=240, flops=counted)
        _sync(ctx)
        dt = (stamps[-1] - stamps[warm - 1]) / steps
        flops = sum(counted[warm:warm + steps]) / steps
        key = "pipelined" if mode else "sync"
        out[f"{key}_tokens_per_s"] = round(bsz * seq / dt, 1)
        out[f"{key}_step_s"] = round(dt, 4)
        out[f"{key}_mfu"] = round(flops / dt / peak, 4) if peak else None
    out["pipelined_over_sync"] = round(out["pipelined_tokens_per_s"] / out["sync_tokens_per_s"], 3)
    out["step_tflop"] = float(f"{flops / 1e12:.4g}")
    out["peak_tflops"] = peak / 1e12 if peak else None
    from dflash.model import masks

    out["flex_fallback"] = masks._flex_failed  # a silent fall back to SDPA would make these SDPA's figures
    if ctx.cuda:
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    out["ok"] = masks._flex_failed is None and flops > 0  # 0: the trainer's FLOP count did not reach its steps
    return out


@check(budget_s=50)  # fills the Inductor cache the others share: it runs first
def check_prewarm(ctx: Ctx) -> dict:
    """Compiles FlexAttention forward and backward once for each drafter shape the checks use (the
    Qwen3-8B-shaped one and the built-in tiny target's, which the whole-trainer checks run), into the
    Inductor cache every later check's child process shares (graphs are dynamic in sequence length
    and anchor count, so one compile per head shape serves them all): later checks load, not compile."""
    import torch

    from dflash.model import masks
    from dflash.model.blocks import forward_blocks
    from dflash.targets import load_target

    dev = torch.device(ctx.device)
    big = make_target(ctx, TINY if ctx.smoke else {**QWEN3_8B, "vocab_size": 32768}, layers=2)
    tiny = load_target("tiny", device=ctx.device, dtype=torch.bfloat16 if ctx.cuda else torch.float32)
    seconds = {}
    big_shape = (1, (96, 6)) if ctx.smoke else (2, (1000, 37))
    for name, target, layers, (seq, n) in (("qwen3_8b_shape", big, *big_shape), ("tiny", tiny, 1, (96, 6))):
        _, _, dstage, _, _ = make_parts(ctx, target, layers, seq, n, 1, samples=1)
        ids = torch.randint(0, target.vocab_size - 1, (1, seq)).to(dev)
        with torch.no_grad():
            hidden = target.tap_states(ids.to(target.device)).to(dev)
        anchors = torch.arange(n, device=dev)[None] * ((seq - 16) // n)
        t0 = time.perf_counter()
        with torch.autocast(dev.type, torch.bfloat16, enabled=ctx.cuda), torch.set_grad_enabled(ctx.cuda):
            h = forward_blocks(dstage.drafter, dstage.embed, ids, hidden, anchors, attn_backend="flex")
        if ctx.cuda:
            h.float().square().mean().backward()
        _sync(ctx)
        seconds[name] = round(time.perf_counter() - t0, 1)
    return {"ok": masks._flex_failed is None, "compile_s": seconds,
            "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "flex_fallback": masks._flex_failed}


def _device_ms(window, worker: str, cats: tuple[str, ...]) -> tuple[float, float]:
    """(device share, device seconds) of ``worker``'s ``cats`` in a drained window."""
    share = secs = 0.0
    for c in cats:
        st = window.workers.get(worker, {}).get(c)
        if st is not None and st.device is not None:
            share += st.device.share
            secs += st.device.total
    return share, secs


@check(budget_s=16)
def check_device_shares(ctx: Ctx) -> dict:
    """Target and drafter on one GPU, each worker on its own stream: the two stages' device shares sum
    to at most 1.05, and each stage's device ms per step pipelined matches that stage alone (sync mode:
    one thread, one stream, the stages one after the other, so each span times only its own kernels)."""
    from dflash.telemetry.verdict.evidence import DRAFTER_BUSY, TARGET_BUSY

    if not ctx.cuda:
        raise Skip("device time needs CUDA events")
    target = make_target(ctx, {**QWEN3_8B, "vocab_size": 32768}, layers=12)
    parts = make_parts(ctx, target, 2, 2048, 128, 2)
    stats = parts[-1]
    out: dict = {}
    for mode in (False, True):
        run_pipeline(*parts, steps=2, pipeline=mode)  # warm-up (compilation, allocator)
        _sync(ctx)
        stats.drain()
        steps = 8
        run_pipeline(*parts, steps=steps, pipeline=mode)
        _sync(ctx)
        w = stats.drain()
        t_share, t_s = _device_ms(w, "target-0", TARGET_BUSY)
        d_share, d_s = _device_ms(w, "drafter-0", DRAFTER_BUSY)
        out["pipelined" if mode else "alone"] = {"target_ms_per_step": round(t_s / steps * 1e3, 2),
                                                 "drafter_ms_per_step": round(d_s / steps * 1e3, 2),
                                                 "target_share": round(t_share, 3), "drafter_share": round(d_share, 3),
                                                 "share_sum": round(t_share + d_share, 3)}
    p, a = out["pipelined"], out["alone"]
    ratios = {k: round(p[k] / a[k], 3) if a[k] else None for k in ("target_ms_per_step", "drafter_ms_per_step")}
    ok = p["share_sum"] <= 1.05 and all(r is not None and 0.8 <= r <= 1.25 for r in ratios.values())
    return {"ok": ok, **out, "pipelined_over_alone": ratios}


@check(budget_s=35)
def check_memory_recipe(ctx: Ctx) -> dict:
    """The default recipe's shapes (batch 8, 512 anchors x block 16, 4096 tokens, 5 drafter layers,
    Qwen3-8B-shaped target): peak memory, the allocator's retries (each one synchronises the device)
    and MFU; or the out-of-memory error that says the recipe does not fit."""
    import torch

    shape = TINY if ctx.smoke else QWEN3_8B
    seq, n, bsz = (128, 8, 2) if ctx.smoke else (4096, 512, 8)
    target = make_target(ctx, shape, layers=2 if ctx.smoke else int(os.environ.get("GPU_CHECK_TARGET_LAYERS", "36")))
    parts = make_parts(ctx, target, 1 if ctx.smoke else 5, seq, n, bsz, samples=bsz * 2)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    warm, steps = (1, 2) if ctx.smoke else (2, 5)
    counted: list[float] = []
    stamps = run_pipeline(*parts, steps=warm + steps, pipeline=True, timeout_s=240, flops=counted)
    _sync(ctx)
    dt = (stamps[-1] - stamps[warm - 1]) / steps
    flops, peak = sum(counted[warm:warm + steps]) / steps, device_peak(ctx)
    out = {**ran(parts[3], bsz, n), "seq_len": seq, "step_s": round(dt, 4), "steps": steps}
    out["tokens_per_s"] = round(out["batch"] * seq / dt, 1)  # of the batch that ran, not the one asked
    if not ctx.cuda:
        return {"ok": None, **out, "note": "ran on CPU: memory and MFU need CUDA"}
    mem = torch.cuda.memory_stats()
    out.update(peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1),
               peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 1),
               device_memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
               alloc_retries=int(mem.get("num_alloc_retries", 0)), ooms=int(mem.get("num_ooms", 0)),
               mfu=round(flops / dt / peak, 4) if peak else None, step_tflop=float(f"{flops / 1e12:.4g}"))
    # the fitted recipe's steps under the device's memory without a single allocator retry (each one frees
    # the cache and synchronises the device): the plan's promise, measured
    fits = out["peak_reserved_gib"] <= out["device_memory_gib"]
    return {"ok": out["alloc_retries"] == 0 and out["ooms"] == 0 and fits, **out}


@check(budget_s=30)
def check_host_gap(ctx: Ctx) -> dict:
    """The whole trainer in steady state as it really runs: telemetry on (publisher resolving events,
    recorder, monitors) and DDP with one rank, every sync recorded by thread (dflash.testing.CudaSyncLog)
    past iteration 100 (DDP's own logger reads CUDA events on iterations 1-10 and every 100th; the debug
    mode misses that sync, a host gap shows it). Fails on a sync in a worker thread; the main thread's
    reads of the metric sums, once per telemetry interval by design, are counted. Reports the drafter
    thread's largest gap between two steps against the median, and the step it happened at."""
    from dflash.testing import CudaSyncLog, run_steady
    from dflash.train import distributed
    from dflash.train.config.schema import make_config

    dev = "cuda" if ctx.cuda else "cpu"
    warm, steady = (2, 4) if ctx.smoke else (12, 100)
    cfg = make_config({}, dict(target="tiny", data="demo", run_dir=str(ctx.tmp / "host-gap"), batch_size=4,
                               num_anchors=16, max_steps=1, drafter_layers=1, target_devices=[dev],
                               drafter_device=dev, max_seq_len=256, socket_dir=str(ctx.tmp / "socks")))
    stamps: list[tuple[int, float]] = []

    def join_ranks(trainer) -> None:  # (called inside the `with` below, where `world` is bound)
        trainer.dist = d = world()
        distributed.init(d, trainer.cfg.pipeline.drafter_device, 120.0)

    def on_step(trainer, step: int) -> None:
        stamps.append((step, time.perf_counter()))

    log = CudaSyncLog()
    with one_rank_world() as world:
        try:
            run_steady(cfg, warm, steady, lambda: log, telemetry=True, join_ranks=join_ranks, after_step=on_step)
            result = _worker_syncs(log)
        except RuntimeError as e:
            result = _where(str(e))
    steady_stamps = [(s, t) for s, t in stamps if s > warm]
    gaps = sorted(((t1 - t0) * 1e3, s1) for (_, t0), (s1, t1) in zip(steady_stamps, steady_stamps[1:], strict=False))
    # the main thread's once-per-interval reads of the metric sums synchronise by design: counted, not failed
    out: dict = {"sync_debug": result, "other_threads_syncs": {t: len(w) for t, w in log.others().items()},
                 "steady_steps": steady, "ddp_world": 1, "telemetry": True}
    if gaps:
        median = gaps[len(gaps) // 2][0]
        worst, at = gaps[-1]
        out.update(median_step_ms=round(median, 2), largest_step_ms=round(worst, 2), largest_at_step=at,
                   largest_over_median=round(worst / max(median, 1e-9), 2))
    if not ctx.cuda:
        return {"ok": None, **out, "note": "ran on CPU: the sync assertion needs CUDA"}
    return {"ok": result == "no sync" and out.get("largest_over_median", 99) < 3.0, **out}


@check(budget_s=40)  # writes and hashes ~12.6 GB
def check_checkpoint_1b(ctx: Ctx) -> dict:
    """One asynchronous save of a 1B-parameter drafter (5 layers at Qwen3-8B's shapes, with its Adam
    state): the step times around it against the median step, the save's own duration and size."""
    try:
        from dflash.train.checkpoint.writer import CheckpointWriter, HostSnapshot
    except ImportError:
        raise Skip("no asynchronous checkpoint writer in this checkout") from None
    from dflash.checkpoint_files import save_checkpoint
    from dflash.train.device import binding as devices

    shape = TINY if ctx.smoke else {**QWEN3_8B, "vocab_size": 32768}
    target = make_target(ctx, shape, layers=2)
    source, tstage, dstage, cfg, stats = make_parts(ctx, target, 1 if ctx.smoke else 5, 512 if not ctx.smoke else 96,
                                                    32 if not ctx.smoke else 6, 1, samples=4)
    params = sum(p.numel() for p in dstage.drafter.parameters())
    run_dir = ctx.tmp / "ckpt-1b"
    done: list = []
    writer = CheckpointWriter(lambda step, state: save_checkpoint(run_dir, step, state, keep=1), done.append,
                              devices.thread_device(dstage.device))
    snapshot = HostSnapshot()
    save_at, steps = 6, 16
    handed: list[float] = []

    def on_step(step: int) -> None:
        if step == save_at:
            t0 = time.perf_counter()
            state = {"drafter": dstage.drafter.state_dict(), "optimizer": dstage.optimizer.state_dict(), "step": step}
            host, ready = snapshot.take(state)
            writer.submit(step, host, ready, snapshot.nbytes)
            handed.append(time.perf_counter() - t0)

    stamps = run_pipeline(source, tstage, dstage, cfg, stats, steps=steps, pipeline=True, on_step_extra=on_step,
                          timeout_s=240)
    writer.close()
    step_s = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    median = sorted(step_s[2:])[len(step_s[2:]) // 2]
    around = step_s[save_at - 1:save_at + 3]  # the step that handed the save over and the next ones
    w = done[0] if done else None
    out = {"drafter_params": params, "bytes": w.nbytes if w else None, "save_s": round(w.seconds, 2) if w else None,
           "error": str(w.error) if w and w.error else None, "handover_s": round(handed[0], 3) if handed else None,
           "median_step_s": round(median, 4), "steps_around_save_s": [round(x, 4) for x in around],
           "longest_step_around_save_vs_median": round(max(around) / median, 2) if around else None}
    ok = w is not None and w.error is None and out["longest_step_around_save_vs_median"] <= 2.0
    return {"ok": ok if ctx.cuda else None, **out}


@check(budget_s=12)
def check_thread_device(ctx: Ctx) -> dict:
    """The device every CUDA-touching thread of a real run bound (devices.bindings()): the pipeline's
    workers, the telemetry publisher, the main thread (evaluation, checkpoints) and the checkpoint
    writer; all must be the trainer's GPU (on a multi-GPU rank, never GPU 0 by default)."""
    from dflash.train.config.schema import make_config
    from dflash.train.device import binding as devices
    from dflash.train.trainer import Trainer

    dev = "cuda:0" if ctx.cuda else "cpu"
    cfg = make_config({}, dict(target="tiny", data="demo", run_dir=str(ctx.tmp / "threads"), batch_size=2,
                               num_anchors=8, max_steps=6, log_every=1e9, eval_prompts=0, checkpoint_every=1e9,
                               drafter_layers=1, target_devices=[dev], drafter_device=dev, max_seq_len=128,
                               socket_dir=str(ctx.tmp / "socks-t"), metrics_linger=0.0))
    trainer = Trainer(cfg, log=lambda s: None)
    code = trainer.run()
    bound = devices.bindings()
    expected = ["MainThread", "batch-producer", "target-0", "drafter-0", "dflash-telemetry"]
    try:
        from dflash.train.checkpoint.writer import WRITER_THREAD

        expected.append(WRITER_THREAD)
    except ImportError:
        pass
    wrong = {name: bound.get(name) for name in expected if bound.get(name) != dev}
    return {"ok": code == 0 and not wrong, "expected": dev, "bindings": bound, "wrong": wrong}


# --------------------------------------------------------------------------------------------------
# What the DSpark, data and memory-plan changes added: DFlash2 at a real vocabulary, the FP8 cache into a
# CUDA drafter, sampled verification, Muon at the real shape, DSpark, and rollback under a trained drafter
# --------------------------------------------------------------------------------------------------

#: a step's measured peak may exceed the memory plan's prediction by this share at most: the plan fills
#: HEADROOM (90%) of the free memory and leaves the rest for what it cannot see, so a peak above the plan
#: by more than 1 / 0.9 - 1 = 11% eats into memory the plan promised was free
PLAN_MARGIN = 1 / 0.9 - 1


def _peak_against_plan(ctx: Ctx, dstage, target, cfg, run) -> dict:
    """The memory plan's prediction for the batch and anchors that ran (dflash.train.device.memory.plan_step:
    what the steps add to the allocated memory) against what ``run()`` (the steps) really added at its
    peak, with the allocator's retries over those steps; on the CPU the plan only (nothing is measured)."""
    import torch

    from dflash.train.device.memory import GIB, plan_step

    fit, model = plan_step(dstage, target, [target.device], seq_len=cfg.data.max_seq_len,
                           batch_size=cfg.data.batch_size, num_anchors=cfg.model.num_anchors,
                           hs_queue_size=cfg.pipeline.hs_queue_size, free=1 << 60)  # (nothing shrinks)
    out = {"plan_gib": round(fit.need / GIB, 3), "plan_fixed_gib": round(fit.fixed / GIB, 3),
           "plan_per_sample_gib": round(fit.per_sample / GIB, 3),
           "activation_kb_per_query_token_layer": round(model.per_query_token_layer / 1e3, 1)}
    if ctx.cuda:
        _sync(ctx)
        torch.cuda.reset_peak_memory_stats()
        base, retries = torch.cuda.memory_allocated(), torch.cuda.memory_stats().get("num_alloc_retries", 0)
    run()
    if ctx.cuda:
        _sync(ctx)
        added = torch.cuda.max_memory_allocated() - base
        out.update(measured_gib=round(added / GIB, 3), measured_over_plan=round(added / fit.need, 3),
                   margin=round(PLAN_MARGIN, 3),
                   alloc_retries=int(torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries))
    return out


@check(budget_s=15)
def check_dflash2_vocab(ctx: Ctx) -> dict:
    """DFlash2 (drafter type dflash2: the candidate selector) at Qwen3's vocabulary of 151,936, where its
    LM-head and selector passes really run in chunks (dflash/objectives/head.py, chunk_rows): pipelined
    steps of the real stages beside a 2-layer Qwen3-8B-shaped target on the same GPU, their measured
    peak against the memory plan's prediction for the batch that ran, the allocator's retries and the
    step time. Fails (CUDA) when the peak exceeds the plan by more than PLAN_MARGIN, on any allocator
    retry, or when the head was not chunked."""
    import math

    from dflash.objectives.head import chunk_rows

    vocab = QWEN3_8B["vocab_size"]
    shape = {**TINY, "vocab_size": vocab} if ctx.smoke else QWEN3_8B
    seq, n, bsz = (160, 16, 2) if ctx.smoke else (2048, 256, 4)
    target = make_target(ctx, shape, layers=2)
    source, tstage, dstage, cfg, stats = make_parts(ctx, target, 1 if ctx.smoke else 2, seq, n, bsz, samples=8,
                                                    drafter_type="dflash2")
    out: dict = {"vocab": vocab, "seq_len": seq, **ran(cfg, bsz, n), "drafter": type(dstage.drafter).__name__}
    bs = dstage.drafter.config.block_size
    rows = out["batch"] * out["anchors"] * (bs - 1)
    out.update(head_rows=rows, chunk_rows=chunk_rows(vocab), chunks=math.ceil(rows / chunk_rows(vocab)))
    steps = 3 if ctx.smoke else 5
    stamps: list[float] = []

    def run() -> None:
        stamps.extend(run_pipeline(source, tstage, dstage, cfg, stats, steps=steps, pipeline=True, timeout_s=120))

    out.update(_peak_against_plan(ctx, dstage, target, cfg, run))
    out["step_s"] = round((stamps[-1] - stamps[0]) / (steps - 1), 4)  # the first step allocates; not timed
    if not ctx.cuda:
        return {"ok": None if out["chunks"] > 1 else False, **out,
                "note": "ran on CPU at vocabulary 151,936 (chunked); the peak against the plan needs CUDA"}
    ok = out["measured_over_plan"] <= 1 + PLAN_MARGIN and out["alloc_retries"] == 0 and out["chunks"] > 1
    return {"ok": ok, **out}


@check(budget_s=8)
def check_fp8_cache_cuda(ctx: Ctx) -> dict:
    """The FP8 hidden-state cache into a CUDA drafter: `dflash data cache --dtype fp8 --fp8-scales tap` writes
    16 rows of the demo data on the host (the tiny target, on the CPU); the trainer's own stages read them
    back (reader threads dequantise into page-locked bf16, the side stream copies them to the GPU) and the
    states on the device equal the CPU's dequantisation of the same files bit for bit; then the whole
    trainer trains from the cache with every sync recorded by thread. Fails when a state differs, a worker
    thread synchronised in the steady steps (CUDA), or the training did not finish."""
    import torch

    from dflash.cli import main as cli
    from dflash.data.cache_format import dequantize_fp8, read_stored, sample_path
    from dflash.targets import make_target as target_for
    from dflash.testing import CudaSyncLog, run_steady
    from dflash.train.config.schema import make_config, updated
    from dflash.train.distributed import Dist
    from dflash.train.run.build import build

    root, rows = ctx.tmp / "fp8-cache", 16
    code = cli(["data", "cache", "--target", "tiny", "--data", "demo", "--out", str(root), "--max-samples", str(rows),
                "--dtype", "fp8", "--fp8-scales", "tap", "--batch-size", "8", "--no-telemetry"])
    if code != 0:
        return {"ok": False, "error": f"dflash data cache exited {code}"}
    dev = "cuda" if ctx.cuda else "cpu"
    cfg = make_config({}, dict(target="tiny", hidden_states=str(root), run_dir=str(ctx.tmp / "fp8-run"), batch_size=4,
                               num_anchors=8, max_steps=10**6, drafter_layers=1, target_devices=[dev],
                               drafter_device=dev, max_seq_len=256, eval_prompts=0, telemetry=False))
    target = target_for(cfg, dev)
    try:
        parts = build(cfg, Dist(), target, log=lambda line: None)
        stage, source, layout = parts.targets[0], parts.source, target.layout
        diffs, compared = [], 0
        for i in range(3):
            batch = source(i)
            hb = stage(batch)
            if hb.ready is not None:
                torch.cuda.current_stream().wait_event(hb.ready)
            got = hb.hidden.cpu()
            for r, p in enumerate(batch.sample_ids):
                q, _ids, scales = read_stored(sample_path(root, target.file_rows[p]))
                want = dequantize_fp8(q, scales, target.dtype)[:, list(layout.slots)].flatten(1)
                n = min(want.shape[0], got.shape[1])
                diffs.append(int((got[r, :n] != want[:n]).sum()))
                compared += want[:n].numel()
    finally:
        target.close()
    out: dict = {"rows": rows, "scales": "per tap", "dtype_on_device": str(hb.hidden.dtype).removeprefix("torch."),
                 "device": str(hb.hidden.device), "values_compared": compared, "values_differing": sum(diffs)}
    warm, steady = (2, 3) if ctx.smoke else (4, 12)
    log = CudaSyncLog()
    try:
        run_steady(updated(cfg, run_dir=str(ctx.tmp / "fp8-train")), warm, steady, lambda: log)
        out["sync_debug"] = _worker_syncs(log)
    except RuntimeError as e:
        out["sync_debug"] = _where(str(e))
    out["steady_steps"] = steady
    ok = sum(diffs) == 0 and compared > 0 and out["sync_debug"] == "no sync"
    if not ctx.cuda:
        return {"ok": None if ok else False, **out, "note": "ran on CPU: the device copy and the sync assertion "
                "need CUDA"}
    return {"ok": ok, **out}


def _sampling_target(ctx: Ctx):
    """The distribution test's target: a random 2-layer Qwen3 of 8 tokens with sharpened logits, both
    layers tapped, in float32 (the test's precision) on the check's device."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash.targets.hf import HFTarget

    cfg = Qwen3Config(vocab_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_id=1,
                      bos_token_id=None, pad_token_id=2)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # (a random init is near uniform: sharpened, the spread comes from the temperature)
        model.get_output_embeddings().weight.mul_(8.0)
    return HFTarget(model.to(ctx.device).eval().requires_grad_(False), None, [0, 1])


@check(budget_s=11)
def check_eval_temperature(ctx: Ctx) -> dict:
    """Speculative sampling on the device is distributed as the target's own sampling: the CPU suite's test
    (tests/test_eval_sampling.py, its pieces in dflash.testing) run where the verifier draws on CUDA, with
    generators on the GPU: the first 3 tokens of 300 seeded decodes at temperature 2, top-k 3, for a
    DFlash2 and a DSpark drafter, against the exact distribution by Pearson's chi-square at 0.1%. Fails
    when a statistic reaches its critical value, or when drafts were never kept or never rejected (one of
    the two paths did not run)."""
    from dflash.testing import (
        SAMPLING_SAMPLES,
        SAMPLING_TOKENS,
        SAMPLING_TOP_K,
        chi_square,
        exact_continuations,
        sampling_drafter,
        speculative_counts,
    )

    target = _sampling_target(ctx)
    expected = exact_continuations(target)
    out: dict = {"continuations": len(expected), "samples": SAMPLING_SAMPLES, "significance": 0.001}
    ok = len(expected) == SAMPLING_TOP_K ** SAMPLING_TOKENS
    for kind in ("dflash2", "dspark"):
        t0 = time.perf_counter()
        counts, accepted = speculative_counts(sampling_drafter(target, kind), target)
        stat, critical = chi_square(counts, expected, SAMPLING_SAMPLES)
        both = any(accepted) and not all(accepted)
        out[kind] = {"chi_square": round(stat, 2), "critical": round(critical, 2), "rounds": len(accepted),
                     "rounds_with_a_kept_draft": sum(a > 0 for a in accepted),
                     "seconds": round(time.perf_counter() - t0, 2)}
        ok = ok and stat < critical and both
    return {"ok": ok, **out, "device": str(target.device)}


@check(budget_s=6)
def check_muon_real_shape(ctx: Ctx) -> dict:
    """A Muon step (the trainer's optimizer through its public builder, dflash.objectives.optim.build_optimizer,
    with its learning rates given, not defaulted) on the 8B drafter's real shapes: 5 layers at hidden 4,096,
    intermediate 12,288, in bf16, with the trainer's device-side skip flag set: device time per step on the
    thread's own stream (CUDA events), no host sync in the timed steps (sync debug mode "error"), and the
    memory the steps add (gradients, Muon's momentum, AdamW's moments for the rest, Newton-Schulz's
    temporaries) against what the memory plan counts for the first step (first_step_bytes). Fails on a
    sync, a peak above the plan, or weights that did not move."""
    import torch
    from transformers import Qwen3Config

    from dflash.model.drafter import DFlashDrafter, DrafterConfig, default_target_layer_ids
    from dflash.objectives.optim import build_optimizer
    from dflash.train.config import OptimSettings
    from dflash.train.device.memory import GIB, first_step_bytes

    shape = TINY if ctx.smoke else QWEN3_8B
    tcfg = Qwen3Config(**shape)
    dcfg = DrafterConfig.for_target(tcfg, num_layers=5, target_layer_ids=default_target_layer_ids(
        tcfg.num_hidden_layers, 5), mask_token_id=0)
    dev = torch.device(ctx.device)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        drafter = DFlashDrafter(dcfg).to(dtype)
    params = sum(p.numel() for p in drafter.parameters())
    _sync(ctx)
    base = torch.cuda.memory_allocated() if ctx.cuda else 0
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    # explicit rates: what this check proves does not hang on the defaults of the day
    opt = build_optimizer(drafter, OptimSettings(optimizer="muon", lr=6e-4, muon_lr=6e-3), dev)
    opt.found_inf = torch.zeros((), device=dev)  # the trainer's skip flag (health/nonfinite.py), 0: take the step
    g = torch.Generator(device=dev).manual_seed(1)
    for p in drafter.parameters():
        p.grad = torch.randn(p.shape, generator=g, device=dev, dtype=p.dtype) * 1e-2
    before = next(p for p in drafter.parameters() if p.ndim == 2).detach().clone()
    opt.step()  # the first step makes the optimizer's state
    steps = 2 if ctx.smoke else 5
    side = torch.cuda.Stream(dev) if ctx.cuda else None
    out: dict = {"hidden": shape["hidden_size"], "intermediate": shape["intermediate_size"], "layers": 5,
                 "dtype": str(dtype).removeprefix("torch."), "params": params,
                 "optimizers": sorted(getattr(opt, "named", {"single": opt}))}
    t0 = time.perf_counter()
    if side is not None:
        _sync(ctx)
        side.wait_stream(torch.cuda.current_stream(dev))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if side is not None:
                start.record()
            for _ in range(steps):
                opt.step()
            if side is not None:
                end.record()
        out["sync"] = "no sync"
    except RuntimeError as e:
        out["sync"] = _where(traceback.format_exc()) if "synchroniz" in str(e) else f"{type(e).__name__}: {e}"[:300]
    finally:
        if side is not None:
            torch.cuda.set_sync_debug_mode(0)
    _sync(ctx)
    out["host_s_per_step"] = round((time.perf_counter() - t0) / steps, 4)
    moved = float((next(p for p in drafter.parameters() if p.ndim == 2).detach() - before).abs().max())
    out["max_change"] = moved
    if not ctx.cuda:
        return {"ok": None if moved > 0 else False, **out, "note": "ran on CPU at tiny shapes: time, sync and "
                "memory need CUDA"}
    plan, added = first_step_bytes(drafter), torch.cuda.max_memory_allocated() - base
    out.update(device_ms_per_step=round(start.elapsed_time(end) / steps, 2), plan_gib=round(plan / GIB, 2),
               measured_gib=round(added / GIB, 2), measured_over_plan=round(added / plan, 3))
    return {"ok": out["sync"] == "no sync" and added <= plan and moved > 0, **out}


def _train_tiny(ctx: Ctx, name: str, warm: int, steady: int, **recipe):
    """The whole trainer on the built-in tiny target and the demo data (``recipe``: other settings) for
    warm + steady steps, every sync of the steady ones recorded by thread: (the finished Trainer, 'no
    sync' or where a worker synchronised)."""
    from dflash.testing import CudaSyncLog, run_steady
    from dflash.train.config.schema import make_config

    dev = "cuda" if ctx.cuda else "cpu"
    cfg = make_config({}, dict(target="tiny", data="demo", run_dir=str(ctx.tmp / name), batch_size=4,
                               num_anchors=16, max_steps=1, drafter_layers=1, target_devices=[dev],
                               drafter_device=dev, max_seq_len=256, **recipe))
    log = CudaSyncLog()
    trainer = run_steady(cfg, warm, steady, lambda: log)
    return trainer, _worker_syncs(log)


def _speculative(ctx: Ctx, trainer, prompts: int, tokens: int):
    """The trained drafter (a bf16 copy on CUDA, as `dflash eval` loads an export) decoding the demo
    prompts greedily against the tiny target, with the lossless check."""
    import copy

    import torch

    from dflash.data import load_prompts
    from dflash.eval.speculative import evaluate
    from dflash.targets import load_target

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    target = load_target("tiny", device=ctx.device, dtype=dtype)
    drafter = copy.deepcopy(trainer.drafter.drafter).to(ctx.device, dtype).eval()
    return evaluate(drafter, target, load_prompts("demo", target.tokenizer, limit=prompts), max_new_tokens=tokens)


@check(budget_s=9)
def check_dspark(ctx: Ctx) -> dict:
    """DSpark (drafter type dspark: the Markov head drafting left to right from the anchor's slot) trains on
    the device through the whole trainer, every sync of the steady steps recorded by thread, and its
    semi-autoregressive draft is lossless under greedy verification. Fails on a worker's sync (CUDA), a
    training that did not finish, or a decode that differs from the target's own."""
    warm, steady = (2, 3) if ctx.smoke else (4, 16)
    trainer, syncs = _train_tiny(ctx, "dspark", warm, steady, drafter_type="dspark")
    r = _speculative(ctx, trainer, 2 if ctx.smoke else 3, 16 if ctx.smoke else 24)
    out = {"drafter": type(trainer.drafter.drafter).__name__, "steps": trainer.state.step, "sync_debug": syncs,
           "lossless": r.lossless, "mismatched_prompts": r.mismatched_prompts, "tau": r.tau, "prompts": r.num_prompts}
    ok = bool(r.lossless) and trainer.state.step == warm + steady
    if not ctx.cuda:
        return {"ok": ok or False, **out}
    return {"ok": ok and syncs == "no sync", **out}


#: a trained drafter must exercise the verifier's rollback this often for eval_lossless to pass on CUDA: rounds
#: that kept some drafts and rejected the rest (the cache cut inside the block, not at the anchor)
MIN_PARTIAL_ROUNDS = 20


@check(budget_s=22)
def check_eval_lossless(ctx: Ctx) -> dict:
    """`dflash eval`'s decode loop with a drafter trained on the device (the whole trainer on the tiny
    target and the demo data; a random one accepts almost nothing, so the verifier's rollback past kept
    drafts barely runs), in bf16 against the bf16 target: the speculative output equals the target's own
    greedy output, and the rounds are counted: kept and rejected draft positions, and rounds that kept some
    drafts and rejected the rest (each a rollback to a position inside the block). Fails when any prompt
    differs, or (CUDA) when fewer than MIN_PARTIAL_ROUNDS rounds rolled back inside the block."""
    warm, steady = (10, 10) if ctx.smoke else (50, 350)
    trainer, _ = _train_tiny(ctx, "eval-trained", warm, steady)
    r = _speculative(ctx, trainer, 2 if ctx.smoke else 8, 32 if ctx.smoke else 48)
    hist = r.acceptance_histogram
    n = len(hist) - 1 if len(hist) > 1 else 0  # drafts per block: the last bin is "all kept"
    kept = sum(k * c for k, c in enumerate(hist))
    rejected = sum((n - k) * c for k, c in enumerate(hist))
    partial = sum(hist[1:n])
    out = {"trained_steps": trainer.state.step, "lossless": r.lossless, "mismatched_prompts": r.mismatched_prompts,
           "near_tie_prompts": getattr(r, "near_tie_prompts", None), "tau": r.tau, "prompts": r.num_prompts,
           "rounds": sum(hist), "kept_positions": kept, "rejected_positions": rejected, "partial_rounds": partial,
           "min_partial_rounds": MIN_PARTIAL_ROUNDS, "acceptance_histogram": hist}
    if not ctx.cuda:
        return {"ok": bool(r.lossless), **out, "note": "on CPU a short training; the rollback count is held on CUDA"}
    return {"ok": bool(r.lossless) and partial >= MIN_PARTIAL_ROUNDS, **out}

#: the checks by importance, which is their running order: a run cut short has answered what matters most
IMPORTANCE = (
    "prewarm", "flex_uneven", "host_gap", "sync_free", "thread_device", "device_shares",
    "flex_vs_sdpa", "memory_recipe", "dflash2_vocab", "throughput", "fp8_cache_cuda", "eval_temperature",
    "muon_real_shape", "dspark", "eval_lossless", "checkpoint_1b", "side_stream_copy",
    "cuda_spans", "ddp_resume", "compile_count", "verdicts", "launch_bound", "mask_build", "nvml",
)
CHECKS = {name: _REGISTERED[name] for name in IMPORTANCE}
assert len(CHECKS) == len(_REGISTERED), "a registered check is missing from IMPORTANCE"


def plan() -> dict:
    """The checks in running order with their budgets (what --plan prints); with each child's start
    allowance they fit the total, which is the whole run's wall time from the parent's start."""
    return {"checks": [{"name": name, "budget_s": budget} for name, (_, budget) in CHECKS.items()],
            "start_allowance_s": START_ALLOWANCE_S, "total_s": TOTAL_BUDGET_S}


# --------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------

#: What the checks import, loaded once by the parent before it forks one child per check: the ~5 s of
#: torch, transformers, Inductor and dflash imports are paid once, not in every child. None of them
#: initialises CUDA on import (a child forked after that could not use the GPU).
WARM_MODULES = (
    "torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.nn.attention.flex_attention",
    "transformers", "transformers.models.qwen3.modeling_qwen3",
    "dflash.model.blocks", "dflash.targets.hf", "dflash.train.trainer", "dflash.train.run.build",
    "dflash.train.run.pipeline", "dflash.testing", "dflash.telemetry.verdict.evidence",
    "dflash.telemetry.wire.system", "dflash.eval.speculative",
)
KILL_GRACE_S = 2.0  # between a child's stack dump at its limit and its kill


def share_inductor_cache(directory: Path) -> None:
    """Point this process and the children it starts at one Inductor cache, with compiled graphs
    (FX graph cache) and their backward (AOT autograd cache) kept there: what ``prewarm`` compiles,
    the later checks load. Called before torch is imported: Inductor reads these on import."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")


def warm_up() -> dict:
    """Import WARM_MODULES; a module that fails to import is reported (its checks fail on it later)."""
    t0, failed = time.perf_counter(), {}
    for module in WARM_MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - reported in the run's first line, and by each check
            failed[module] = f"{type(e).__name__}: {e}"[:300]
    return {"warmup_s": round(time.perf_counter() - t0, 2), "warmup_failed": failed}


def start_device(ctx: Ctx) -> float:
    """A forked child's CUDA context and first allocation (seconds), made before its check's clock starts."""
    if not ctx.cuda:
        return 0.0
    import torch

    t0 = time.perf_counter()
    torch.zeros(1, device=ctx.device)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def run_in_process(name: str, ctx: Ctx) -> dict:
    fn, _ = CHECKS[name]
    t0 = time.perf_counter()
    try:
        res = fn(ctx)
        status = {True: "pass", False: "fail", None: "skip"}[res.pop("ok")]
    except Skip as e:
        res, status = {"reason": str(e)}, "skip"
    except Exception as e:  # noqa: BLE001 - one check's failure must not hide the others
        res, status = {"error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()[-2000:]}, "error"
    return {"status": status, "seconds": round(time.perf_counter() - t0, 2), **res}


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _die_with(parent: int) -> None:
    """Have the kernel end this child when the parent dies (Linux; elsewhere a no-op): a parent stopped
    at the call's limit must not leave a check holding the GPU."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # (the parent died before the line above)
        os._exit(1)


def _child(name: str, ctx: Ctx, limit_s: float, result: Path, log: Path, parent: int) -> NoReturn:
    """The forked child: its output into ``log``, every thread's stack dumped there at ``limit_s``
    (so a hang says where), the check's result into ``result``; it never returns to the parent's code."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: a kill at the limit takes its compile workers too
        _die_with(parent)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        faulthandler.dump_traceback_later(limit_s, exit=False)
        start_s = start_device(ctx)
        res = {**run_in_process(name, ctx), "start_s": round(start_s, 2)}
        part = result.with_suffix(".part")
        part.write_text(json.dumps(res, default=str))
        part.replace(result)
        code = 0
    finally:
        os._exit(code)


def run_forked(name: str, ctx: Ctx, limit_s: float) -> dict:
    """The check in a child forked from this warmed process, killed at ``limit_s`` (a sticky CUDA error
    or a hang stays inside it). A check that did not pass carries the tail of the child's output."""
    result, log = ctx.tmp / f"{name}.result.json", ctx.tmp / f"{name}.log"
    sys.stdout.flush()
    sys.stderr.flush()
    t0, parent = time.perf_counter(), os.getpid()
    pid = os.fork()
    if pid == 0:
        _child(name, ctx, limit_s, result, log, parent)
    with contextlib.suppress(OSError):
        os.setpgid(pid, pid)  # (also here: the parent may kill before the child ran its own setpgid)
    deadline = t0 + limit_s + KILL_GRACE_S
    status = None
    while status is None:
        done, wait_status = os.waitpid(pid, os.WNOHANG)
        if done:
            status = wait_status
        elif time.perf_counter() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"status": "timeout", "seconds": round(time.perf_counter() - t0, 2),
                    "limit_s": round(limit_s, 1), "log_tail": _tail(log)}
        else:
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # whatever the check left running
    if not result.exists():
        how = f"signal {-os.waitstatus_to_exitcode(status)}" if os.WIFSIGNALED(status) else \
            f"exit {os.waitstatus_to_exitcode(status)}"
        return {"status": "error", "seconds": round(time.perf_counter() - t0, 2),
                "error": f"the child ended ({how}) before reporting", "log_tail": _tail(log)}
    res = json.loads(result.read_text())
    if res["status"] not in ("pass", "skip"):
        res["log_tail"] = _tail(log)
    return res


class Lines:
    """The run's report as JSON lines, each written and flushed when it happens: the run's settings,
    each check as it begins and as it ends, the end. A run stopped at its limit leaves every finished
    check on disk; ``summarize`` derives the report from these lines, whole or cut short."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lines: list[dict] = []
        self._file = path.open("w") if path else None

    def write(self, kind: str, **fields) -> None:
        line = {"kind": kind, **fields}
        self.lines.append(line)
        if self._file is not None:
            self._file.write(json.dumps(line, default=str) + "\n")
            self._file.flush()

    def close(self) -> list[dict]:
        """The lines as written (read back from the file, when there is one)."""
        if self._file is None:
            return self.lines
        self._file.close()
        return read_lines(self.path)


def read_lines(path: Path) -> list[dict]:
    """A run's JSON lines; a last line cut mid-write (the run killed while writing it) is left out."""
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return lines


def summarize(lines: list[dict]) -> dict:
    """The report from a run's JSON lines: every check's result; a check begun and never finished is
    "cut", a planned one never begun is in ``not_run``; ``rerun`` is the --only that repeats the rest."""
    head = next((line for line in lines if line.get("kind") == "run"), {})
    end = next((line for line in lines if line.get("kind") == "end"), None)
    checks: dict[str, dict] = {}
    for line in lines:
        if line.get("kind") == "begin":
            checks[line["name"]] = {"status": "cut", "seconds": None, "limit_s": line.get("limit_s"),
                                    "reason": "the run ended while this check ran"}
        elif line.get("kind") == "check":
            checks[line["name"]] = {k: v for k, v in line.items() if k not in ("kind", "name")}
    not_run = [name for name in head.get("checks", []) if name not in checks]
    counts: dict[str, int] = {}
    for r in checks.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    again = [name for name, r in checks.items() if r["status"] not in ("pass", "skip")] + not_run
    return {**{k: head.get(k) for k in ("device", "torch", "mode", "python", "transformers", "warmup_s")},
            "checks": checks, "not_run": not_run, "counts": counts, "finished": end is not None,
            "wall_s": end["wall_s"] if end else None, "rerun": "--only " + ",".join(again) if again else None,
            "ok": end is not None and not again}


def gpu_name() -> str:
    """GPU 0's name from NVML: asking torch would initialise CUDA in the parent, before its forks."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        finally:
            pynvml.nvmlShutdown()
        return name.decode() if isinstance(name, bytes) else name
    except Exception:  # noqa: BLE001 - the name is for the report only
        return "cuda:0"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the report here at the end (from --jsonl's lines)")
    ap.add_argument("--jsonl", metavar="PATH", help="write each check's result here as it finishes (flushed)")
    ap.add_argument("--summarize", metavar="JSONL",
                    help="print the report of a run's JSON lines (also a cut-short run's) and exit")
    ap.add_argument("--cpu-smoke", action="store_true", help="run what can run on CPU at tiny shapes")
    ap.add_argument("--only", help="comma-separated checks (default: all): " + ", ".join(CHECKS))
    ap.add_argument("--in-process", action="store_true", help="run checks in this process (default on CPU)")
    ap.add_argument("--isolate", action="store_true", help="one forked child per check (default on CUDA)")
    ap.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds for the whole run")
    ap.add_argument("--slack", type=float, default=1.0,
                    help="each check's time limit times this (a rerun of checks that timed out still working)")
    ap.add_argument("--plan", action="store_true", help="print the checks with their budgets as JSON and exit")
    ap.add_argument("--cache-dir", help="Inductor cache shared by the checks (default: a fresh one for this run)")
    args = ap.parse_args(argv)
    if args.plan:
        print(json.dumps(plan()))
        return 0
    if args.summarize:
        summary = summarize(read_lines(Path(args.summarize)))
        print(json.dumps(summary, indent=2))
        return 0 if summary["ok"] else 1
    names = [n.strip() for n in args.only.split(",")] if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"gpu_check: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-runs-") as tmp:
        share_inductor_cache(Path(args.cache_dir) if args.cache_dir else Path(tmp) / "inductor")
        # torch.cuda.is_available() through NVML: the runtime's answer would initialise CUDA in this
        # process, and the children forked after it could not use the GPU
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        import torch
        import transformers

        if not args.cpu_smoke and not torch.cuda.is_available():
            print("gpu_check: skipped: no CUDA device here (run it on the GPU box; --cpu-smoke checks the "
                  "script)")
            return 0
        device = "cpu" if args.cpu_smoke else "cuda:0"
        isolate = not args.in_process and (args.isolate or not args.cpu_smoke)
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        warm = warm_up() if isolate else {}
        lines = Lines(Path(args.jsonl) if args.jsonl else None)
        lines.write("run", device=gpu_name() if device != "cpu" else "cpu", torch=torch.__version__,
                    transformers=transformers.__version__, python=sys.version.split()[0],
                    mode="cpu-smoke" if args.cpu_smoke else "cuda", isolate=isolate, budget_s=args.budget,
                    checks=names, threads_at_fork=threading.active_count() if isolate else None, **warm)
        ctx = Ctx(device=device, smoke=args.cpu_smoke, tmp=Path(tmp))
        for name in names:
            left = args.budget - (time.monotonic() - start)
            if left < 5:
                lines.write("check", name=name, status="timeout", seconds=0.0, reason="total budget spent")
                continue
            limit = min(CHECKS[name][1] * (SMOKE_SLACK if args.cpu_smoke else args.slack) + START_ALLOWANCE_S, left)
            lines.write("begin", name=name, limit_s=round(limit, 1))
            res = run_forked(name, ctx, limit) if isolate else run_in_process(name, ctx)
            lines.write("check", name=name, **res)
            shown = {k: v for k, v in res.items() if k not in ("status", "seconds", "traceback", "log_tail")}
            line = f"{name:<17} {res['status']:<7} {res['seconds']:>7.1f}s  "
            print(line + json.dumps(shown, default=str)[:300], flush=True)
        lines.write("end", wall_s=round(time.monotonic() - start, 1))
    summary = summarize(lines.close())
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    counts = ", ".join(f"{n} {status}" for status, n in summary["counts"].items())
    again = f"; again: {summary['rerun']}" if summary["rerun"] else ""
    print(f"gpu_check: {counts} in {summary['wall_s']:.0f} s{again}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
