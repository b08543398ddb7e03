"""Run a few steady-state training steps under a guard: how the tests (CPU) and scripts/gpu_check.py
(CUDA) prove that a training step never waits for the device.

The guard is entered when step ``warmup`` has finished and left just before the last step's
bookkeeping (which checkpoints): between the two the worker threads run, with no log line, evaluation
or checkpoint to read the device meanwhile; with telemetry (scripts/gpu_check.py's host_gap check keeps
it, as a real run does) the main thread also reads the metric sums once per interval, a sync by design,
which ``CudaSyncLog`` tells apart from a worker's.
"""

from __future__ import annotations

import re
import threading
import traceback
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from dflash.train.config import TrainConfig
from dflash.train.config.schema import updated
from dflash.train.run.stages import StepResult
from dflash.train.trainer import Trainer


def run_steady(cfg: TrainConfig, warmup: int, steps: int, guard: Callable[[], AbstractContextManager],
               telemetry: bool = False, join_ranks: Callable[[Trainer], None] | None = None,
               after_step: Callable[[Trainer, int], None] | None = None) -> Trainer:
    """Train ``warmup + steps`` steps of ``cfg`` with ``guard()`` active around the last ``steps``.

    ``telemetry``: keep the publisher running (it resolves CUDA events meanwhile); ``join_ranks``:
    replaces Trainer.join_ranks (a one-rank DDP world); ``after_step(trainer, step)``: called on the
    drafter thread after each step. Returns the finished Trainer; a worker that raised (e.g. a CUDA
    sync error) makes it fail the usual way, with that worker's traceback.
    """
    cfg = updated(cfg, max_steps=warmup + steps, max_time=None, telemetry=telemetry, metrics_port=None,
                  log_every=1e9, eval_every=0, eval_prompts=0, checkpoint_every=1e9)
    active: list[AbstractContextManager] = []

    class Steady(Trainer):
        def join_ranks(self) -> None:
            if join_ranks is None:
                super().join_ranks()
            else:
                join_ranks(self)

        def on_step(self, r: StepResult) -> bool:
            if active and self.state.step + 1 == warmup + steps:
                active.pop().__exit__(None, None, None)
            go_on = super().on_step(r)
            if after_step is not None:
                after_step(self, self.state.step)
            if self.state.step == warmup:
                ctx = guard()
                ctx.__enter__()
                active.append(ctx)
            return go_on

    trainer = Steady(cfg, log=lambda s: None)
    try:
        code = trainer.run()
    finally:
        while active:
            active.pop().__exit__(None, None, None)
    if code != 0:
        name, tb = trainer.pipeline.failure or ("?", "")
        raise RuntimeError(f"steady-state run failed in {name}:\n{tb}")
    return trainer


#: the pipeline's worker threads (dflash/train/run/pipeline.py names them): a step must never wait for the
#: device in any of them; the main thread reads the metric sums once per telemetry interval, on purpose
WORKER_THREADS = re.compile(r"batch-producer|target-\d+|drafter-\d+")
SYNC_MESSAGE = "synchronizing CUDA operation"


class CudaSyncLog:
    """While active, every synchronising CUDA call is recorded with the thread that made it and where.

    torch's sync debug mode is one setting for the whole process: "error" would also raise in the
    trainer's main thread, whose once-per-interval read of the device-side metric sums synchronises by
    design (dflash/train/device/metrics.py), and end the run there instead of saying whether a worker
    synchronised. "warn" makes each sync a warning in the thread that made it, which this log takes
    (every one, not once per place) instead of printing it. Without CUDA nothing synchronises and the
    mode is left alone; the log is then empty.
    """

    def __init__(self, frames: int = 4) -> None:
        self.frames = frames
        self.by_thread: dict[str, list[str]] = {}  # thread name -> where each sync was made
        self._lock = threading.Lock()
        self._warnings: warnings.catch_warnings | None = None
        self._mode_before: int | None = None

    def workers(self) -> dict[str, list[str]]:
        """The syncs made in the pipeline's worker threads: what a steady step must never do."""
        return {t: w for t, w in self.by_thread.items() if WORKER_THREADS.fullmatch(t)}

    def others(self) -> dict[str, list[str]]:
        return {t: w for t, w in self.by_thread.items() if not WORKER_THREADS.fullmatch(t)}

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_MESSAGE not in str(message):
            return self._shown(message, category, filename, lineno, file, line)
        stack = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack[-self.frames:]))
        with self._lock:
            self.by_thread.setdefault(threading.current_thread().name, []).append(where)

    def __enter__(self) -> CudaSyncLog:
        import torch

        self._warnings = warnings.catch_warnings()  # restores filters and showwarning for every thread
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        self._shown = warnings.showwarning
        warnings.showwarning = self._show
        if torch.cuda.is_available():
            self._mode_before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        if self._mode_before is not None:
            torch.cuda.set_sync_debug_mode(self._mode_before)
            self._mode_before = None
        if self._warnings is not None:
            self._warnings.__exit__(*exc)
            self._warnings = None


# --------------------------------------------------------------------------------------------------
# Speculative sampling's distribution test: what tests/test_eval_sampling.py runs on the CPU and
# scripts/gpu_check.py's eval_temperature on CUDA, at the same significance
# --------------------------------------------------------------------------------------------------

#: the settings of the test: a temperature and top-k that leave TOP_K ** TOKENS continuations of PROMPT,
#: none of them likely enough to dominate, each drawn SAMPLES times in expectation of a fair count
SAMPLING_TEMPERATURE, SAMPLING_TOP_K, SAMPLING_TOKENS, SAMPLING_SAMPLES = 2.0, 3, 3, 300
SAMPLING_PROMPT = [3, 5, 1, 4]


def sampling_drafter(target, kind: str):
    """A one-layer drafter of ``kind`` (dflash, dflash2, dspark) for ``target`` (block 4) whose own
    proposals move the draft: a fresh DFlash2 selector is plain top-1 and a fresh DSpark Markov bias is
    ~1e-3 a logit, so their weights are drawn larger, seeded. In eval mode, on the target's device."""
    import torch

    from dflash.model.dflash2 import DFlash2Config, DFlash2Drafter
    from dflash.model.drafter import DFlashDrafter, DrafterConfig
    from dflash.model.dspark import DSparkConfig, DSparkDrafter

    torch.manual_seed(3)
    cfg = DrafterConfig.for_target(target.config, num_layers=1, block_size=4, target_layer_ids=target.layer_ids,
                                   mask_token_id=target.default_mask_token_id())
    if kind == "dflash":
        d = DFlashDrafter(cfg)
    elif kind == "dspark":
        d = DSparkDrafter(DSparkConfig(**cfg.__dict__, markov_rank=4))
        with torch.no_grad():
            d.markov_head.markov_w1.weight.normal_(std=1.0)
            d.markov_head.markov_w2.weight.normal_(std=1.0)
    else:
        d = DFlash2Drafter(DFlash2Config(**cfg.__dict__, selector_rank=4, selector_top_k=SAMPLING_TOP_K))
        with torch.no_grad():
            d.candidate_selector.successor_codebook.normal_(std=2.0)
            d.candidate_selector.predecessor_codebook.normal_(std=2.0)
            d.candidate_selector.hidden_projection.weight.normal_(std=0.5)
    return d.to(target.device).eval()


def exact_continuations(target) -> dict[tuple[int, ...], float]:
    """The target's own probability of every SAMPLING_TOKENS-token continuation of SAMPLING_PROMPT under
    the test's temperature and top-k, by enumerating them (one forward per prefix)."""
    import torch

    from dflash.eval.sampling import sampling_probs

    out: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(SAMPLING_TOKENS):
            nxt = {}
            for prefix, p in out.items():
                ids = torch.tensor([SAMPLING_PROMPT + list(prefix)], device=target.device)
                probs = sampling_probs(target.model(input_ids=ids).logits[0, -1], SAMPLING_TEMPERATURE, 1.0,
                                       SAMPLING_TOP_K).cpu()
                for tok in probs.nonzero()[:, 0].tolist():
                    nxt[prefix + (tok,)] = p * float(probs[tok])
            out = nxt
    return out


def speculative_counts(drafter, target,
                       samples: int = SAMPLING_SAMPLES) -> tuple[dict[tuple[int, ...], int], list[int]]:
    """How often each continuation came out of ``samples`` seeded speculative decodes (each seed's
    generator on the target's device, where the verifier draws), and every round's accepted drafts."""
    import torch

    from dflash.eval.speculative import Sampling, speculative_generate

    counts: dict[tuple[int, ...], int] = {}
    accepted: list[int] = []
    for seed in range(samples):
        g = torch.Generator(device=target.device).manual_seed(seed)
        s = Sampling(SAMPLING_TEMPERATURE, 1.0, SAMPLING_TOP_K, g)
        res = speculative_generate(drafter, target, SAMPLING_PROMPT, SAMPLING_TOKENS, stop_token_ids=[], sampling=s)
        key = tuple(res.tokens)
        counts[key] = counts.get(key, 0) + 1
        accepted += res.accepted
    return counts, accepted


#: one-sided 0.1%: the standard normal quantile the chi-square critical value is approximated from
CHI_SQUARE_Z = 3.09


def chi_square(counts: dict[tuple[int, ...], int], expected: dict[tuple[int, ...], float],
               n: int) -> tuple[float, float]:
    """(Pearson's statistic, its 0.1% critical value): cells expected fewer than 5 times pooled; the
    quantile by Wilson-Hilferty's cube-root normal approximation."""
    import math

    big = [k for k, p in expected.items() if p * n >= 5]
    rest = [k for k in expected if k not in big]
    cells = [(counts.get(k, 0), expected[k] * n) for k in big]
    if rest:
        cells.append((sum(counts.get(k, 0) for k in rest), sum(expected[k] for k in rest) * n))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return stat, df * (1 - 2 / (9 * df) + CHI_SQUARE_Z * math.sqrt(2 / (9 * df))) ** 3
