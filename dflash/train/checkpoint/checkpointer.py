"""Checkpointing a run: which checkpoint a start resumes from, what a checkpoint holds, the ranks'
agreement on it, and what a failed write means for the run. How the files are written, verified and
read back is `checkpoint.py`'s.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from dflash.checkpoint_files import (
    FORMAT,
    CheckpointError,
    clean_partial,
    list_checkpoints,
    load_latest,
    save_checkpoint,
)
from dflash.model.export import checkpoint_dict
from dflash.train import distributed
from dflash.train.checkpoint import rng
from dflash.train.checkpoint.writer import CheckpointWriter, HostSnapshot, Written
from dflash.train.config import TrainConfig
from dflash.train.control import Interval
from dflash.train.device.binding import thread_device
from dflash.train.device.memory import trained_bytes
from dflash.train.distributed import Dist, DistError
from dflash.train.reporting import Reporter
from dflash.train.run.build import Components, TrainError
from dflash.train.run.pipeline import TrainCounters


def checkpoint_to_resume(run_dir: Path, dist: Dist, resume: bool, report: Reporter) -> dict | None:
    """Rank 0 removes a partial checkpoint; a used run directory needs --resume, which loads the
    newest checkpoint that reads back whole."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if dist.is_main and clean_partial(run_dir):
        report.log("removed a partial checkpoint left by an interrupted write")
    distributed.barrier(dist, "waiting for rank 0 to tidy the run directory")
    existing = list_checkpoints(run_dir)
    if dist.enabled:
        same_run_dir(dist, run_dir, existing[-1].name if existing else None)
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


def same_run_dir(dist: Dist, run_dir: Path, newest: str | None) -> None:
    """Refuse to start when the ranks see different checkpoints in their run directories (``newest``: the
    newest this rank sees). Every rank reads the run directory itself (`--resume` loads the checkpoint on
    each), so the nodes of a job must share it. A node with a directory of its own (no shared filesystem,
    or another path) started afresh while rank 0 resumed, and the ranks, on different steps, then hung in
    mismatched collectives until --collective-timeout."""
    views = distributed.gather(dist, (socket.gethostname(), str(run_dir.resolve()), newest))
    other = next((r for r, v in enumerate(views) if v[2] != views[0][2]), None)
    if other is None:
        return

    def sees(r: int) -> str:
        host, path, name = views[r]
        return f"rank {r} on {host} sees {name or 'no checkpoint'} in {path}"

    raise TrainError(f"the ranks see different run directories: {sees(0)}, {sees(other)}; every node must see "
                     "the same run directory (a shared filesystem, at the same path)")


#: the default checkpoint interval: one minute per GB of checkpoint, never under a minute
SECONDS_PER_GB = 60.0
MIN_INTERVAL_S = 60.0


def default_interval(checkpoint_bytes: int) -> float:
    """Seconds between checkpoints when --checkpoint-every is not given, from the checkpoint's size.

    A save costs the drafter thread only its host snapshot, but the writer still reads and hashes the
    whole state and the disk takes it all: one minute per GB keeps a disk that writes 200 MB/s busy
    under a tenth of the time (a 1B drafter's 12.6 GB every 12.6 minutes) and the small drafters of
    the CPU recipe on the one-minute schedule they always had."""
    return max(MIN_INTERVAL_S, SECONDS_PER_GB * checkpoint_bytes / 1e9)


def checkpoint_bytes(drafter: torch.nn.Module) -> int:
    """What a checkpoint of ``drafter`` holds, before its first save: the parameters and AdamW's two
    moments per parameter, all in the parameters' dtype (fp32 master weights)."""
    return 3 * trained_bytes(drafter)


class Checkpointer:
    """Saves the run when its control decides so (on rank 0, after every rank agreed), in the
    background: the drafter thread only takes a host snapshot (checkpoint_writer.py). A failed write is
    one warning and training goes on (README "Checkpoints"): `failed` tells the end of the run."""

    def __init__(self, cfg: TrainConfig, dist: Dist, parts: Components, state: TrainCounters,
                 clock: Callable[[], float], interval: Interval, report: Reporter):
        """`clock`: the training clock saved with the position; `interval`: the checkpoint schedule,
        restarted by every save (or failed try)."""
        self.cfg, self.dist, self.parts, self.state = cfg, dist, parts, state
        self.clock, self.interval, self.report = clock, interval, report
        self.run_dir = Path(cfg.run.run_dir)
        self.saved_step = state.step if state.step else -1  # a resumed run's step is on disk already
        self.failed = False
        self._waited = False  # whether the save in flight is the run's last (waited for)
        self.snapshot = HostSnapshot()
        # the writer binds the trainer's device: it waits on the snapshot's CUDA event
        self.writer = CheckpointWriter(self._write, self._written, thread_device(parts.drafter_device))
        # a checkpoint's bulk: each parameter and AdamW's two moments of it, allocated off the drafter
        # thread while it trains
        params = list(parts.drafter.drafter.parameters())
        self.writer.prepare(lambda: self.snapshot.reserve(params * 3))

    def save(self, final: bool = False, collective: bool = True) -> Path | None:
        """Checkpoint the current step. A periodic save returns once its snapshot is taken (None); a
        final one, or a stall exit's (`collective=False`), waits for the write and returns the path
        (None when it failed). Nothing is saved twice for one step, nor by a rank other than 0.
        `collective=False` (a stall exit, when a collective may be hung): rank 0 saves its own replica
        without asking the others; the other ranks save nothing."""
        st, d = self.state, self.dist
        if st.step == self.saved_step or (d.enabled and not collective and not d.is_main):
            return None
        drafter = self.parts.drafter
        with drafter.tel.span("checkpoint"):
            self.writer.wait()  # the previous save's buffers are about to be reused
            rng_state = rng.capture(self.parts.generator)
            rng_per_rank = None
            if d.enabled and collective:
                # All ranks are here at the same step (the decision was agreed): collect every rank's
                # anchor RNG for an exact resume.
                rng_per_rank = distributed.gather(d, rng_state)
                if final:
                    self._check_replicas()
                if not d.is_main:
                    self._done()
                    return None
            device = self.parts.drafter_device
            if collective and device.type == "cuda" and threading.current_thread() is threading.main_thread():
                # The end of a run, its workers stopped: the drafter's last kernels ran on its own
                # stream, which the copies on this thread's stream would not wait for. (A stall exit
                # skips this: a hung collective would hang it too.)
                torch.cuda.synchronize(device)
            host, ready = self.snapshot.take(self.contents(rng_state, rng_per_rank))
            self._waited = final or not collective  # the run ends after this one: no "next try"
            self.writer.submit(st.step, host, ready, self.snapshot.nbytes)
        self._done()
        if not self._waited:
            return None
        self.writer.wait()
        last = self.writer.last
        return last.path if last is not None and last.step == st.step else None

    def _check_replicas(self) -> None:
        """Prove the ranks' drafters are still identical, at the final checkpoint only: DDP keeps them
        equal by construction (rank 0's weights broadcast at the start, gradients averaged), so a
        check at every save would cost each rank a host copy and hash of all its parameters (4.2 GB
        for a 1B drafter) for a fault it cannot cause; once per run still catches one that slipped in."""
        digests = distributed.gather(self.dist, distributed.param_digest(self.parts.drafter.drafter))
        if len(set(digests)) != 1:
            raise DistError(f"drafter replicas diverged at step {self.state.step}: parameter digests {digests}")
        self.report.log(f"replicas in sync at step {self.state.step}: parameter digest {digests[0]} on all "
                        f"{len(digests)} ranks")

    def contents(self, rng_state: dict, rng_per_rank: list | None = None) -> dict:
        """What a checkpoint holds, as live tensors on the drafter's device (the snapshot copies them)."""
        drafter, st = self.parts.drafter, self.state
        return {
            "format": FORMAT,
            **checkpoint_dict(drafter.drafter),  # what load_drafter reads back
            "optimizer": drafter.optimizer.state_dict(),
            "rng": rng_state,
            "rng_per_rank": rng_per_rank,
            "state": {"step": st.step, "next_batch": st.next_batch, "tokens": st.tokens,
                      "samples": st.samples, "train_time": self.clock(),
                      # the data position in samples: a resume on another world size repeats and skips none
                      "data": self.parts.source.position(st.next_batch).to_dict()},
            "config": self.cfg.to_dict(),
        }

    def close(self) -> None:
        """Wait for the save in flight: the run does not exit while its last checkpoint is half written."""
        self.writer.close()

    def _write(self, step: int, state: dict) -> Path:
        return save_checkpoint(self.run_dir, step, state, self.cfg.checkpoint.keep_checkpoints, note=self.report.log)

    def _written(self, w: Written) -> None:
        """On the writer thread, once a save is over: its event, or the one warning of a failed write.
        What is on disk is intact then and the next interval tries again."""
        if w.error is None:
            self.failed = False
            self.report.event("checkpoint", f"saved {w.path.name} ({w.nbytes / 1e9:.2f} GB, written in "
                              f"{w.seconds:.1f} s in the background)", step=w.step, path=str(w.path))
            return
        self.failed = True
        newest = list_checkpoints(self.run_dir)
        then = "" if self._waited else f"; training continues, next try in {self.interval.every:g}s"
        self.report.event("warning", f"checkpoint {w.error}; newest good checkpoint: "
                          f"{newest[-1].name if newest else 'none'}{then}", step=w.step)

    def _done(self) -> None:
        self.saved_step = self.state.step
        self.interval.restart()
