"""A steady-state training step never reads the device back to the host.

On a GPU each such read (`.item()`, `float(t)`, `.tolist()`, `bool(t)`, `.nonzero()`, boolean-mask
indexing, a copy to the host) blocks the worker until everything queued before it has run, so the
target and drafter stages would take turns instead of overlapping. There is no GPU here, so the test
counts the Python-level calls that would be such reads, made from the pipeline's worker threads
(target-N, drafter-N) during steady-state steps of the real trainer: real stages, a real tiny Qwen3
target built from a config, real threads. scripts/gpu_check.py runs the same steps on CUDA under
torch.cuda.set_sync_debug_mode("error").

On CPU every tensor is on the host, so a move between devices cannot be told from a no-op: copies
are counted when they are explicit moves to the host (`.cpu()`, `.numpy()`, `.to("cpu")` spelled
out); blocking host-to-device copies are left to the CUDA check.
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from test_model_helpers import make_target_dir, make_tokenizer, one_thread  # noqa: F401
from test_train_pipeline import _cfg, _write_data

from dflash.testing import CudaSyncLog, run_steady

WORKERS = ("target-", "drafter-")


def _bool_index(args: tuple) -> bool:
    idx = args[0] if args else None
    parts = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _to_host(args: tuple, kwargs: dict) -> bool:
    dev = kwargs.get("device", args[0] if args else None)
    return isinstance(dev, str) and dev.startswith("cpu") and not kwargs.get("non_blocking", False)


#: Tensor methods that read device data on the host, and when a call counts
SYNCING = {
    "item": None, "tolist": None, "__bool__": None, "__int__": None, "__float__": None, "__index__": None,
    "nonzero": None, "masked_select": None, "cpu": None, "numpy": None,
    "__getitem__": lambda a, k: _bool_index(a), "__setitem__": lambda a, k: _bool_index(a),
    "to": _to_host,
}


@contextmanager
def count_syncs(counts: collections.Counter) -> Iterator[None]:
    """Count syncing calls from worker threads into ``counts`` (key: method and calling file:line)."""
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def wrap(name, original, when):
        def counted(self, *args, **kwargs):
            if threading.current_thread().name.startswith(WORKERS) and (when is None or when(args, kwargs)):
                f = sys._getframe(1)
                counts[f"{name} at {f.f_code.co_filename.rsplit('site-packages/', 1)[-1]}:{f.f_lineno}"] += 1
            return original(self, *args, **kwargs)
        return counted

    for name, when in SYNCING.items():
        setattr(torch.Tensor, name, wrap(name, originals[name], when))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("syncs")
    return make_target_dir(root / "target", layers=4, tokenizer=make_tokenizer()), _write_data(root / "data.jsonl")


def test_the_counter_sees_each_kind_of_read() -> None:
    """The instrument itself: every kind of read is counted from a worker thread, none from others."""
    counts: collections.Counter = collections.Counter()
    t = torch.arange(6.0)

    def reads() -> None:
        t.sum().item(); t.tolist(); bool(t[0]); int(t[1]); float(t[2]); t.nonzero()  # noqa: E702
        _ = t[t > 2]; t.cpu(); t.to("cpu"); t.to(torch.float64)  # noqa: E702

    with count_syncs(counts):
        for name in ("drafter-0", "batch-producer"):
            th = threading.Thread(target=reads, name=name)
            th.start()
            th.join()
    kinds = collections.Counter(k.split(" ")[0] for k in counts)
    assert kinds == {"item": 1, "tolist": 1, "__bool__": 1, "__int__": 1, "__float__": 1, "nonzero": 1,
                     "__getitem__": 1, "cpu": 1, "to": 1}, counts


@pytest.mark.parametrize("layers", [{}, {"drafter_layers": 2,
                                         "drafter_layer_types": ["sliding_attention", "full_attention"],
                                         "drafter_sliding_window": 5},
                                    {"loss": "kl", "optimizer": "muon"}, {"position_weight": "dpace"}],
                         ids=["full", "sliding", "kl-muon", "dpace"])
def test_steady_state_steps_make_no_syncing_call(setup, tmp_path, monkeypatch, layers) -> None:
    target, data = setup
    # The non-finite guard reads its counters after every step only where that read is free (a CPU
    # tensor); on CUDA it reads them once per log interval. Run it as on CUDA.
    from dflash.train.health.nonfinite import NonFiniteGuard

    monkeypatch.setattr(NonFiniteGuard, "reads_free", property(lambda self: False))
    counts: collections.Counter = collections.Counter()
    trainer = run_steady(_cfg(target, data, tmp_path / "run", num_anchors=8, **layers), warmup=3, steps=8,
                         guard=lambda: count_syncs(counts))
    assert trainer.state.step == 11
    assert sum(counts.values()) == 0, f"{sum(counts.values()) / 8:.1f} syncing calls per step: {dict(counts)}"


def test_each_thread_binds_the_first_gpu_it_touches_and_host_threads_none() -> None:
    from dflash.train.device.binding import resolve, thread_device

    cpu, g0, g1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert thread_device(cpu, cpu) is None  # host-only: must not initialise CUDA at all
    assert thread_device(g1, g0) == g1  # a target on GPU 1 feeding a drafter on GPU 0 binds GPU 1
    assert thread_device(cpu, g1) == g1  # a CPU target still copies to the drafter's GPU
    assert resolve("cpu") == cpu and resolve("cuda:1") == g1



def test_the_sync_log_names_the_thread_that_synchronised_and_where() -> None:
    """torch's sync debug mode is process-wide: the log takes each sync warning in the thread that raised
    it, so a worker's sync is told apart from the main thread's once-per-interval read of the metrics
    (on CUDA torch raises these warnings; here the same message is raised by hand, from named threads)."""
    import warnings

    def synchronise() -> None:
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    def worker(name: str) -> threading.Thread:
        return threading.Thread(target=lambda: [synchronise() for _ in range(2)], name=name)

    before = (warnings.showwarning, list(warnings.filters))
    with CudaSyncLog() as log:
        threads = [worker("drafter-0"), worker("dflash-telemetry")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        synchronise()
        with pytest.warns(UserWarning, match="something else"):  # other warnings go on as before
            warnings.warn("something else", UserWarning, stacklevel=1)
    assert (warnings.showwarning, list(warnings.filters)) == before  # put back for every thread
    assert list(log.workers()) == ["drafter-0"] and len(log.workers()["drafter-0"]) == 2  # each one, not once
    assert set(log.others()) == {"dflash-telemetry", threading.current_thread().name}
    assert all("synchronise" in w for ws in log.by_thread.values() for w in ws)  # where: the calling function
