"""The cluster view: report smoothing, min/mean/max across ranks, the straggler, stale ranks.

The exchange runs over a real torch.distributed TCPStore (the kind torchrun hosts), in one process.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from dflash.telemetry import ProfileStats
from dflash.telemetry.export.cluster import ClusterExchange, RankReport, build_cluster


def _rep(rank: int, allreduce: float, **shares: float) -> RankReport:
    return RankReport(rank=rank, seq=1, host="h", pid=100 + rank, step=10, tokens_per_s=1000.0,
                      allreduce_share=allreduce, shares={k.replace("__", "/"): v for k, v in shares.items()})


def test_min_mean_max_and_the_slowest_rank_per_category():
    reports = {0: _rep(0, 0.40, drafter__drafter_forward=0.30, target__target_forward=0.50),
               1: _rep(1, 0.05, drafter__drafter_forward=0.32, target__target_forward=0.90),
               2: _rep(2, 0.38, drafter__drafter_forward=0.31, target__target_forward=0.52)}
    c = build_cluster(3, reports, {0: 0.1, 1: 0.1, 2: 0.1}, stale_after_s=5)
    top = c.categories[0]
    assert top.key == "target/target_forward"  # widest spread first
    assert (top.min, top.max, top.min_rank, top.max_rank) == (0.50, 0.90, 0, 1)
    assert top.mean == pytest.approx((0.5 + 0.9 + 0.52) / 3, abs=1e-4)
    # Rank 1 waits least in the all-reduce: the others wait for it, and its target forward is why.
    assert c.straggler == 1
    assert "rank 1 waits 5%" in c.straggler_reason and "target/target_forward" in c.straggler_reason
    assert c.stale == [] and [r.rank for r in c.ranks] == [0, 1, 2]


def test_no_straggler_when_waits_are_even():
    reports = {0: _rep(0, 0.20, a__x=0.5), 1: _rep(1, 0.22, a__x=0.5)}
    c = build_cluster(2, reports, {0: 0.0, 1: 0.0}, stale_after_s=5)
    assert c.straggler is None and c.straggler_reason == ""


def test_stale_silent_and_finished_ranks():
    finished = _rep(2, 0.1)
    finished.state = "finished"
    reports = {0: _rep(0, 0.1, a__x=0.4), 1: _rep(1, 0.5, a__x=0.9), 2: finished}
    c = build_cluster(4, reports, {0: 0.5, 1: 30.0, 2: 30.0}, stale_after_s=5, silent_for_s=120)
    by = {r.rank: r for r in c.ranks}
    assert by[1].stale and not by[0].stale
    assert not by[2].stale and by[2].state == "finished"  # ended on purpose: not flagged
    assert by[3].state == "silent" and by[3].stale  # never reported, long after start
    assert c.stale == [1, 3]
    # Stale and finished ranks do not feed the min/max, nor can they be named the straggler.
    assert c.categories[0].max_rank == 0 and c.straggler is None
    early = build_cluster(2, {0: _rep(0, 0.1)}, {0: 0.0}, stale_after_s=5, silent_for_s=3)
    assert early.ranks[1].state == "silent" and not early.ranks[1].stale


@pytest.fixture()
def store():
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=5))
    yield client
    del client, server


def _stats_with_work(name: str, seconds: float) -> ProfileStats:
    stats = ProfileStats()
    w = stats.worker("drafter-0")
    w.add(name, seconds)
    stats.count("tokens", 100)
    stats.gauge("step", 3)
    stats.gauge("loss", 2.5)
    return stats


def test_exchange_over_a_real_store_flags_a_rank_that_goes_quiet(store):
    s0, s1 = _stats_with_work("drafter_forward", 0.01), _stats_with_work("drafter_forward", 0.02)
    r0 = ClusterExchange(store, 0, 2, s0.drain, interval_s=0.05, socket_path="/tmp/r0.sock", stale_after_s=0.5)
    r1 = ClusterExchange(store, 1, 2, s1.drain, interval_s=0.05, socket_path="/tmp/r1.sock")
    r0.start(), r1.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        v = r0.view()
        if v is not None and all(r.state == "training" and r.pid for r in v.ranks):
            break
        time.sleep(0.05)
    v = r0.view()
    assert [r.rank for r in v.ranks] == [0, 1] and v.ranks[1].socket == "/tmp/r1.sock" and not v.stale
    assert r1.view() is None  # only rank 0 assembles the view

    r1._stop.set()  # rank 1 hangs: its thread stops writing, without saying goodbye
    r1._thread.join()
    deadline = time.monotonic() + 10
    while 1 not in (r0.view().stale or []) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r0.view().stale == [1] and r0.view().ranks[1].age_s >= 0.5
    r1.close("finished")  # ... and then ends on purpose after all: no longer flagged
    deadline = time.monotonic() + 10
    while r0.view().stale and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r0.view().stale == [] and r0.view().ranks[1].state == "finished"
    r0.close()


def test_a_store_that_went_away_costs_the_view_not_the_caller():
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=1))
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=1))
    del server  # torchrun's agent (which hosts the store) is gone
    ex = ClusterExchange(client, 0, 2, lambda: None, interval_s=0.05)
    ex._tick()  # what the thread does each interval: must return, with the reason in the view
    view = ex.view()
    assert view.world_size == 2 and view.error.startswith("cluster exchange failed: ")
    assert "\n" not in view.error
