"""The stage rules: which frames of a sampled stack put a thread in which category. Data, in one table.

A sample of a thread is its stack, outermost frame first. The rules are tried in the table's order and
the first that matches names the sample's category; a sample no rule matches is *untracked* (Python work
the rules do not name, or a thread sleeping in C with no telling frame). A rule matches when one frame
of the stack matches its `function` (py-spy's qualified name, ``Queue.get``, ``Module._call_impl``; a
full match) and `file` (searched in the frame's file: a source path, or a native library), and, when it
names one, an outer frame of that frame matches `inside` (a queue's `get` is a batch wait inside the
target loop, a hidden-state wait inside the drafter's). Specific rules come first (dflash's own stages,
checkpoints, evaluation), then the host's CUDA plumbing (the allocator, a host sync, a collective, a
kernel launch) wherever it happens, then
the generic stages of any PyTorch trainer, and idle waits last.

Categories are the vocabulary's (dflash.telemetry.wire.vocab): the trainer's own where they fit (a
generic trainer's forward reads `drafter_forward`: the model being trained), and the sampled-only ones
(`collective_wait`, `host_sync`, `idle_wait`, and from native frames `kernel_launch` and `allocator`)
where the trainer has none. A native frame's function is the demangled C++ name without its parameters
(`c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc`); its file is the shared
library (`libcuda.so.1`) or, where the library carries line tables, the source file. docs/sampling.md lists them
with what each rule means; a change here is checked against the recorded stacks in tests/fixtures/stacks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class Rule:
    category: str
    #: regular expression, full match against the frame's function (py-spy's qualified name)
    function: str = ""
    #: regular expression, searched in the frame's file (a source path or a native library)
    file: str = ""
    #: regular expression, full match against the function of a frame outside the matched one
    inside: str = ""
    why: str = field(default="", compare=False)

    @cached_property
    def _function(self) -> re.Pattern[str] | None:
        return re.compile(self.function) if self.function else None

    @cached_property
    def _file(self) -> re.Pattern[str] | None:
        return re.compile(self.file) if self.file else None

    @cached_property
    def _inside(self) -> re.Pattern[str] | None:
        return re.compile(self.inside) if self.inside else None

    def matches(self, stack: Sequence[tuple[str, str]]) -> bool:
        """Whether some frame of `stack` ((function, file) pairs, outermost first) matches."""
        fn, fl, inside = self._function, self._file, self._inside
        for i, (name, file) in enumerate(stack):
            if (fn is None or fn.fullmatch(name)) and (fl is None or fl.search(file)):
                if inside is None or any(inside.fullmatch(outer) for outer, _ in stack[:i]):
                    return True
        return False


_PIPELINE = r"dflash/train/run/pipeline\.py"
_STAGES = r"dflash/train/run/stages\.py"

RULES: tuple[Rule, ...] = (
    # --- checkpoints and evaluation: they pause training, whatever they call --------------------------
    Rule("idle_wait", function=r"Queue\.get", inside=r"CheckpointWriter\._run", why="dflash's checkpoint writer "
         "waiting for work"),
    Rule("checkpoint", file=r"dflash/train/checkpoint/|dflash/checkpoint_files\.py", why="dflash's checkpointer"),
    Rule("checkpoint", function=r"_?save|_?load|_legacy_save|_legacy_load", file=r"torch/serialization\.py",
         why="torch.save / torch.load"),
    Rule("checkpoint", file=r"safetensors/|torch/distributed/checkpoint/", why="safetensors, distributed checkpoint"),
    Rule("checkpoint", function=r".*\.save_pretrained|.*save_checkpoint.*", why="save_pretrained, *save_checkpoint*"),
    Rule("eval", file=r"dflash/eval/|dflash/train/reporting/evaluation\.py", why="dflash's speculative decoding"),
    Rule("eval", function=r"GenerationMixin\.generate", why="transformers' generate"),
    # --- dflash's pipeline: its queues, named by the loop that waits on them --------------------------
    Rule("cache_wait", function=r".*\.wait_ready", file=r"dflash/targets/", why="a followed cache not yet written"),
    Rule("batch_queue_wait", function=r"get", file=_PIPELINE, inside=r"Pipeline\._target"),
    Rule("hs_queue_put", function=r"put", file=_PIPELINE, inside=r"Pipeline\._target"),
    Rule("hs_queue_wait", function=r"get", file=_PIPELINE, inside=r"Pipeline\._drafter"),
    Rule("batch_queue_put", function=r"put", file=_PIPELINE, inside=r"Pipeline\._producer"),
    # --- the host's CUDA plumbing and waits (native frames: py-spy --native) --------------------------
    # The caching allocator first: a sync or a free inside it (a retry, releasing the cache) is its cost.
    Rule("allocator", function=r"c10::(cuda::CUDACachingAllocator|CachingDeviceAllocator)::.*"
         r"|at::cuda::(CachingHostAllocator|HostAlloc).*|cuMem(Map|Unmap|Create|Release|SetAccess|Address\w+)\w*"
         r"|cuMem(Alloc|Free|HostAlloc|HostRegister)\w*|cuda(Malloc|Free|HostAlloc|HostRegister)\w*",
         why="native: the caching allocator (malloc, ExpandableSegment::map/unmap, emptying the cache) and the "
         "driver's cuMemMap/cudaMalloc and their frees"),
    Rule("host_sync", function=r"(.*\.)?synchronize", file=r"torch/cuda/",
         why="torch.cuda.synchronize, Stream/Event.synchronize"),
    Rule("host_sync", function=r"(cuda|cu)(Stream|Device|Event|Ctx)Synchronize.*|cudaMemcpy|cuMemcpyDtoH.*"
         r"|.*_local_scalar_dense.*|THPVariable_(item|tolist)", why="native: a stream sync, .item(), .tolist()"),
    Rule("collective_wait", file=r"torch/distributed/distributed_c10d\.py|torch/distributed/_functional_coll",
         why="torch.distributed all_reduce, barrier, broadcast, ..."),
    Rule("collective_wait", function=r"c10d::.*|nccl.*|.*ProcessGroup.*::.*wait.*", why="native: NCCL, c10d"),
    # Feeding the GPU: after the syncs and collectives (an NCCL kernel's launch is the collective's), what
    # is left of a thread inside the CUDA runtime, the driver or torch's CUDA library is launch work.
    Rule("kernel_launch", function=r"(cu|cuda)(Graph)?Launch\w*", why="native: a kernel launch (cudaLaunchKernel, "
         "cuLaunchKernel, a CUDA graph's launch)"),
    Rule("kernel_launch", function=r"(cu|cuda)(EventRecord|StreamWaitEvent|Memcpy\w*Async|Memset\w*Async)\w*",
         why="native: the rest of feeding a stream: event records, stream waits, asynchronous copies"),
    Rule("kernel_launch", file=r"libtorch_cuda\.so|libcudart\.so|libcuda\.so|libcublas(Lt)?\.so|libcudnn"
         r"|aten/src/ATen/(native/)?cuda/|c10/cuda/",
         why="native: the host's part of a CUDA op (dispatch, argument checks, TensorIterator, launch setup)"),
    # --- dflash's target stage -----------------------------------------------------------------------
    Rule("cache_read", function=r".*\.hidden_states", file=r"dflash/targets/cache\.py"),
    Rule("target_forward", function=r".*\.hidden_states", file=r"dflash/targets/"),
    Rule("pack_hidden", function=r"TargetStage\.__call__", file=_STAGES),
    # --- any trainer: its data, forward, backward, optimizer -----------------------------------------
    Rule("batch_build", function=r"BatchSource\.__call__", file=_STAGES, why="dflash's batch producer"),
    Rule("batch_build", function=r"_pin_memory_loop", file=r"torch/utils/data/", why="a DataLoader's pinning thread"),
    Rule("batch_queue_wait", file=r"torch/utils/data/", why="a torch DataLoader: waiting for (or building) a batch"),
    Rule("drafter_forward", function=r"grad|_engine_run_backward", file=r"torch/autograd/", inside=r"head_rows",
         why="dflash's chunked LM head: each chunk's gradient is taken inside the forward, timed as forward"),
    Rule("drafter_backward", function=r"backward|_engine_run_backward|Tensor\.backward",
         file=r"torch/autograd/|torch/_tensor\.py", why="loss.backward()"),
    Rule("optimizer_step", file=r"torch/optim/|torch/nn/utils/clip_grad\.py|torch/amp/grad_scaler\.py",
         why="optimizer.step, clip_grad_norm_, GradScaler"),
    Rule("optimizer_step", function=r"NonFiniteGuard\.step", file=r"dflash/train/health/nonfinite\.py",
         why="dflash's step guard: the optimizer's step unless the loss or gradient norm is not finite"),
    Rule("optimizer_step", function=r"Module\.zero_grad", file=r"torch/nn/modules/module\.py"),
    Rule("drafter_forward", file=r"dflash/objectives/|dflash/model/", why="dflash's objective terms and drafter: "
         "the loss computed in the forward span"),
    Rule("drafter_forward", function=r"Module\._(wrapped_)?call_impl", file=r"torch/nn/modules/module\.py",
         why="a module's forward: the model being trained"),
    Rule("drafter_forward", file=r"torch/nn/functional\.py|(^|/)loss(es)?(/|\.py)", why="functional ops, losses"),
    Rule("h2d", function=r"DrafterStage\.step", file=_STAGES, why="dflash's step outside forward/backward/"
         "optimizer: its host-to-device copies"),
    # --- nothing to do -------------------------------------------------------------------------------
    Rule("idle_wait", function=r"(Condition|Event|Barrier|Semaphore|BoundedSemaphore)\.wait|Thread\.join"
         r"|Semaphore\.acquire", file=r"threading\.py"),
    Rule("idle_wait", function=r"Queue\.(get|put)", file=r"(^|/)queue\.py|multiprocessing/queues\.py"),
    Rule("idle_wait", file=r"(^|/)selectors\.py|multiprocessing/connection\.py|asyncio/base_events\.py"),
)


def classify(stack: Sequence[tuple[str, str]], rules: Sequence[Rule] = RULES) -> str | None:
    """The category of one sample (its (function, file) frames, outermost first); None: untracked."""
    for rule in rules:
        if rule.matches(stack):
            return rule.category
    return None
