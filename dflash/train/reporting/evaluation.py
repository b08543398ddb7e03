"""Evaluating a run: real speculative decoding on a few prompts the drafter never trained on (rows held
out of --data, --eval-data's, or the demo's own), the tau that matters (the simulated tau of the training
loss is optimistic). Every tau it prints says which prompts it came from (build.EvalSet).

The evaluation after training is a phase of its own (minutes on a CPU): announced, and its progress
logged and published per prompt, so neither the log nor dflash-top goes quiet. Each result is appended
to `<run_dir>/evals.jsonl` (tau over training), published as the `eval_tau` metric and sent to the
trackers.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash.train.config import TrainConfig
from dflash.train.reporting import Reporter
from dflash.train.reporting.progress import EvalProgress
from dflash.train.reporting.trackers import eval_scalars
from dflash.train.run.build import Components
from dflash.words import plural


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[int]:
    """Run the block with `n` torch intra-op threads (None: torch's as they are) and yield the count in
    effect. Decoding one sequence is a chain of small matmuls: more threads than the workers use only
    adds contention (measured on 2 shared cores: 27-37 s with torch's default against ~2 s with one,
    scripts/bench_eval.py). The count is per thread, so this also reaches the main thread's final
    evaluation, which the pipeline's per-worker setting never did."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def threads_text(n: int, source: str | None) -> str:
    """`1 torch thread (as each worker)`: the count an evaluation runs with and where it came from
    (`source` None: nothing chose it)."""
    return f"{plural(n, 'torch thread')} ({source or TORCH_DEFAULT})"


TORCH_DEFAULT = "torch's default"


class Evaluations:
    def __init__(self, cfg: TrainConfig, parts: Components, report: Reporter):
        self.cfg, self.parts, self.report = cfg, parts, report
        self.log_path = Path(cfg.run.run_dir) / "evals.jsonl"

    def run(self, step: int, in_training: bool = False) -> dict[str, Any]:
        """Evaluate the drafter as it is after `step`; returns the result's summary."""
        from dflash.eval.speculative import evaluate

        cfg, parts, stats = self.cfg, self.parts, self.parts.stats
        prompts, on = parts.evals.prompts, parts.evals.what
        what = "evaluation" if in_training else "final evaluation"
        threads = cfg.pipeline.threads_per_worker
        with torch_threads(threads) as n:
            self.report.event("phase", f"{what} on {on}: {cfg.eval.eval_max_new_tokens} new tokens each, "
                              "speculative decoding against the target's own greedy output, "
                              + threads_text(n, "as each worker" if threads else None))
            t0 = time.monotonic()

            def on_prompt(done: int, total: int) -> None:
                p = EvalProgress(done, total, time.monotonic() - t0)
                for name, value in p.gauges().items():
                    stats.gauge(name, value)
                self.report.log(f"[{what}] {p.text()}")

            on_prompt(0, len(prompts))
            with parts.drafter.tel.span("eval"):  # evaluate() restores the drafter's train/eval mode itself
                result = evaluate(parts.drafter.drafter, parts.verifier, prompts,
                                  max_new_tokens=cfg.eval.eval_max_new_tokens, on_prompt=on_prompt)
        summary = {**result.to_dict(), "step": step, "prompts": on}
        with self.log_path.open("a") as f:
            f.write(json.dumps(summary) + "\n")
        stats.metric("eval_tau", summary["tau"])
        if self.report.trackers is not None:
            self.report.trackers.log(step, eval_scalars(summary))
        lossless = summary.get("lossless", True)
        self.report.event("eval", f"step {step}: tau {summary['tau']:.2f} over {summary['rounds']} rounds on {on}"
                          f"{'' if lossless else ' (NOT LOSSLESS)'}",
                          step=step, tau=summary["tau"], lossless=summary.get("lossless"))
        return summary
