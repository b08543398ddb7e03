"""Allocator churn: the caching allocator mapping and freeing device memory again and again, as a rate per
second and an anomaly while it stays high.

A caching allocator in steady state makes no driver calls: after the first steps every block a step
asks for comes from its cache. One that keeps calling the driver - `cuMemMap` through
`ExpandableSegment::map`, `cudaMalloc`, and their frees (each `cudaFree` waits for the GPU) - is being
emptied and refilled: `torch.cuda.empty_cache()` in the loop, a memory fraction or a GC threshold that
keeps releasing, shapes that grow a segment every step. The original investigation found target workers
hot in `ExpandableSegment::map`; a step's own spans only show it as a slower step.

Two halves, one per thread. The main thread reads torch's cumulative counts (`num_device_alloc` /
`num_device_free`, dflash.train.device.memory) once per telemetry interval, never a worker per step, and
`ChurnRates` turns them into the per-device gauges `cuda<i>_segment_maps_per_s` and
`cuda<i>_segment_frees_per_s` (dflash.telemetry.wire.vocab). The publisher thread's `ChurnMonitor` reads
those gauges from each window and holds an anomaly on the snapshot (`anomalies`: dflash-top's banner,
`--once`, Prometheus) while their sum stays at or above CHURN_HIGH, judged by the timing anomalies' rule
(dflash.telemetry.verdict.anomalies.Sustained): a share of the windows of a sustained span, ended with
hysteresis, at a phase change and with the run. Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from dflash.telemetry.summary import Summary
from dflash.telemetry.verdict.anomalies import Sustained, say
from dflash.telemetry.wire.protocol import Anomaly
from dflash.telemetry.wire.vocab import (
    ALLOCATOR,
    SEGMENT_FREES_PER_S,
    SEGMENT_MAPS_PER_S,
    device_gauges,
)
from dflash.telemetry.wire.vocab import evaluating as in_evaluation

#: segment maps + frees per second on one device from which the allocator is churning. A steady cache makes
#: none; warm-up and a longer batch make a burst that is over within a window or two, which the sustain
#: rule lets pass. Five driver calls a second for ten seconds is a cache emptied and refilled every step or
#: so: each map costs tens of microseconds of the launching thread, each free a wait for the GPU
CHURN_HIGH = 5.0
#: the anomaly begins when at least SHARE of the windows of the last SUSTAIN_S seconds (at least
#: SUSTAIN_WINDOWS of them) are high, and ends once no more than 1 - SHARE of them have been for END_S on end
SUSTAIN_S = 10.0
SUSTAIN_WINDOWS = 5
SHARE = 0.8
END_S = 10.0
#: the anomaly's `stat`: maps and frees together
STAT = "segment_calls_per_s"


class ChurnRates:
    """Per-device rates from cumulative driver-call counts, read at irregular times: a reading closer than
    `min_dt_s` to the last one used is skipped (its count carries over to the next), so a second reading
    a moment after the first cannot turn one call into a rate of hundreds per second."""

    def __init__(self, min_dt_s: float = 0.5) -> None:
        self.min_dt_s = min_dt_s
        self._last: dict[int, tuple[float, int, int]] = {}

    def rates(self, index: int, t: float, maps: int, frees: int) -> tuple[float, float] | None:
        """(maps per second, frees per second) on device `index` since the last reading used; None for the
        first reading and for one too soon after the last."""
        before = self._last.get(index)
        if before is not None and t - before[0] < self.min_dt_s:
            return None
        self._last[index] = (t, maps, frees)
        if before is None:
            return None
        dt = t - before[0]
        # a count that went down (the allocator's stats were reset) starts a new baseline: no rate
        return max(0, maps - before[1]) / dt, max(0, frees - before[2]) / dt


@dataclass
class _Device:
    sustained: Sustained
    active: Anomaly | None = None


class ChurnMonitor:
    """The publisher thread's judge of the churn gauges: an anomaly per device while its allocator churns.
    It adds its anomalies to the summary's, so it runs after the timing anomaly detector (which sets them)."""

    def __init__(self, *, high: float = CHURN_HIGH, sustain_s: float = SUSTAIN_S,
                 sustain_windows: int = SUSTAIN_WINDOWS, share: float = SHARE, end_s: float = END_S,
                 emit: Callable[..., None] | None = None) -> None:
        self.high, self.sustain_s, self.sustain_windows = high, sustain_s, sustain_windows
        self.share, self.end_s = share, end_s
        self.emit = emit
        self._devices: dict[int, _Device] = {}
        self._evaluating: bool | None = None

    @property
    def active(self) -> list[Anomaly]:
        return [d.active for d in self._devices.values() if d.active is not None]

    def check(self, summary: Summary, live: set[str] | None = None) -> list[Anomaly]:
        """Fold in one window; returns its anomalies in force now (also added to the summary's)."""
        evaluating = in_evaluation(summary.gauges)
        if self._evaluating is not None and evaluating != self._evaluating:
            self.finish("an evaluation began" if evaluating else "the evaluation ended")
        self._evaluating = evaluating
        maps = device_gauges(summary.gauges, SEGMENT_MAPS_PER_S)
        frees = device_gauges(summary.gauges, SEGMENT_FREES_PER_S)
        t = summary.t
        for index in sorted(maps.keys() | frees.keys()):
            dev = self._devices.get(index)
            if dev is None:
                dev = self._devices[index] = _Device(
                    Sustained(self.sustain_s, self.sustain_windows, self.share, self.end_s))
            self._judge(index, dev, maps.get(index, 0.0), frees.get(index, 0.0), t, summary.window_s)
        if summary.final:
            self.finish()
        summary.anomalies = [*summary.anomalies, *self.active]
        return self.active

    def _judge(self, index: int, dev: _Device, maps: float, frees: float, t: float, window_s: float) -> None:
        rate = maps + frees
        if not dev.sustained.add(t, window_s, rate >= self.high):
            return
        if dev.active is None:
            if (since := dev.sustained.begins()) is not None:
                self._begin(index, dev, maps, frees, since)
            return
        if rate >= self.high:
            a = dev.active
            a.value, a.ratio = rate, rate / self.high
        if dev.sustained.ends(t):
            self._end(index, dev)

    def finish(self, why: str = "the run ended") -> None:
        """End every anomaly in force (a phase change, the end of the run) and start their spans anew."""
        for index, dev in self._devices.items():
            dev.sustained.clear()
            if dev.active is not None:
                self._end(index, dev, why)

    def _begin(self, index: int, dev: _Device, maps: float, frees: float, since: float) -> None:
        rate = maps + frees
        msg = (f"cuda:{index} allocator churns: {maps:.0f} segment maps and {frees:.0f} frees a second since "
               f"{time.strftime('%H:%M:%S', time.localtime(since))} (a steady cache makes none): something "
               "empties and refills the cache - empty_cache() in the loop, a memory fraction or GC threshold, "
               "growing shapes; each map stalls the launching thread and each free waits for the GPU")
        dev.active = Anomaly(worker=f"cuda:{index}", category=ALLOCATOR, stat=STAT, value=rate, baseline=self.high,
                             ratio=rate / self.high, since=since, message=msg)
        self._say("anomaly", msg, device=f"cuda:{index}", category=ALLOCATOR, stat=STAT,
                  maps_per_s=round(maps, 2), frees_per_s=round(frees, 2))

    def _end(self, index: int, dev: _Device, why: str | None = None) -> None:
        dev.active = None
        text = f"ended: {why}" if why else f"calm again (under {self.high:.0f} segment maps and frees a second)"
        self._say("anomaly_end", f"cuda:{index} allocator churn {text}", device=f"cuda:{index}",
                  category=ALLOCATOR, stat=STAT)

    def _say(self, kind: str, message: str, **data: object) -> None:
        say(self.emit, kind, message, **data)
