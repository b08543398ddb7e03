"""The non-finite guard, on both of its paths: the host branch (plain AdamW) and the on-device one
(fused AdamW's found_inf, the path CUDA takes; torch also runs it on the CPU, so it is tested here)."""

from __future__ import annotations

import pytest
import torch

from dflash.train.health.nonfinite import NonFiniteGuard


def _model_and_opt(fused: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, fused=fused)
    return model, opt


def _step(model, opt, guard, batch: int, poison: bool) -> None:
    loss = model(torch.ones(2, 4)).square().mean()
    if poison:
        loss = loss * float("nan")
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    guard.step(loss, norm, batch)
    opt.zero_grad(set_to_none=True)


def _state(model, opt) -> dict:
    out = {f"p.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in opt.state.items():
        for k, v in st.items():
            out[f"s.{id(i)}.{k}"] = v.detach().clone() if torch.is_tensor(v) else v
    return out


@pytest.mark.parametrize("fused", [False, True])
def test_a_non_finite_step_changes_nothing_and_is_counted(fused: bool) -> None:
    model, opt = _model_and_opt(fused)
    guard = NonFiniteGuard(opt, torch.device("cpu"), limit=3)
    assert guard.on_device is fused
    _step(model, opt, guard, 0, poison=False)
    before = _state(model, opt)
    _step(model, opt, guard, 1, poison=True)
    after = _state(model, opt)
    assert before.keys() == after.keys()
    for k in before:  # weights, both moments, the step count: untouched (weight decay too)
        assert torch.equal(torch.as_tensor(before[k]), torch.as_tensor(after[k])), k
    r = guard.read()
    assert (r.skipped, r.new, r.in_a_row, r.last_batch, r.last_step) == (1, 1, 1, 1, 2)
    _step(model, opt, guard, 2, poison=True)
    _step(model, opt, guard, 3, poison=True)
    r = guard.read()
    assert (r.skipped, r.new, r.in_a_row, r.last_batch) == (3, 2, 3, 3)
    _step(model, opt, guard, 4, poison=False)  # a good step moves the weights and ends the run
    assert not torch.equal(before["p.weight"], model.weight)
    r = guard.read()
    assert (r.skipped, r.new, r.in_a_row) == (3, 0, 0)


class _Stats:
    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}

    def gauge(self, name: str, value: float) -> None:
        self.gauges[name] = value


def test_the_watch_reports_each_bad_step_and_stops_once_at_the_limit() -> None:
    from dflash.train.control import Interval
    from dflash.train.health.nonfinite import NonFiniteWatch

    model, opt = _model_and_opt(fused=False)
    guard, stats, events = NonFiniteGuard(opt, torch.device("cpu"), limit=3), _Stats(), []
    watch = NonFiniteWatch(guard, stats, lambda kind, msg, **data: events.append((kind, msg, data)),
                           Interval(1e9, lambda: 0.0))  # host counters: read after every step regardless
    verdicts = []
    for batch in range(5):
        _step(model, opt, guard, batch, poison=batch >= 1)
        verdicts.append(watch.too_many())
    assert verdicts == [False, False, False, True, False]  # the limit is reached at batch 3, said once
    assert [d["step"] for _, _, d in events] == [2, 3, 4, 5] and stats.gauges["nonfinite_skipped"] == 4
    assert watch.stop_line.startswith("3 non-finite steps in a row (steps 2-4, batches 1-3), limit 3")


def test_device_counters_are_read_once_per_interval() -> None:
    """On CUDA a read is a device copy: the watch reads on the log interval, not after every step."""
    from dflash.train.control import Interval
    from dflash.train.health.nonfinite import NonFiniteWatch

    class DeviceCounters:  # the guard as CUDA has it: reading costs a synchronisation
        reads_free = False

        def __init__(self, guard: NonFiniteGuard) -> None:
            self.guard, self.limit, self.reads = guard, guard.limit, 0

        def read(self):
            self.reads += 1
            return self.guard.read()

    model, opt = _model_and_opt(fused=True)
    now = [0.0]
    counters, events = DeviceCounters(NonFiniteGuard(opt, torch.device("cpu"), limit=3)), []
    watch = NonFiniteWatch(counters, _Stats(), lambda kind, msg, **data: events.append(msg),
                           Interval(10.0, lambda: now[0]))
    for batch in range(3):
        _step(model, opt, counters.guard, batch, poison=True)
        assert not watch.too_many()
    assert counters.reads == 0 and events == []
    now[0] = 10.0
    assert watch.too_many() and counters.reads == 1
    assert events == ["non-finite loss or gradient norm at step 3 (batch 2): optimizer step skipped "
                      "(3 since the last report), 3 skipped in all"]
