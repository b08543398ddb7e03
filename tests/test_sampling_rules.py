"""The stage rules and the sampled verdict, on stacks recorded from real trainers (tests/fixtures/stacks,
written by scripts/record_stacks.py) and on stacks and shares built to hit one rule each.

dflash-train: `dflash train` on the tiny CPU recipe, sampled from outside while its own telemetry timed
the same seconds; the sampled shares must agree with the measured ones within AGREEMENT (measured on this
recording: 2.0 points at 2,000 samples per thread; docs/sampling.md). speculators-dflash: speculators'
DFlash trainer on the CPU, whose stacks the rules were not written from.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dflash.telemetry.wire import verdicts, vocab
from dflash.telemetry.wire.protocol import MachineSample, Snapshot, decode
from dflash_tui.sampling.agreement import compare, measured_shares, worst_gap
from dflash_tui.sampling.rules import classify
from dflash_tui.sampling.samples import SamplesError, load_json, read_window
from dflash_tui.sampling.session import SampledSession
from dflash_tui.sampling.tally import Tally, margin
from dflash_tui.sampling.verdict import Observed, judge

FIXTURES = Path(__file__).parent / "fixtures" / "stacks"
#: the stated margin: a sampled share of `dflash train` is within this of the share its own spans measured
AGREEMENT = 0.03


def sampled(name: str) -> tuple[Snapshot, dict]:
    """The recording's one window as the sampled source would turn it into a snapshot (final: judged whole)."""
    d = FIXTURES / name
    meta = json.loads((d / "meta.json").read_text())
    window = read_window(d / "threads.speedscope.json.gz", d / "gil.speedscope.json.gz", rate_hz=meta["rate_hz"])
    session = SampledSession(1, command=meta["trainer"], started=meta["t0"], rate_hz=meta["rate_hz"],
                             window_s=meta["seconds"])
    session.add(window, t=meta["t1"])
    return session.closing(t=meta["t1"]), meta


def shares(snap: Snapshot) -> dict[str, dict[str, float]]:
    return {w: {c: st.share for c, st in cats.items()} for w, cats in snap.workers.items()}


def test_sampled_dflash_train_agrees_with_its_own_telemetry() -> None:
    snap, meta = sampled("dflash-train")
    assert snap.roles == {"batch-producer": "data", "target-0": "target", "drafter-0": "drafter"}
    assert snap.sampling is not None and snap.sampling.samples >= 1000
    frames = [decode(line) for line in gzip.decompress((FIXTURES / "dflash-train" / "telemetry.jsonl.gz").read_bytes())
              .splitlines()]
    measured = measured_shares(frames, meta["t0"], meta["t1"])
    rows = compare(shares(snap), measured)
    assert {r.worker for r in rows} == {"batch-producer", "target-0", "drafter-0"}
    assert worst_gap(rows) <= AGREEMENT, [(r.worker, r.category, round(r.diff, 3)) for r in rows[:4]]
    # the stages that hold the time are found, not only matched at zero
    big = {(r.worker, r.category) for r in rows if r.measured > 0.1}
    assert {("target-0", "target_forward"), ("drafter-0", "drafter_backward"), ("drafter-0", "drafter_forward"),
            ("target-0", "hs_queue_put")} <= big
    assert all(u < 0.02 for u in snap.untracked.values()), snap.untracked
    # dflash's own telemetry threads are the monitor's, not workers
    assert not set(snap.workers) & set(vocab.TELEMETRY_THREADS)


def test_sampled_speculators_training_names_its_stages() -> None:
    snap, _ = sampled("speculators-dflash")
    assert list(snap.workers) == ["MainThread"], "threads that only wait (tqdm, the queue feeder) are not workers"
    cats = shares(snap)["MainThread"]
    assert snap.roles["MainThread"] == "drafter"
    # its Muon optimizer's Newton-Schulz steps on the CPU are nearly all of its time
    assert cats["optimizer_step"] > 0.5 and cats["drafter_forward"] > 0 and cats["drafter_backward"] > 0
    assert cats.get("batch_queue_wait", 0) > 0, "its DataLoader"
    assert snap.untracked["MainThread"] < 0.05
    assert snap.bottleneck is not None and snap.bottleneck.verdict == verdicts.BALANCED.name
    assert "whole sampling" in snap.bottleneck.scope
    assert snap.sampling is not None and snap.sampling.gil_held is not None and 0 < snap.sampling.gil_held < 1



# --------------------------------------------------------------------------- single rules

PIPE = "/x/site-packages/dflash/train/run/pipeline.py"
QUEUE = "/usr/lib/python3.11/queue.py"
MODULE = "/x/site-packages/torch/nn/modules/module.py"


def test_a_queue_get_is_named_by_the_loop_that_waits() -> None:
    wait = [("Queue.get", QUEUE), ("Condition.wait", "/usr/lib/python3.11/threading.py")]
    assert classify([("Pipeline._target", PIPE), ("get", PIPE), *wait]) == "batch_queue_wait"
    assert classify([("Pipeline._drafter", PIPE), ("get", PIPE), *wait]) == "hs_queue_wait"
    assert classify([("Pipeline._target", PIPE), ("put", PIPE), ("Queue.put", QUEUE)]) == "hs_queue_put"
    assert classify([("worker", "/a/b.py"), *wait]) == "idle_wait"  # someone else's queue
    writer = "/x/site-packages/dflash/train/checkpoint/writer.py"
    assert classify([("CheckpointWriter._run", writer), *wait]) == "idle_wait"
    assert classify([("CheckpointWriter._run", writer), ("save", "/x/site-packages/torch/serialization.py")]) \
        == "checkpoint"


def test_host_syncs_and_collectives_win_inside_a_forward() -> None:
    fwd = [("train", "/a/train.py"), ("Module._call_impl", MODULE)]
    assert classify(fwd) == "drafter_forward"
    assert classify([*fwd, ("cudaStreamSynchronize", "/usr/lib/libcudart.so.12")]) == "host_sync"
    assert classify([*fwd, ("at::native::_local_scalar_dense_cuda", "/x/libtorch_cuda.so")]) == "host_sync"
    assert classify([*fwd, ("all_reduce", "/x/site-packages/torch/distributed/distributed_c10d.py")]) \
        == "collective_wait"
    bwd = [("train", "/a/train.py"), ("Tensor.backward", "/x/site-packages/torch/_tensor.py")]
    assert classify(bwd) == "drafter_backward"
    assert classify([("train", "/a/train.py"), ("AdamW.step", "/x/site-packages/torch/optim/adamw.py")]) \
        == "optimizer_step"
    assert classify([("train", "/a/train.py")]) is None  # untracked
    # dflash's step guard (its finiteness test around the optimizer's step) is the optimizer's step too
    step = [("DrafterStage.step", "/x/site-packages/dflash/train/run/stages.py")]
    assert classify([*step, ("NonFiniteGuard.step", "/x/site-packages/dflash/train/health/nonfinite.py")]) \
        == "optimizer_step"
    assert classify(step) == "h2d"


# Native stacks as `py-spy record --native` writes them (no GPU here: constructed to that shape, from
# py-spy's native_stack_trace.rs): outermost first, Python frames where the interpreter evaluated them,
# native frames named by their demangled C++ function without parameters, filed under their shared library.
TORCH_LIB = "/x/site-packages/torch/lib"
PY_BINDING = ("THPVariable_add", f"{TORCH_LIB}/libtorch_python.so")
DISPATCH = ("at::_ops::add_Tensor::call", f"{TORCH_LIB}/libtorch_cpu.so")
CUDA_OP = [("at::(anonymous namespace)::wrapper_CUDA_add_Tensor", f"{TORCH_LIB}/libtorch_cuda.so"),
           ("at::native::add_kernel", f"{TORCH_LIB}/libtorch_cuda.so"),
           ("at::native::gpu_kernel_impl<at::native::CUDAFunctor_add<float> >", f"{TORCH_LIB}/libtorch_cuda.so")]
CUDART = "/x/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
LIBCUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
C10_CUDA = f"{TORCH_LIB}/libc10_cuda.so"
ALLOC = "c10::cuda::CUDACachingAllocator::Native::"


def native(*inner: tuple[str, str]) -> list[tuple[str, str]]:
    """A target thread's forward down to `inner`, the innermost native frames."""
    return [("Pipeline._target", PIPE), ("TargetStage.__call__", "/x/site-packages/dflash/train/run/stages.py"),
            ("HFTarget.hidden_states", "/x/site-packages/dflash/targets/hf.py"), ("Module._call_impl", MODULE),
            ("forward", "/x/transformers/models/qwen3/modeling_qwen3.py"),
            PY_BINDING, DISPATCH, *inner]


def test_native_frames_sort_into_launch_sync_allocator_and_collective() -> None:
    launch = native(*CUDA_OP, ("at::native::launch_vectorized_kernel", f"{TORCH_LIB}/libtorch_cuda.so"),
                    ("cudaLaunchKernel", CUDART), ("cuLaunchKernel", LIBCUDA))
    assert classify(launch) == "kernel_launch"
    assert classify(native(*CUDA_OP, ("cudaLaunchKernel_ptsz", CUDART), ("0x7f3a9c2d41e0", LIBCUDA))) \
        == "kernel_launch"  # an unexported driver function py-spy could not name, below the launch
    assert classify(native(*CUDA_OP)) == "kernel_launch"  # the op's host side before its launch
    assert classify(native(("cudaGraphLaunch", CUDART), ("cuGraphLaunch", LIBCUDA))) == "kernel_launch"
    assert classify(native(("c10::cuda::CUDAStream::query", C10_CUDA), ("cudaEventRecord", CUDART))) \
        == "kernel_launch"
    grow = native(("at::native::empty_cuda", f"{TORCH_LIB}/libtorch_cuda.so"),
                  (ALLOC + "NativeCachingAllocator::malloc", C10_CUDA),
                  (ALLOC + "DeviceCachingAllocator::malloc", C10_CUDA),
                  (ALLOC + "(anonymous namespace)::ExpandableSegment::map", C10_CUDA),
                  ("cuMemMap", LIBCUDA))
    assert classify(grow) == "allocator"
    assert classify(native(("cudaFree", CUDART))) == "allocator"
    # a sync inside the allocator (freeing blocks whose events must complete) is the allocator's cost
    assert classify(native((ALLOC + "DeviceCachingAllocator::synchronize_and_free_events", C10_CUDA),
                           ("cudaEventSynchronize", CUDART))) == "allocator"
    for sync in ("cudaStreamSynchronize", "cuStreamSynchronize", "cudaDeviceSynchronize"):
        assert classify(native(("at::native::_local_scalar_dense_cuda", f"{TORCH_LIB}/libtorch_cuda.so"),
                               (sync, CUDART if sync.startswith("cuda") else LIBCUDA))) == "host_sync", sync
    nccl = [("c10d::ProcessGroupNCCL::allreduce", f"{TORCH_LIB}/libtorch_cuda.so"),
            ("ncclAllReduce", "/x/nvidia/nccl/lib/libnccl.so.2"), ("cudaLaunchKernel", CUDART)]
    assert classify(native(*nccl)) == "collective_wait"  # an NCCL kernel's launch is the collective's
    # the same op on the CPU stays the stage's compute: at::native alone does not mean CUDA
    assert classify(native(("at::native::add_kernel", f"{TORCH_LIB}/libtorch_cpu.so"))) == "target_forward"
    assert classify(native()) == "target_forward"  # without --native: the stage, as before


def test_the_heads_gradient_inside_the_forward_is_forward() -> None:
    """dflash's chunked LM head takes each chunk's gradient inside its forward span: the trainer times it as
    drafter_forward, so the sampler must too; the real backward through the same file stays backward."""
    head = "/x/site-packages/dflash/objectives/head.py"
    autograd = "/x/site-packages/torch/autograd/__init__.py"
    graph = "/x/site-packages/torch/autograd/graph.py"
    loss = [("DrafterStage.step", "/x/site-packages/dflash/train/run/stages.py"), ("head_rows", head)]
    assert classify([*loss, ("grad", autograd), ("_engine_run_backward", graph)]) == "drafter_forward"
    back = [("DrafterStage.step", "/x/site-packages/dflash/train/run/stages.py"),
            ("Tensor.backward", "/x/site-packages/torch/_tensor.py"), ("backward", autograd),
            ("_engine_run_backward", graph), ("_RowGradients.backward", head)]
    assert classify(back) == "drafter_backward"


# --------------------------------------------------------------------------- the verdict


def tally(n: int = 1000, gil: int = 0, **shares: float) -> Tally:
    """A thread's samples: each category's share of `n`, the rest untracked, in runs of 5 samples."""
    t = Tally(gil=gil)
    seq: list[str | None] = []
    for cat, share in shares.items():
        seq += [cat] * round(share * n)
    seq += [None] * (n - len(seq))
    for i in range(0, n, 5):
        t.add(seq[i:i + 5])
    return t


QUIET = MachineSample(cores=8, load1=1.0, busy_percent=150.0, others_percent=20.0)
BUSY = MachineSample(cores=2, load1=6.0, busy_percent=200.0, others_percent=180.0)


def test_verdict_input_bound_when_the_training_thread_waits_on_its_loader() -> None:
    o = Observed({"MainThread": tally(drafter_forward=0.3, drafter_backward=0.2, batch_queue_wait=0.45)},
                 {"MainThread": 0.5}, process_cpu=50.0, machine=QUIET)
    b = judge(o)
    assert b.verdict == verdicts.INPUT_BOUND.name and "45%" in b.reason
    assert b.evidence["training.batch_queue_wait"] == pytest.approx(0.45)


def test_verdict_cpu_starved_and_gil_bound_need_their_evidence() -> None:
    busy = {"MainThread": tally(gil=150, drafter_forward=0.5, drafter_backward=0.3, optimizer_step=0.1)}
    starved = judge(Observed(busy, {"MainThread": 0.2}, process_cpu=20.0, machine=BUSY))
    assert starved.verdict == verdicts.CPU_STARVED.name
    # the same thread off the CPU, on a machine with idle cores, while another thread holds the GIL
    gil = judge(Observed(busy, {"MainThread": 0.2}, process_cpu=100.0, machine=QUIET, gil_held=0.95))
    assert gil.verdict == verdicts.GIL_BOUND.name and gil.evidence["gil.held"] == 0.95
    # ... but not when it was on the CPU all along, nor without a GIL record
    assert judge(Observed(busy, {"MainThread": 0.9}, process_cpu=100.0, machine=QUIET, gil_held=0.95)).verdict \
        == verdicts.BALANCED.name
    calm = Observed(busy, {"MainThread": 0.2}, process_cpu=100.0, machine=QUIET)
    assert judge(calm).verdict == verdicts.BALANCED.name


def test_verdict_launch_bound_when_a_stage_mostly_feeds_its_gpu() -> None:
    """With native frames: the training thread (or the target thread a drafter waits for) spends most of
    its samples launching kernels or in the allocator; syncs do not count (the GPU has work then)."""
    launching = {"MainThread": tally(kernel_launch=0.45, allocator=0.15, drafter_forward=0.2, drafter_backward=0.1,
                                     optimizer_step=0.05)}
    b = judge(Observed(launching, {"MainThread": 0.95}, process_cpu=100.0, machine=QUIET))
    assert b.verdict == verdicts.LAUNCH_BOUND.name
    assert b.evidence["launching.kernel_launch"] == pytest.approx(0.45) and b.evidence["launching.allocator"] \
        == pytest.approx(0.15)
    assert "the training thread (MainThread) spends 45% of its samples launching kernels" in b.reason
    assert "(balanced by its samples)" in b.reason and "CUDA graphs" in b.reason
    # below half of its samples, or in syncs instead (the thread waits for a GPU that has work): balanced
    fed = {"MainThread": tally(kernel_launch=0.3, allocator=0.1, drafter_forward=0.4, drafter_backward=0.15)}
    assert judge(Observed(fed, {"MainThread": 0.95}, machine=QUIET)).verdict == verdicts.BALANCED.name
    syncing = {"MainThread": tally(host_sync=0.6, kernel_launch=0.2, drafter_forward=0.1, drafter_backward=0.05)}
    assert judge(Observed(syncing, {"MainThread": 0.95}, machine=QUIET)).verdict == verdicts.BALANCED.name
    # a thread kept off its core leaves its GPU idle too: the machine is the cause, CPU-starved wins
    assert judge(Observed(launching, {"MainThread": 0.2}, process_cpu=20.0, machine=BUSY)).verdict \
        == verdicts.CPU_STARVED.name
    # input-bound stays: the GPU idles because nothing comes in
    starving = {"MainThread": tally(batch_queue_wait=0.3, kernel_launch=0.55, drafter_forward=0.1)}
    assert judge(Observed(starving, {"MainThread": 0.7}, machine=QUIET)).verdict == verdicts.INPUT_BOUND.name


def test_a_drafter_waiting_for_hidden_states_is_explained_by_its_launching_target() -> None:
    """dflash train sampled with --native: the drafter thread waits for hidden states, which alone says
    nothing (unknown); when the target thread that feeds it is in launches, that is the verdict."""
    waiting = tally(hs_queue_wait=0.6, drafter_forward=0.2, drafter_backward=0.1, optimizer_step=0.05)
    target = tally(kernel_launch=0.55, allocator=0.1, target_forward=0.25, hs_queue_put=0.02)
    b = judge(Observed({"drafter-0": waiting, "target-0": target}, {}, machine=QUIET))
    assert b.verdict == verdicts.LAUNCH_BOUND.name and "a target thread (target-0)" in b.reason
    assert "(unknown by its samples)" in b.reason and b.evidence["training.hs_queue_wait"] == pytest.approx(0.6)
    calm = tally(kernel_launch=0.1, target_forward=0.8, hs_queue_put=0.02)
    assert judge(Observed({"drafter-0": waiting, "target-0": calm}, {}, machine=QUIET)).verdict \
        == verdicts.UNKNOWN.name
    # a training thread waiting for the other ranks: a target thread in launches explains nothing of that
    ranks = tally(collective_wait=0.6, drafter_forward=0.2, drafter_backward=0.1)
    assert judge(Observed({"drafter-0": ranks, "target-0": target}, {}, machine=QUIET)).verdict \
        == verdicts.UNKNOWN.name


def test_verdict_says_when_it_cannot_judge() -> None:
    few = judge(Observed({"MainThread": tally(n=10, drafter_forward=1.0)}, {}))
    assert few.verdict == verdicts.UNKNOWN.name and "cannot judge yet" in few.reason
    nobody = judge(Observed({"writer": tally(idle_wait=0.5, checkpoint=0.5)}, {}))
    assert nobody.verdict == verdicts.UNKNOWN.name and "no training thread" in nobody.reason
    waits = judge(Observed({"MainThread": tally(drafter_forward=0.3, collective_wait=0.5)}, {}))
    assert waits.verdict == verdicts.UNKNOWN.name and "collective_wait" in waits.reason


def test_margin_and_run_lengths() -> None:
    assert margin(2500) == pytest.approx(0.0196)
    t = Tally()
    t.add(["a", "a", "a", None, "a", "b", "b"])
    st = t.stats(0.01)
    assert st["a"].n == 2 and st["a"].total == pytest.approx(0.04) and st["a"].max == pytest.approx(0.03)
    assert st["a"].share == pytest.approx(4 / 7) and t.share(None) == pytest.approx(1 / 7)


def test_speedscope_files_are_read_with_bounds(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"profiles": [], "shared": {"frames": []}}) + " " * 100)
    with pytest.raises(SamplesError, match="limit"):
        load_json(big, limit=50)
    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b" " * 10_000))
    with pytest.raises(SamplesError, match="decompressed"):
        load_json(bomb, limit=1000)
    bad = tmp_path / "bad.json"
    bad.write_text('{"profiles": [{"name": "Thread 7 \\"x\\"", "samples": [[0, 99]]}], "shared": {"frames": '
                   '[{"name": "f", "file": "a.py"}]}}')
    w = read_window(bad, rate_hz=100)
    assert w.threads[0].tid == 7 and w.stacks[w.threads[0].samples[0]] == (("f", "a.py"),)  # index 99 dropped
    with pytest.raises(SamplesError, match="not a speedscope"):
        bad.write_text("[1, 2]")
        read_window(bad, rate_hz=100)
