"""Checkpointing a run: which checkpoint a start resumes from, what a checkpoint holds, the ranks'
agreement on it, and what a failed write means for the run. How the files are written, verified and
read back is `checkpoint.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from dflash.train import distributed, rng
from dflash.train.build import Components, TrainError
from dflash.train.checkpoint import (
    FORMAT,
    CheckpointError,
    clean_partial,
    list_checkpoints,
    load_latest,
    save_checkpoint,
)
from dflash.train.config import TrainConfig
from dflash.train.control import Interval
from dflash.train.distributed import Dist, DistError
from dflash.train.pipeline import TrainCounters
from dflash.train.reporting import Reporter


def checkpoint_to_resume(run_dir: Path, dist: Dist, resume: bool, report: Reporter) -> dict | None:
    """Rank 0 removes a partial checkpoint; a used run directory needs --resume, which loads the
    newest checkpoint that reads back whole."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if dist.is_main and clean_partial(run_dir):
        report.log("removed a partial checkpoint left by an interrupted write")
    distributed.barrier(dist, "waiting for rank 0 to tidy the run directory")
    existing = list_checkpoints(run_dir)
    if existing and not resume:
        raise TrainError(f"{run_dir} already holds checkpoints (newest {existing[-1].name}); "
                         "pass --resume to continue that run, or choose another --run-dir")
    if not resume:
        return None
    try:
        found = load_latest(run_dir, note=lambda s: report.log(f"--resume: {s}"))
    except CheckpointError as e:
        raise TrainError(f"--resume: {e}; move them away to start afresh") from None
    if found is None:
        report.log(f"--resume: no checkpoint in {run_dir}/checkpoints, starting fresh")
        return None
    report.log(f"--resume: using {found[0].name}")
    return found[1]


class Checkpointer:
    """Saves the run when its control decides so (on rank 0, after every rank agreed). A failed write
    is one warning and training goes on (README "Checkpoints"): `failed` tells the end of the run."""

    def __init__(self, cfg: TrainConfig, dist: Dist, parts: Components, state: TrainCounters,
                 clock: Callable[[], float], interval: Interval, report: Reporter):
        """`clock`: the training clock saved with the position; `interval`: the checkpoint schedule,
        restarted by every save (or failed try)."""
        self.cfg, self.dist, self.parts, self.state = cfg, dist, parts, state
        self.clock, self.interval, self.report = clock, interval, report
        self.run_dir = Path(cfg.run.run_dir)
        self.saved_step = state.step if state.step else -1  # a resumed run's step is on disk already
        self.failed = False

    def save(self, final: bool = False, collective: bool = True) -> Path | None:
        """The checkpoint of the current step, or None (saved already, not rank 0, or the write failed).
        `collective=False` (a stall exit, when a collective may be hung): rank 0 saves its own replica
        without asking the others; the other ranks save nothing."""
        st, d = self.state, self.dist
        if st.step == self.saved_step or (d.enabled and not collective and not d.is_main):
            return None
        drafter = self.parts.drafter
        with drafter.tel.span("checkpoint"):
            rng_state = rng.capture(self.parts.generator)
            rng_per_rank = None
            if d.enabled and collective:
                # All ranks are here at the same step (the decision was agreed): collect every rank's
                # anchor RNG for an exact resume, and prove the replicas are still identical.
                rng_per_rank = distributed.gather(d, rng_state)
                digests = distributed.gather(d, distributed.param_digest(drafter.drafter))
                if len(set(digests)) != 1:
                    raise DistError(f"drafter replicas diverged at step {st.step}: parameter digests {digests}")
                self.report.log(f"replicas in sync at step {st.step}: parameter digest {digests[0]} on all "
                                f"{len(digests)} ranks")
                if not d.is_main:
                    self._done()
                    return None
            state = {
                "format": FORMAT,
                "drafter_config": asdict(self.parts.dcfg),
                "drafter": drafter.drafter.state_dict(),
                "optimizer": drafter.optimizer.state_dict(),
                "rng": rng_state,
                "rng_per_rank": rng_per_rank,
                "state": {"step": st.step, "next_batch": st.next_batch, "tokens": st.tokens,
                          "samples": st.samples, "train_time": self.clock()},
                "config": self.cfg.to_dict(),
            }
            try:
                path = save_checkpoint(self.run_dir, st.step, state, self.cfg.checkpoint.keep_checkpoints,
                                       note=self.report.log)
            except CheckpointError as e:
                # What is on disk is intact and the next interval tries again. This step counts as
                # done: a second try at the end of the run would gather alone, without the other ranks.
                self._done(failed=True)
                newest = list_checkpoints(self.run_dir)
                then = "" if final else f"; training continues, next try in {self.cfg.checkpoint.checkpoint_every:g}s"
                self.report.event("warning", f"checkpoint {e}; newest good checkpoint: "
                                  f"{newest[-1].name if newest else 'none'}{then}", step=st.step)
                return None
        self._done()
        self.report.event("checkpoint", f"saved {path.name}", step=st.step, path=str(path))
        return path

    def _done(self, failed: bool = False) -> None:
        self.saved_step, self.failed = self.state.step, failed
        self.interval.restart()
