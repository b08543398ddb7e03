"""The accumulator behind every percentile dflash publishes: exact count, total and maximum, and a
bounded uniform sample of the values.

A worker folds its own buffer into one when nobody drains for a long time, and the publisher merges
windows into cumulative ones, so both operations must stay cheap and memory must stay bounded.
"""

from __future__ import annotations

import math
import random

from dflash.telemetry.summary import category_stats, percentile
from dflash.telemetry.wire.protocol import CategoryStats, DeviceStats

#: reservoir of a window whose worker had to fold (windows that did not fold keep every sample)
RESERVOIR = 2048


class Reservoir:
    """Exact n/total/max plus a uniform reservoir sample for percentiles.

    Past the fill phase it uses Li's "Algorithm L": it draws how many items to skip before the next
    replacement, so a long stream costs O(cap * log(n / cap)) random draws instead of one per item
    (a fold happens on a worker's thread; it must stay cheap).
    """

    __slots__ = ("n", "total", "max", "sample", "cap", "_w", "_next", "_pct")

    def __init__(self, cap: int = RESERVOIR) -> None:
        self.n = 0
        self.total = 0.0
        self.max = 0.0
        self.sample: list[float] = []
        self.cap = cap
        self._w = 0.0
        self._next = 0  # 1-based stream index of the next item that enters the reservoir
        self._pct: tuple[int, float, float] | None = None

    def percentiles(self) -> tuple[float, float]:
        """(p50, p95) of the sample.

        The sample is sorted in place (a reservoir's slot order carries no meaning, and a sorted
        list with a few new values re-sorts in near-linear time). Once the reservoir is a subsample,
        the result is reused until n has grown by 5%: percentiles of a long stream move slowly, and
        re-sorting 96 reservoirs every interval was the publisher's largest cost.
        """
        pct = self._pct
        n = self.n
        if pct is None or (n != pct[0] and (n <= self.cap or n - pct[0] > pct[0] // 20)):
            self.sample.sort()
            pct = self._pct = (n, percentile(self.sample, 0.50), percentile(self.sample, 0.95))
        return pct[1], pct[2]

    def stats(self, wall_s: float, device: DeviceStats | None = None) -> CategoryStats:
        p50, p95 = self.percentiles()
        return category_stats(self.n, self.total, self.max, p50, p95, wall_s, device)

    def device_stats(self, wall_s: float) -> DeviceStats:
        p50, p95 = self.percentiles()
        return DeviceStats(
            n=self.n, total=self.total, mean=self.total / self.n if self.n else 0.0, p50=p50, p95=p95, max=self.max,
            share=min(1.0, self.total / wall_s) if wall_s > 0 else 0.0,
        )

    @classmethod
    def of(cls, values: list[float]) -> Reservoir:
        """An exact accumulator that adopts `values` as its sample (no copy)."""
        acc = cls(max(1, len(values)))
        acc.n, acc.total, acc.max, acc.sample = len(values), sum(values), max(values), values
        return acc

    def extend(self, values: list[float], rng: random.Random) -> None:
        if not values:
            return
        n0 = self.n
        self.n = n0 + len(values)
        self.total += sum(values)
        m = max(values)
        if m > self.max or n0 == 0:
            self.max = m
        sample, cap = self.sample, self.cap
        j = 0
        room = cap - len(sample)
        if room > 0:
            sample.extend(values[:room])
            j = min(room, len(values))
            if len(sample) < cap:
                return
        if self._w == 0.0 or self._next <= n0 + j:
            # Start (or, after an approximate merge, restart) Algorithm L's skip sequence here.
            if self._w == 0.0:
                self._w = math.exp(math.log(1.0 - rng.random()) / cap)
            self._next = n0 + j + self._skip(rng)
        end = self.n
        nxt, w = self._next, self._w
        rnd, log, exp, log1p = rng.random, math.log, math.exp, math.log1p
        while nxt <= end:
            sample[int(rnd() * cap)] = values[nxt - n0 - 1]
            w *= exp(log(1.0 - rnd()) / cap)
            nxt += int(log(1.0 - rnd()) / log1p(-w)) + 1 if w < 1.0 else 1
        self._next, self._w = nxt, w

    def _skip(self, rng: random.Random) -> int:
        """Items to pass over before the next one enters the reservoir."""
        w = self._w
        if w >= 1.0:  # cannot happen for cap >= 1 but keep the loop finite regardless
            return 1
        return int(math.log(1.0 - rng.random()) / math.log1p(-w)) + 1

    def merge(self, other: Reservoir, rng: random.Random) -> None:
        """Fold another accumulator in; n/total/max stay exact, the sample stays (about) uniform."""
        if other.n == 0:
            return
        if other.n == len(other.sample):
            # `other` holds every one of its samples (the usual window): stream them through
            # Algorithm L, which is exact reservoir sampling and costs O(replacements)
            self.extend(other.sample, rng)
            return
        # `other` is itself a subsample (its worker folded): take from it a share proportional to
        # other.n, replacing random slots
        sample = self.sample
        total_n = self.n + other.n
        target = min(self.cap, len(sample) + len(other.sample))
        k = min(len(other.sample), round(target * other.n / total_n))
        picks = rng.sample(other.sample, k) if k < len(other.sample) else list(other.sample)
        room = max(0, self.cap - len(sample))
        before = len(sample)
        sample.extend(picks[:room])
        rest = picks[room:]
        if rest:
            for i, v in zip(rng.sample(range(before), len(rest)), rest, strict=True):
                sample[i] = v
        self.n = total_n
        self.total += other.total
        if other.max > self.max or self.n == other.n:
            self.max = other.max
