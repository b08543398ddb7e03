"""Samples counted per category: a thread's share of each stage, and its spans read from runs of samples.

A thread sampled N times with k samples in a category spent about k/N of the window there (within the
binomial `margin`). Consecutive samples in one category are one run, read as one span of that stage:
a run of r samples lasted about r sampling intervals, so the table's n, mean, p50, p95 and max are the
runs' (a span shorter than one interval reads as one interval, or is missed between two samples).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from dflash.telemetry.wire.protocol import CategoryStats
from dflash_tui.sampling.rules import RULES, Rule, classify
from dflash_tui.sampling.samples import Frame, ThreadSamples, Window

#: z of a two-sided 95% interval
Z95 = 1.96


def margin(n: int) -> float:
    """Half-width of the 95% interval of a share measured on `n` samples, at its widest (a share of 50%).
    Samples of one span follow each other, so for long spans the true error is larger (docs/sampling.md)."""
    return Z95 * math.sqrt(0.25 / n) if n > 0 else 1.0


def _percentile(lengths: Counter[int], q: float) -> int:
    total = sum(lengths.values())
    seen = 0
    for length in sorted(lengths):
        seen += lengths[length]
        if seen >= q * total:
            return length
    return max(lengths, default=0)


@dataclass
class Tally:
    """One thread's samples per category (None: untracked), the runs they came in, and its GIL samples."""

    samples: int = 0
    counts: Counter[str | None] = field(default_factory=Counter)
    #: category -> run length (in samples) -> how many runs of that length
    runs: dict[str | None, Counter[int]] = field(default_factory=dict)
    gil: int = 0

    def add(self, categories: Sequence[str | None]) -> None:
        """Count one window's samples of the thread, in order."""
        self.samples += len(categories)
        self.counts.update(categories)
        start = 0
        for i in range(1, len(categories) + 1):
            if i == len(categories) or categories[i] != categories[start]:
                self.runs.setdefault(categories[start], Counter())[i - start] += 1
                start = i

    def merge(self, other: Tally) -> None:
        self.samples += other.samples
        self.counts.update(other.counts)
        self.gil += other.gil
        for cat, lengths in other.runs.items():
            self.runs.setdefault(cat, Counter()).update(lengths)

    def share(self, category: str | None) -> float:
        return self.counts[category] / self.samples if self.samples else 0.0

    def stats(self, interval_s: float) -> dict[str, CategoryStats]:
        """Per category (untracked left out): runs as spans, seconds from the sampling interval."""
        out: dict[str, CategoryStats] = {}
        for cat, k in self.counts.items():
            if cat is None or k == 0:
                continue
            lengths = self.runs.get(cat, Counter())
            n = sum(lengths.values())
            out[cat] = CategoryStats(n=n, total=k * interval_s, mean=k / n * interval_s if n else 0.0,
                                     p50=_percentile(lengths, 0.5) * interval_s,
                                     p95=_percentile(lengths, 0.95) * interval_s,
                                     max=max(lengths, default=0) * interval_s, share=k / self.samples)
        return out


def merged(tallies: Iterable[Tally]) -> Tally:
    out = Tally()
    for t in tallies:
        out.merge(t)
    return out


@lru_cache(maxsize=65536)
def _category(stack: tuple[Frame, ...], rules: tuple[Rule, ...]) -> str | None:
    return classify(stack, rules)


def categories(window: Window, thread: ThreadSamples, rules: tuple[Rule, ...] = RULES) -> list[str | None]:
    """The category of each of a thread's samples, in order (each distinct stack classified once)."""
    per_stack: dict[int, str | None] = {}
    out = []
    for sid in thread.samples:
        if sid not in per_stack:
            per_stack[sid] = _category(window.stacks[sid], rules)
        out.append(per_stack[sid])
    return out
