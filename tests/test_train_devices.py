"""Which GPU and which stream each thread of a run uses. There is no GPU here, so torch's three calls
that bind a thread (set_device, Stream, set_stream) are replaced by recorders: what the tests check is
the binding logic, i.e. which device and stream each real thread of a real pipeline and a real
telemetry publisher asks for. scripts/gpu_check.py's thread_device check runs the same on a GPU."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, wait_until

from dflash.telemetry import ProfileStats
from dflash.train.config import TrainConfig
from dflash.train.config.schema import updated
from dflash.train.device.binding import bindings
from dflash.train.distributed import Dist
from dflash.train.reporting import Reporter
from dflash.train.run.pipeline import Pipeline, TrainCounters

G0, G1 = torch.device("cuda:0"), torch.device("cuda:1")


class CudaCalls:
    """What each thread asked of CUDA: its current device, and the streams it made current."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.device: dict[str, torch.device] = {}
        self.streams: dict[str, list[FakeStream]] = {}
        self.lock = threading.Lock()
        calls = self

        class FakeStream:
            def __init__(self, device=None, **_):
                self.device = torch.device(device)

        def set_device(dev) -> None:
            with calls.lock:
                calls.device[threading.current_thread().name] = torch.device(dev)

        def set_stream(stream) -> None:
            with calls.lock:
                calls.streams.setdefault(threading.current_thread().name, []).append(stream)

        monkeypatch.setattr(torch.cuda, "set_device", set_device)
        monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
        monkeypatch.setattr(torch.cuda, "set_stream", set_stream)


def _pipeline(stats: ProfileStats, target_device: torch.device, drafter_device: torch.device, pipelined: bool,
              steps: int = 3) -> Pipeline:
    """The real Pipeline with stand-in stages that claim GPUs (they do no torch work)."""
    state = TrainCounters()

    class Target:
        name, device, tel = "target-0", target_device, stats.worker("target-0")

        def __call__(self, batch):
            return SimpleNamespace(batch=batch)

    drafter = SimpleNamespace(device=drafter_device, tel=stats.worker("drafter-0"),
                              step=lambda hb, progress: SimpleNamespace())

    def on_step(r) -> bool:
        state.step += 1
        state.next_batch += 1
        return state.step < steps

    cfg = updated(TrainConfig(), pipeline=pipelined, batch_queue_size=2, hs_queue_size=2)
    return Pipeline(lambda i: SimpleNamespace(index=i), [Target()], drafter, cfg.pipeline, cfg.run, stats, state,
                    on_step)


def _run(p: Pipeline) -> None:
    p.start()
    for t in p.threads:
        t.join(10)
    assert p.shutdown(timeout=1) == [] and p.failure is None


def test_each_compute_worker_on_a_shared_gpu_launches_on_its_own_stream(monkeypatch) -> None:
    """Target and drafter on one GPU: each binds that GPU and makes its own stream current, so their
    kernels do not queue behind each other on the default stream (and each span times only its own);
    the batch producer only pins memory and keeps the default stream."""
    calls = CudaCalls(monkeypatch)
    _run(_pipeline(ProfileStats(), G1, G1, pipelined=True))
    assert calls.device == {"batch-producer": G1, "target-0": G1, "drafter-0": G1}
    assert "batch-producer" not in calls.streams
    (t_stream,), (d_stream,) = calls.streams["target-0"], calls.streams["drafter-0"]
    assert t_stream is not d_stream and t_stream.device == d_stream.device == G1
    assert bindings()["drafter-0"] == "cuda:1"


def test_sync_mode_gets_a_stream_on_each_gpu_it_drives(monkeypatch) -> None:
    calls = CudaCalls(monkeypatch)
    _run(_pipeline(ProfileStats(), G1, G0, pipelined=False))
    assert calls.device == {"trainer": G0}  # the drafter's GPU first
    assert [s.device for s in calls.streams["trainer"]] == [G0, G1]


def test_host_only_workers_never_touch_cuda(monkeypatch) -> None:
    calls = CudaCalls(monkeypatch)
    _run(_pipeline(ProfileStats(), torch.device("cpu"), torch.device("cpu"), pipelined=True))
    assert calls.device == {} and calls.streams == {}
    assert bindings()["target-0"] == "cpu"


def test_the_telemetry_publisher_binds_the_trainers_gpu_before_it_resolves_events(monkeypatch, tmp_path,
                                                                                  sock_dir) -> None:
    """The publisher thread resolves the workers' CUDA events; unbound, it would open a context on GPU 0
    from every rank. Monitoring starts it bound to the trainer's device."""
    from dflash.train.reporting.monitoring import Monitoring

    calls = CudaCalls(monkeypatch)
    cfg = updated(TrainConfig(), run_dir=str(tmp_path / "run"), socket_dir=str(sock_dir), stall_timeout=0.0)
    m = Monitoring(cfg, Dist(), ProfileStats(), Reporter(lambda line: None), device=G1)
    m.start()
    try:
        wait_until(lambda: "dflash-telemetry" in calls.device, what="the publisher thread to bind a device")
        assert calls.device["dflash-telemetry"] == G1
        assert "dflash-telemetry" not in calls.streams  # it launches no kernels: no stream of its own
    finally:
        m.close(failed=False, linger=False)


def _rank(local_rank: int, local_world: int) -> Dist:
    return Dist(rank=local_rank, world_size=local_world, local_rank=local_rank, local_world_size=local_world)


def test_under_torchrun_numbered_devices_name_each_ranks_own_gpus() -> None:
    """A config names one rank's devices: numbered GPUs are counted from that rank's first GPU, so four
    ranks with a target on cuda:1 and a drafter on cuda:0 use GPUs 0-7, not all of them GPUs 0 and 1."""
    from dflash.train.distributed import place_devices

    placed = [place_devices(["cuda:1"], "cuda:0", _rank(r, 4), gpus=8) for r in range(4)]
    assert placed == [(["cuda:1"], "cuda:0"), (["cuda:3"], "cuda:2"), (["cuda:5"], "cuda:4"), (["cuda:7"], "cuda:6")]
    # two targets and the drafter on one GPU per rank; a bare cuda is the rank's own GPU; cpu stays
    assert place_devices(["cuda:0", "cuda:0"], "cuda:0", _rank(2, 4), gpus=4) == (["cuda:2", "cuda:2"], "cuda:2")
    assert place_devices(["cuda", "cpu"], "cuda", _rank(3, 4), gpus=4) == (["cuda:3", "cpu"], "cuda:3")
    # one process (no torchrun): as given
    assert place_devices(["cuda:1"], "cuda:0", Dist(), gpus=2) == (["cuda:1"], "cuda:0")


def test_under_torchrun_devices_that_cannot_be_placed_are_refused_in_one_line() -> None:
    from dflash.train.distributed import DistError, place_devices

    with pytest.raises(DistError) as e:
        place_devices(["cuda:0", "cuda:1"], "cuda:2", _rank(0, 8), gpus=8)
    assert "3 GPU(s) per rank" in str(e.value) and "need 24, it has 8" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(DistError, match="mix a bare cuda"):
        place_devices(["cuda:1"], "cuda", _rank(0, 2), gpus=4)


def test_pyproject_declares_the_versions_the_start_check_accepts() -> None:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    from dflash.train.versions import BELOW_TORCH, BELOW_TRANSFORMERS, MIN_TORCH, MIN_TRANSFORMERS

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={MIN_TORCH},<{BELOW_TORCH}" in deps
    assert f"transformers>={MIN_TRANSFORMERS},<{BELOW_TRANSFORMERS}" in deps


def test_an_older_torch_is_refused_at_start_in_one_line(monkeypatch, tmp_path, capsys) -> None:
    """No older torch can be installed next to this one: the version it reports is what is replaced."""
    from dflash.train.trainer import train

    monkeypatch.setattr(torch, "__version__", "2.4.1+cu121")
    cfg = updated(TrainConfig(), run_dir=str(tmp_path / "run"), max_steps=1)
    assert train(cfg) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("dflash train: error: torch 2.4.1+cu121 is too old: dflash trains with torch>=2.11,<2.14 "
                   "(pip install 'torch>=2.11,<2.14')")
    assert not (tmp_path / "run").exists()  # nothing started, nothing left behind


def test_a_transformers_outside_the_range_is_refused_by_every_command_in_one_line(monkeypatch, tmp_path,
                                                                                 capsys) -> None:
    """An untested transformers (newer: 5.25 broke the hybrid rollback the day it came out; older) stops
    `dflash train` and the other commands that load a model before they start, not deep in a forward."""
    import transformers

    from dflash.cli import main
    from dflash.train.trainer import train

    expected = ("transformers 5.26.0 is outside the range dflash was tested with: transformers>=5.17,<5.26 "
                "(pip install 'transformers>=5.17,<5.26'); `make compat` runs the suite under another")
    monkeypatch.setattr(transformers, "__version__", "5.26.0")
    assert train(updated(TrainConfig(), run_dir=str(tmp_path / "run"), max_steps=1)) == 2
    assert capsys.readouterr().err.strip() == f"dflash train: error: {expected}"
    assert not (tmp_path / "run").exists()
    for argv in (["eval", "--drafter", str(tmp_path)], ["data", "demo", "--out", str(tmp_path / "d.jsonl")]):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip() == f"dflash {argv[0]}: error: {expected}"
    assert not (tmp_path / "d.jsonl").exists()
    monkeypatch.setattr(transformers, "__version__", "5.16.1")
    assert main(["eval", "--drafter", str(tmp_path)]) == 2
    assert "transformers 5.16.1 is outside the range" in capsys.readouterr().err


def test_the_ends_of_the_transformers_range_and_their_builds() -> None:
    """The lent GPU machine's 5.17 and the newest tested 5.25 (any patch) are accepted; a pre-release
    of the first untested version counts as that version."""
    from dflash.train.config import ConfigError
    from dflash.train.versions import check_transformers

    for accepted in ("5.17.0", "5.25.0", "5.25.3"):
        check_transformers(accepted)
    for refused in ("5.26.0.dev0", "5.16.1", "4.57.6", "6.0.0"):
        with pytest.raises(ConfigError, match="outside the range"):
            check_transformers(refused)


def test_the_lent_gpu_machines_torch_is_accepted_and_the_release_before_it_refused() -> None:
    """The GPU machine's vendor build (2.11.0+cu130) trains; 2.10 has never run the suite."""
    from dflash.train.config import ConfigError
    from dflash.train.versions import check_torch

    for accepted in ("2.11.0+cu130", "2.11.1", "2.13.0+cpu", "2.14.0.dev20261101"):
        check_torch(accepted)
    with pytest.raises(ConfigError, match=r"torch 2\.10\.1 is too old"):
        check_torch("2.10.1")


def test_the_checkpoint_writer_binds_the_trainers_gpu(monkeypatch, tmp_path) -> None:
    """The writer thread waits on the snapshot's CUDA event: bound to the trainer's GPU first, like
    every thread that touches CUDA (a CPU state here: nothing to wait for, the binding is the point)."""
    from dflash.train.checkpoint.writer import WRITER_THREAD, CheckpointWriter

    calls = CudaCalls(monkeypatch)
    done: list = []
    writer = CheckpointWriter(lambda step, state: tmp_path / f"{step}", done.append, G1)
    writer.submit(1, {"w": torch.zeros(2)}, None, 8)
    writer.close()
    assert done and done[0].error is None
    assert calls.device == {WRITER_THREAD: G1} and WRITER_THREAD not in calls.streams


def test_joining_the_process_group_binds_the_ranks_drafter_gpu_not_cuda_local_rank(monkeypatch) -> None:
    """With two GPUs per rank, local rank 1's drafter is cuda:2: the main thread must bind that one
    before NCCL sets up, not cuda:1 (rank 0's target GPU). No NCCL here: the join then fails, after
    the binding, with the one-line error the trainer prints."""
    from dflash.train.distributed import DistError, init, place_devices

    calls = CudaCalls(monkeypatch)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens there
    d = _rank(1, 2)
    _, drafter = place_devices(["cuda:1"], "cuda:0", d, gpus=4)
    with pytest.raises(DistError, match="cannot join the process group"):
        init(d, drafter, timeout_s=1.0)
    assert calls.device == {threading.current_thread().name: torch.device("cuda:2")}
