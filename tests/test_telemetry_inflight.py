"""In-flight spans: what each worker is doing now, and windows that book a long span where it ran."""

from __future__ import annotations

import threading
import time

import pytest

from dflash.telemetry import ProfileStats
from dflash.telemetry.summary import to_snapshot
from dflash.telemetry.wire import protocol as P


def _hold(stats: ProfileStats, worker: str, category: str, cuda: bool = False):
    """A real thread that opens a span and keeps it open until released."""
    entered, release = threading.Event(), threading.Event()

    def body() -> None:
        w = stats.worker(worker)
        with (w.cuda_span(category) if cuda else w.span(category)):
            entered.set()
            release.wait(30)

    t = threading.Thread(target=body, name=worker, daemon=True)
    t.start()
    assert entered.wait(10)
    return t, release


@pytest.mark.parametrize("cuda", [False, True])
def test_open_span_is_in_every_snapshot(cuda: bool) -> None:
    s = ProfileStats()
    s.worker("drafter-0").add("h2d", 0.001)
    t, release = _hold(s, "drafter-0", "drafter_backward", cuda=cuda)
    first = s.drain()
    op = first.inflight["drafter-0"]
    assert op.category == "drafter_backward" and op.depth == 1
    time.sleep(0.02)
    second = s.drain()
    assert second.inflight["drafter-0"].elapsed > op.elapsed
    assert second.inflight["drafter-0"].start == pytest.approx(op.start, abs=1e-3)
    snap = P.decode(P.encode(to_snapshot(second, 1, 1.0)))
    assert snap.inflight["drafter-0"].category == "drafter_backward"
    release.set()
    t.join(10)
    third = s.drain()
    assert "drafter-0" not in third.inflight
    assert third.workers["drafter-0"]["drafter_backward"].n == 1


def test_nested_spans_report_the_innermost() -> None:
    s = ProfileStats()
    w = s.worker("trainer")
    with w.span("checkpoint"), w.span("pack_hidden"):
        summ = s.drain()
    assert summ.inflight["trainer"].category == "pack_hidden"
    assert summ.inflight["trainer"].depth == 2


def test_a_span_crossing_windows_is_booked_where_it_ran() -> None:
    """Three windows inside one long span: each reads (nearly) 100% busy, and the window in which it
    ends is not booked the whole span again (old code: 0%, 0%, then a clamped 100%)."""
    s = ProfileStats()
    s.drain()
    t, release = _hold(s, "target-0", "target_forward")
    windows = []
    for _ in range(3):
        time.sleep(0.05)
        windows.append(s.drain())
    t_drain = time.perf_counter()
    time.sleep(0.02)
    release.set()
    t.join(10)
    busy = time.perf_counter() - t_drain  # at most this much of the span falls in the last window
    while time.perf_counter() - t_drain < 2.5 * busy:  # idle after it, however late the thread woke
        time.sleep(0.01)
    last = s.drain()
    for summ in windows[1:]:  # the first window also holds the time before the span began
        share = summ.workers["target-0"]["target_forward"].share
        assert 0.9 <= share <= 1.0, share
    cs = last.workers["target-0"]["target_forward"]
    assert cs.n == 1
    # total is the whole span (it ended here); share is only the part that fell in this window
    assert cs.total > 0.15
    assert cs.share < 0.6, cs.share
    booked = sum(w.workers["target-0"]["target_forward"].share * w.window_s for w in [*windows, last])
    assert booked == pytest.approx(cs.total, rel=0.1)


def test_since_done_grows_while_a_worker_completes_nothing() -> None:
    s = ProfileStats()
    w = s.worker("batch-producer")
    w.add("batch_build", 0.001)
    s.drain()
    time.sleep(0.05)
    assert s.drain().since_done["batch-producer"] >= 0.04
    w.add("batch_build", 0.001)
    assert s.drain().since_done["batch-producer"] == 0.0


def test_old_readers_accept_new_fields() -> None:
    """A snapshot with in-flight spans decodes with a reader that knows nothing of them (the old
    Snapshot definition, kept here as a Struct without the new fields)."""
    import msgspec

    class OldSnapshot(msgspec.Struct, tag_field="type", tag="snapshot"):
        seq: int
        t: float
        interval_s: float

    s = ProfileStats()
    with s.worker("w").span("x"):
        data = P.encode(to_snapshot(s.drain(), 3, 1.0))
    assert msgspec.json.decode(data, type=OldSnapshot).seq == 3
