"""Two nodes on one machine: two torchrun agents (`--nnodes 2 --node-rank 0|1`, one rank each), started as two
separate processes the way two machines start them, train one job over a static rendezvous on 127.0.0.1.

Both ranks are local rank 0 of their node, so anything keyed by the local rank where the global rank belongs
(a recording, a socket, a data shard, a checkpoint's RNG, a metrics label, a stall's stacks) repeats or
collides here; the single-node tests, where local and global ranks coincide, cannot see it. The nodes share
one run directory, as dflash requires of a multi-node job (docs/distributed.md); a node that sees another one
is refused at start.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import demo_cache, wait_until
from test_train_distributed import cache_batch_rows, rank_env, train_args

from dflash.checkpoint_files import list_checkpoints
from dflash.data.cache_format import sample_path
from dflash.telemetry.wire.protocol import Event, Hello, Snapshot
from dflash.telemetry.wire.reader import read_frames
from dflash.telemetry.wire.sockets import parse_socket_filename

pytestmark = pytest.mark.timeout(300)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    """One torchrun agent with its one rank (a node of the job), its output read as it comes."""

    def __init__(self, node_rank: int, master_port: int, args: list[str], env: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(master_port),
               "-m", "dflash", "train", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def finish(self, deadline: float) -> str:
        """Its whole output once the agent has exited and its rank closed the pipe (by ``deadline``)."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node still running at the deadline:\n{self.out[-3000:]}") from None
        self._reader.join(timeout=max(1.0, deadline - time.monotonic()))
        return self.out

    def kill(self) -> None:
        """The agent and everything under it: torchrun starts its rank in a session of its own, so a process
        group kill would leave the rank (and any py-spy it runs) behind."""
        for pid in reversed(_tree(self.proc.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, parents first (Linux /proc)."""
    found = [pid]
    for tid in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (tid / "children").read_text().split()
        except OSError:
            continue
        for kid in kids:
            found += _tree(int(kid))
    return found


def _run_nodes(args: list[list[str]], env: list[dict[str, str]], timeout: float = 150,
               while_running=None) -> list[tuple[int, str]]:
    """Both nodes of one job (node k with ``args[k]`` and ``env[k]``) run to their end: their exit codes and
    outputs. ``while_running(nodes)``, when given, is called once both have started. No process outlives
    the call, whatever fails."""
    port = _free_port()
    nodes = []
    try:
        for k in (0, 1):
            nodes.append(Node(k, port, args[k], env[k]))
        if while_running is not None:
            while_running(nodes)
        deadline = time.monotonic() + timeout
        outputs = [n.finish(deadline) for n in nodes]
        return [(n.proc.returncode, text) for n, text in zip(nodes, outputs, strict=True)]
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                n.kill()


def _scrape_when_lingering(nodes: list[Node], bodies: dict[int, str]) -> None:
    """Each node's /metrics (at the port its rank says it serves), read once the rank lingers for the run's
    last scrape (which ends the linger)."""
    for k, node in enumerate(nodes):
        wait_until(lambda n=node: "serving the final numbers" in n.out, timeout=150,
                   what=f"node {k} to serve its final metrics", proc=node.proc, output=lambda n=node: n.out[-3000:])
        port = re.search(r"\[rank \d+\] metrics: +http://127\.0\.0\.1:(\d+)/metrics", node.out).group(1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            bodies[k] = r.read().decode()


def _frames_of_last_start(path: Path) -> list:
    """The frames a recording got from its latest run (a resumed run appends after its own hello)."""
    frames = list(read_frames(path))
    start = max(i for i, f in enumerate(frames) if isinstance(f, Hello))
    return frames[start:]


def _first_bad_row(frames: list) -> int:
    """The cache row of the first bad sample a rank reported: the first it read from its own shard."""
    named = [e.message for e in frames if isinstance(e, Event) and "bad sample skipped" in e.message]
    assert named, "the rank reported no bad sample"
    return int(re.search(r"hs_(\d+)\.safetensors", named[0]).group(1))


def _break(cache: Path, rows: list[int]) -> dict[Path, bytes]:
    """Truncate the rows' files (each is skipped as a bad sample, named in the reading rank's telemetry);
    returns their bytes for putting them back."""
    kept = {}
    for row in rows:
        path = sample_path(cache, row)
        kept[path] = path.read_bytes()
        path.write_bytes(kept[path][:-64])
    return kept


def test_two_nodes_train_agree_checkpoint_and_resume_keyed_by_global_rank(tmp_path):
    """Two nodes, one rank each, one shared run directory: they train 6 steps (both drafters stalled once
    at step 2, so each rank writes its stacks), agree on the final checkpoint, and resume to step 9; a
    resume where node 1 sees a run directory of its own is refused on both. Every rank-keyed thing is
    checked against the global rank: recordings, sockets, data shards (first bad sample each rank reads),
    per-rank RNG in the checkpoint, the metrics port and label, stall stack files, rank 0's cluster view."""
    cache = demo_cache(tmp_path, 25)
    run, socks = tmp_path / "run", tmp_path / "socks"
    rows = cache_batch_rows(cache, [(0, 0), (1, 0), (0, 6), (1, 6)])
    # One bad file in each rank's first batch: a rank that took another rank's shard would name the other's.
    first = [rows[0, 0][0], rows[1, 0][0]]
    kept = _break(cache, first)
    metrics = [_free_port(), _free_port()]  # one machine: each "node" needs its own port (real nodes share P)
    common = ["--hidden-states", str(cache), "--max-seq-len", "256", "--block-size", "4", "--stall-timeout", "0.5"]
    args = [train_args("tiny", None, run, socks, *common, "--max-steps", "6", "--metrics-port", str(metrics[k]),
                       "--metrics-linger", "60") for k in (0, 1)]
    bodies: dict[int, str] = {}
    # Both drafters hang 1.5 s at step 2: past --stall-timeout on both ranks at once, in the same second.
    env = rank_env("hang:drafter:step=2:seconds=1.5")
    ends = _run_nodes(args, [env, env], while_running=lambda nodes: _scrape_when_lingering(nodes, bodies))
    out = [text for _, text in ends]
    assert [rc for rc, _ in ends] == [0, 0], out[0][-3000:] + out[1][-3000:]
    assert "distributed: 2 ranks (gloo)" in out[0], out[0][-3000:]
    assert "replicas in sync at step 6" in out[0] and "on all 2 ranks" in out[0], out[0][-3000:]

    # Recordings: one per global rank in the shared run directory, none written twice.
    assert sorted(p.name for p in run.glob("telemetry*.jsonl")) == ["telemetry-r1.jsonl", "telemetry.jsonl"]
    recordings = {0: run / "telemetry.jsonl", 1: run / "telemetry-r1.jsonl"}
    hellos = {k: next(f for f in read_frames(path) if isinstance(f, Hello)) for k, path in recordings.items()}
    assert [(h.rank, h.world_size) for h in hellos.values()] == [(0, 2), (1, 2)]
    pids = {k: h.pid for k, h in hellos.items()}
    assert pids[0] != pids[1]

    # Sockets: <run>-<pid>-r<global rank>.sock, each node's own rank in its own name.
    for k in (0, 1):
        said = re.search(rf"\[rank {k}\] telemetry: (\S+)", out[k])
        assert said, out[k][-3000:]
        name = parse_socket_filename(Path(said.group(1)).name)
        assert (name.rank, name.pid) == (k, pids[k]), said.group(1)

    # Metrics: port P + local rank (0 on both nodes), labelled with the global rank.
    for k in (0, 1):
        assert f"[rank {k}] metrics:   http://127.0.0.1:{metrics[k]}/metrics" in out[k], out[k][-3000:]
        assert f'rank="{k}"' in bodies[k] and f'rank="{1 - k}"' not in bodies[k], bodies[k][:2000]

    # Data shards: each rank read its own slice of batch 0 (the trainer's BatchSource for its global rank).
    for k in (0, 1):
        assert _first_bad_row(list(read_frames(recordings[k]))) == first[k], k

    # The checkpoint holds each rank's own RNG: ranks seeded alike would draw the same anchors.
    ckpt = torch.load(list_checkpoints(run)[-1], weights_only=True)
    assert ckpt["state"]["step"] == 6
    per_rank = ckpt["rng_per_rank"]
    assert len(per_rank) == 2 and not torch.equal(per_rank[0]["anchors"], per_rank[1]["anchors"])

    # Stall stacks: each rank wrote its own file into the shared stalls/, named for its global rank.
    stacks: dict[int, list[Path]] = {}
    for k in (0, 1):
        stalls = [e for e in read_frames(recordings[k]) if isinstance(e, Event) and e.kind == "stall"]
        assert any(e.data["worker"] == "drafter-0" for e in stalls), (k, [e.message for e in stalls])
        stacks[k] = [Path(e.data["stack_file"]) for e in stalls]
        for path in stacks[k]:
            assert path.parent == run / "stalls" and f"pid {pids[k]}," in path.read_text().splitlines()[0], path
    # Their names without the time stamp (`%Y%m%d-%H%M%S-`) differ: both ranks stalled within one second,
    # and names alike would have been one file, the later rank's stacks over the earlier's.
    untimed = [{p.name.split("-", 2)[2] for p in stacks[k]} for k in (0, 1)]
    assert not untimed[0] & untimed[1], untimed

    # Rank 0's cluster view: both nodes' ranks, by global rank and process.
    views = [f.cluster for f in read_frames(recordings[0]) if isinstance(f, Snapshot) and f.cluster]
    assert views and all([r.rank for r in v.ranks] == [0, 1] for v in views), views[-1:]
    both = [v for v in views if [r.pid for r in v.ranks] == [pids[0], pids[1]]]
    assert both and all(r.step >= 1 for r in both[-1].ranks), views[-1]
    assert all(f.cluster is None for f in read_frames(recordings[1]) if isinstance(f, Snapshot))

    # A node that sees a run directory of its own (no shared filesystem) is refused, on both nodes, at start.
    own = tmp_path / "node1-own-run"
    resume = ["--resume", "--max-steps", "9", "--metrics-linger", "0"]
    refused = _run_nodes([train_args("tiny", None, rd, socks, *common, *resume, "--metrics-port", str(metrics[k]))
                          for k, rd in enumerate((run, own))], [rank_env(), rank_env()], timeout=60)
    for rc, text in refused:
        assert rc != 0 and "the ranks see different run directories" in text, text[-3000:]
        assert f"sees no checkpoint in {own.resolve()}" in text and "step-00000006.pt" in text, text[-3000:]
    assert len(list_checkpoints(run)) == 1

    # The real resume: both nodes on the shared directory, each continuing its own shard at batch 6.
    for path, data in kept.items():
        path.write_bytes(data)
    later = [rows[0, 6][0], rows[1, 6][0]]
    _break(cache, later)
    ends = _run_nodes([train_args("tiny", None, run, socks, *common, *resume, "--metrics-port", str(metrics[k]))
                       for k in (0, 1)], [rank_env(), rank_env()])
    out = [text for _, text in ends]
    assert [rc for rc, _ in ends] == [0, 0], out[0][-3000:] + out[1][-3000:]
    assert "resumed from step 6" in out[0] and "replicas in sync at step 9" in out[0], out[0][-3000:]
    assert "on all 2 ranks" in out[0]
    ckpt = torch.load(list_checkpoints(run)[-1], weights_only=True)
    assert ckpt["state"]["step"] == 9
    per_rank = ckpt["rng_per_rank"]  # each rank went on from its own saved RNG, not rank 0's
    assert len(per_rank) == 2 and not torch.equal(per_rank[0]["anchors"], per_rank[1]["anchors"])
    for k in (0, 1):
        assert _first_bad_row(_frames_of_last_start(recordings[k])) == later[k], k
