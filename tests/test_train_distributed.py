"""Multi-rank training for real: torchrun (through `dflash train --nproc 2`) on CPU with gloo.

Each test launches two real ranks; they load a tiny random target built in the test, train, and
talk over real process groups and torchrun's real TCPStore.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import demo_cache
from test_model_helpers import make_target_dir, make_tokenizer
from test_train_pipeline import _write_data

from dflash.checkpoint_files import list_checkpoints
from dflash.data.cache_format import sample_path
from dflash.targets.cache import load_cache_target
from dflash.telemetry.wire.protocol import Event, Hello, Snapshot
from dflash.telemetry.wire.reader import read_frames
from dflash.telemetry.wire.sockets import parse_socket_filename
from dflash.train.config import TrainConfig
from dflash.train.run.stages import BatchSource

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    target = make_target_dir(root / "target", layers=4, tokenizer=make_tokenizer())
    data = _write_data(root / "data.jsonl", rows=48)
    return target, data


def train_args(target: Path | str, data: Path | None, run_dir: Path, sock_dir: Path, *extra: str) -> list[str]:
    """`dflash train`'s flags for a short multi-rank run of ``target`` on ``data`` (None: ``extra`` says where
    its data is): small batches, one drafter layer, no evaluation, frequent logs and telemetry."""
    return ["--target", str(target), *(["--data", str(data)] if data is not None else []),
            "--run-dir", str(run_dir), "--batch-size", "4", "--num-anchors", "8", "--drafter-layers", "1",
            "--eval-prompts", "0", "--threads-per-worker", "1", "--log-every", "0.5", "--telemetry-interval", "0.5",
            "--socket-dir", str(sock_dir), "--checkpoint-every", "1e9", *extra]


def rank_env(fault: str | None = None) -> dict[str, str]:
    """A rank's environment: one thread per op, unbuffered output, the faults ``fault`` names (DFLASH_FAULT)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **({"DFLASH_FAULT": fault} if fault else {})}


def _launch(target: Path | str, data: Path | None, run_dir: Path, sock_dir: Path, *extra: str,
            fault: str | None = None) -> subprocess.Popen:
    """Two ranks on this machine (`--nproc 2`) training ``target`` (see train_args), with the faults ``fault``
    names injected (DFLASH_FAULT)."""
    cmd = [sys.executable, "-m", "dflash", "train", "--nproc", "2",
           *train_args(target, data, run_dir, sock_dir, *extra)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=rank_env(fault))


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    return out


def test_data_shards_do_not_overlap_and_cover_each_batch_index():
    from dflash.data import Sample

    samples = [Sample(input_ids=[i, i + 1], loss_mask=[0, 1]) for i in range(40)]
    seen = []
    for rank in range(2):
        src = BatchSource(samples, batch_size=4, seed=3, pad_id=0, rank=rank, world_size=2)
        assert src.per_epoch == 5
        seen.append([tuple(src(i).input_ids[:, 0].tolist()) for i in range(src.per_epoch)])
    flat = [x for rank in seen for batch in rank for x in batch]
    assert len(flat) == len(set(flat)) == 40  # one epoch: every sample once, on exactly one rank
    assert seen[0][0] != seen[1][0]


def test_two_ranks_train_in_sync_checkpoint_together_publish_the_cluster_view_and_resume(setup, tmp_path):
    """One 2-rank run (torchrun's start is most of a short run's time, so one run shows all of this):
    the ranks train in sync, agree on each periodic checkpoint, publish rank 0's cluster view, and the run
    resumes on 2 ranks and on 1.

    Checkpoints: rank 0 proposes one after step N, all ranks write it after step N+1; proposing it again
    meanwhile wrote a second one a step later (26/27, 49/50, ...), so keep=3 held two distinct points."""
    target, data = setup
    run, socks = tmp_path / "run", tmp_path / "socks"
    # By time, so that the ranks exchange several reports and checkpoints whatever this machine's speed.
    out = _finish(_launch(target, data, run, socks, "--max-steps", "100000", "--max-time", "5",
                          "--checkpoint-every", "0.4", "--keep-checkpoints", "1000"))
    assert "distributed: 2 ranks (gloo)" in out, out[-3000:]
    steps = [int(p.stem.split("-")[1]) for p in list_checkpoints(run)]
    assert len(steps) >= 4, out[-3000:]
    # The run's last checkpoint is the one at its end, whatever the interval; every other one is periodic.
    periodic = steps[:-1]
    gaps = [b - a for a, b in zip(periodic, periodic[1:], strict=False)]
    assert min(gaps) > 1, f"checkpoints on back-to-back steps: {steps}"
    ckpt = torch.load(list_checkpoints(run)[-1], weights_only=True)
    step = ckpt["state"]["step"]
    assert step == steps[-1]
    # Parameters are compared for real: a digest of every byte of every drafter parameter, per rank; once,
    # at the final checkpoint (checkpointer.py says why).
    assert f"replicas in sync at step {step}" in out and "on all 2 ranks" in out, out[-3000:]
    assert out.count("replicas in sync at step") == 1, out[-3000:]
    assert "[rank 0] telemetry:" in out and "[rank 1] telemetry:" in out
    assert step >= 2 and len(ckpt["rng_per_rank"]) == 2

    # Every rank records its own telemetry; rank 0's snapshots carry the cluster view of both.
    hellos = {}
    for name in ("telemetry.jsonl", "telemetry-r1.jsonl"):
        frames = list(read_frames(run / name))
        hello = next(f for f in frames if isinstance(f, Hello))
        hellos[hello.rank] = hello
        assert hello.world_size == 2
    assert set(hellos) == {0, 1}
    views = [f.cluster for f in read_frames(run / "telemetry.jsonl") if isinstance(f, Snapshot) and f.cluster]
    assert views, "rank 0 published no cluster view"
    assert all(v.world_size == 2 and [r.rank for r in v.ranks] == [0, 1] for v in views)
    full = [v for v in views if {r.pid for r in v.ranks} == {hellos[0].pid, hellos[1].pid}]
    assert full, "no cluster view heard from both ranks"
    assert all(r.step >= 1 and r.tokens_per_s > 0 for r in full[-1].ranks), full[-1]
    assert any(c.key == "drafter-0/drafter_forward" for v in full for c in v.categories)
    assert not views[-1].stale, views[-1]  # both ranks finished on purpose: not flagged
    assert all(f.cluster is None for f in read_frames(run / "telemetry-r1.jsonl") if isinstance(f, Snapshot))

    out = _finish(_launch(target, data, run, socks, "--max-steps", str(step + 3), "--max-time", "1000", "--resume"))
    assert f"resumed from step {step}" in out and f"replicas in sync at step {step + 3}" in out, out[-3000:]
    assert torch.load(list_checkpoints(run)[-1], weights_only=True)["state"]["step"] == step + 3

    # The same run continued by a single process: allowed, and it says what changes.
    single = [sys.executable, "-m", "dflash", "train", "--target", str(target), "--data", str(data), "--run-dir",
              str(run), "--batch-size", "4", "--num-anchors", "8", "--drafter-layers", "1", "--eval-prompts", "0",
              "--no-telemetry", "--max-steps", str(step + 5), "--max-time", "1000", "--resume"]
    res = subprocess.run(single, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming a 2-rank run on 1 rank(s)" in res.stdout and f"resumed from step {step + 3}" in res.stdout


def test_a_rank_with_nothing_to_learn_or_a_non_finite_step_stays_in_step_with_the_others(tmp_path):
    """Two ranks on a cache where every file of rank 1's first batch is bad: rank 1 takes that step with the
    others on nothing (its rows masked out, no gradient of its own), so no collective waits for it (one that
    skipped the drafter's pass hung the job in the next step's), and each bad file is named. Its second step
    is made non-finite (DFLASH_FAULT): the averaged gradient is then non-finite on both ranks, and both skip
    it. The replicas stay identical throughout."""
    cache = demo_cache(tmp_path, 25)
    rows = sorted(cache_batch_rows(cache, [(1, 0)])[1, 0])
    for row in rows:  # what the trainer's own BatchSource gives rank 1 first
        path = sample_path(cache, row)
        path.write_bytes(path.read_bytes()[:-64])
    run = tmp_path / "run"
    proc = _launch("tiny", None, run, tmp_path / "s", "--hidden-states", str(cache), "--max-steps", "2",
                   "--max-seq-len", "256", "--block-size", "4", "--collective-timeout", "120",
                   fault="nan:drafter:step=1:rank=1")
    out = _finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "replicas in sync at step 2" in out and "on all 2 ranks" in out, out[-3000:]
    # each rank's own recording (only rank 0 prints its events)
    events = {rank: [e for e in read_frames(run / name) if isinstance(e, Event)]
              for rank, name in ((0, "telemetry.jsonl"), (1, "telemetry-r1.jsonl"))}
    named = [e.message for e in events[1] if "bad sample skipped" in e.message]
    assert sorted(int(re.search(r"hs_(\d+)\.safetensors", m).group(1)) for m in named) == rows, named
    for rank in (0, 1):  # the poisoned step skipped on both ranks, the empty one on neither
        assert [e.data["batch"] for e in events[rank] if e.kind == "nonfinite"] == [1], rank


def cache_batch_rows(cache: Path, wanted: list[tuple[int, int]],
                     world_size: int = 2) -> dict[tuple[int, int], list[int]]:
    """For each (rank, batch index) in ``wanted``, the cache rows (file numbers) that batch trains on that rank
    in a run of ``world_size`` ranks of the tiny target on ``cache`` with train_args' sizes: the trainer's own
    BatchSource, seed and sample filter, so a test can name in advance which rank reads which file."""
    cfg = TrainConfig()
    target = load_cache_target(cache, "tiny", [1, 3, 5], None, torch.device("cpu"), log=lambda s: None)
    try:
        samples = target.own_samples(256, 4)
        return {(rank, index): [target.file_rows[j] for j in BatchSource(
                    samples, 4, cfg.data.seed, 0, rank=rank, world_size=world_size,
                    bucket=cfg.data.length_buckets).sample_ids(index)]
                for rank, index in wanted}
    finally:
        target.close()


def _wait_for_training(proc: subprocess.Popen, socks: Path, timeout: float = 120) -> dict[int, int]:
    """Both ranks' pids (from their socket names) once rank 0 logged a step."""
    deadline, seen = time.monotonic() + timeout, []
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        assert proc.poll() is None, "".join(seen)[-3000:]
        line = proc.stdout.readline()
        if line:
            seen.append(line)
        pids = {}
        for p in socks.glob("*.sock"):
            name = parse_socket_filename(p.name)
            if name is not None and name.rank is not None:
                pids[name.rank] = name.pid
        if len(pids) == 2 and any(s.startswith("step ") for s in seen):
            os.set_blocking(proc.stdout.fileno(), True)
            return pids
        if not line:
            time.sleep(0.1)
    raise AssertionError("ranks did not start training: " + "".join(seen)[-3000:])


def _signal_rank_1_mid_run(setup, tmp_path, sig: int, collective_timeout: int):
    """Start a long 2-rank run, wait until it trains, send `sig` to rank 1; (proc, pids, time sent)."""
    target, data = setup
    socks = tmp_path / "socks"
    proc = _launch(target, data, tmp_path / "run", socks, "--max-steps", "100000",
                   "--collective-timeout", str(collective_timeout))
    pids = _wait_for_training(proc, socks)
    _wait_for_rank_0_to_hear_from(tmp_path / "run", pids[1])
    os.kill(pids[1], sig)
    return proc, pids, time.monotonic()


def _wait_for_rank_0_to_hear_from(run: Path, pid: int, timeout: float = 60) -> None:
    """Until rank 0's recorded cluster view holds a report from process `pid`: a rank stopped before
    its first report is "silent", which is only flagged after a long grace (ranks start unevenly)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        views = [f.cluster for f in read_frames(run / "telemetry.jsonl") if isinstance(f, Snapshot) and f.cluster]
        if any(r.pid == pid for v in views for r in v.ranks):
            return
        time.sleep(0.2)
    raise AssertionError("rank 0's cluster view never heard from rank 1")


def test_killing_a_rank_ends_the_job_with_a_clear_message(setup, tmp_path):
    proc, _, t0 = _signal_rank_1_mid_run(setup, tmp_path, signal.SIGKILL, 20)
    out = _finish(proc, timeout=90)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "dflash train: rank 0: " in out and "failed - another rank died or hung" in out, out[-4000:]
    assert "rank      : 1" in out and "SIGKILL" in out  # torchrun's summary names the root cause


def _read_until(proc: subprocess.Popen, text: str, timeout: float) -> str:
    """The run's output up to the first line holding `text` (or the run's end, or `timeout`)."""
    deadline, seen = time.monotonic() + timeout, []
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
            if not line:
                time.sleep(0.1)
                continue
            seen.append(line)
            if text in line:
                break
    finally:
        os.set_blocking(proc.stdout.fileno(), True)
    return "".join(seen)


def test_a_hung_rank_times_out_instead_of_blocking_forever(setup, tmp_path):
    # SIGSTOP: alive but stuck, so only a timeout can end the others' wait
    proc, pids, t0 = _signal_rank_1_mid_run(setup, tmp_path, signal.SIGSTOP, 8)
    try:
        out = _read_until(proc, "another rank died or hung", timeout=120)
        waited = time.monotonic() - t0
    finally:
        # the stopped rank ignores torchrun's SIGTERM: it would wait its 30 s grace before a SIGKILL,
        # which is torchrun's part, not what this test is about
        try:
            os.kill(pids[1], signal.SIGKILL)
        except ProcessLookupError:
            pass
    out += _finish(proc, timeout=120)
    assert proc.returncode != 0
    assert waited < 8 + 30, f"rank 0 gave up {waited:.0f} s after rank 1 stopped (collective timeout 8 s)"
    assert "another rank died or hung" in out and "Timed out" in out, out[-4000:]
    assert "[cluster view: stopped reporting: rank 1" in out, out[-4000:]


def _pin(pid: int, cpu: int) -> None:
    """Every thread of `pid` onto one CPU (sched_setaffinity on a pid moves only its main thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except ProcessLookupError:
            pass  # a thread that just ended


def _straggler_views(run: Path, since: float) -> list:
    """Rank 0's recorded cluster views from after unix time `since`."""
    return [f.cluster for f in read_frames(run / "telemetry.jsonl")
            if isinstance(f, Snapshot) and f.cluster and f.t > since]


def _views_until(run: Path, since: float, done, timeout: float, proc: subprocess.Popen) -> list:
    """Rank 0's cluster views since `since`, polled until `done(views)` holds or `timeout` passes."""
    views: list = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        views = _straggler_views(run, since)
        if done(views):
            break
        time.sleep(0.5)
    return views


def _run_of(n: int, straggler):
    """Whether the last `n` views all name `straggler` (None: no straggler)."""
    return lambda views: len(views) >= n and all(v.straggler == straggler for v in views[-n:])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to slow one rank down")
@pytest.mark.timeout(480)  # start-up, then up to 120 s balanced and 180 s hogged on a loaded machine
def test_a_rank_slowed_by_a_cpu_hog_is_named_the_straggler(setup, tmp_path):
    """A real straggler: each rank gets its own CPU, then busy loops share rank 1's. Rank 0 now waits
    for rank 1 in every all-reduce, and rank 0's cluster view must say so, steadily.

    The drafter's gradients go in many small DDP buckets (a 1B drafter has ~170): each bucket waits
    for the slow rank, so timing them one by one summed that wait many times over on every rank and
    clamped both at 100%. Timed once per step, the ranks read alike while balanced (no straggler) and
    the hogged one is named. The run is long and ends once the views show it (or a deadline passes):
    how soon a smoothing window fills depends on how busy the machine is, so a fixed run length failed
    under load."""
    target, data = setup
    run, socks = tmp_path / "run", tmp_path / "socks"
    cpus = sorted(os.sched_getaffinity(0))[:2]
    proc = _launch(target, data, run, socks, "--max-steps", "100000", "--max-time", "600", "--bucket-mb", "0.002")
    balanced: list = []
    views: list = []
    try:
        pids = _wait_for_training(proc, socks)
        _pin(pids[0], cpus[0])
        _pin(pids[1], cpus[1])
        balanced = _views_until(run, time.time(), _run_of(3, None), 120, proc)
        # Two busy loops, so that rank 1 keeps a third of its CPU against rank 0's whole one even
        # when other jobs on the machine float onto both CPUs (one hog lost to them under load).
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        try:
            for hog in hogs:
                os.sched_setaffinity(hog.pid, {cpus[1]})
            views = _views_until(run, time.time(), _run_of(5, 1), 180, proc)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    finally:
        proc.send_signal(signal.SIGTERM)  # torchrun forwards it: each rank checkpoints and exits
        out = _finish(proc)
    assert _run_of(3, None)(balanced), ("balanced ranks were named stragglers: "
                                        f"{[(v.straggler, [r.allreduce_share for r in v.ranks]) for v in balanced]}")
    assert all(r.allreduce_share < 0.95 for r in balanced[-1].ranks), balanced[-1].ranks  # not clamped
    assert views, "rank 0 published no cluster view after the hog started: " + out[-3000:]
    # Once the hog has run for a smoothing window, rank 1 is the straggler in every view, five in a row.
    assert [v.straggler for v in views[-5:]] == [1] * 5, [(v.straggler, [r.allreduce_share for r in v.ranks])
                                                          for v in views]
    last = views[-1]
    ar = {r.rank: r.allreduce_share for r in last.ranks}
    assert ar[0] > ar[1] + 0.05, ar  # rank 0 waits for rank 1
    assert last.straggler_reason.startswith("rank 1 waits")


def test_bench_distributed_runs_two_ranks_and_reports_json():
    script = Path(__file__).resolve().parent.parent / "scripts" / "bench_distributed.py"
    r = subprocess.run([sys.executable, str(script), "--json", "--steps", "20", "--rounds", "1", "--work-ms", "2"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(r.stdout)
    assert set(data["overhead_us_per_step"]) == {"waited", "overlapped"}
    assert data["waited_vs_overlapped"] > 0 and "foreign_load_cores" in data
