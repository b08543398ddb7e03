"""Counts in messages: "1 layer", "3 layers" (a user reads these lines, so they should read right)."""

from __future__ import annotations


def plural(n: int, noun: str, many: str | None = None) -> str:
    """`n` and `noun`, with `many` (default noun + "s") unless n is exactly one."""
    return f"{n} {noun if n == 1 else (many or noun + 's')}"
