"""Rejected calls, said once a period: :class:`PeriodicCount` turns a flood of rejected
unauthenticated calls into one line per period with a count (never one line per call).
"""
from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["PeriodicCount"]


class PeriodicCount:
    """Counts events and calls ``emit(count, last)`` at most once per ``period_s`` (the
    first event of a quiet period at once, the rest summed into the next line)."""

    def __init__(self, emit: Callable[[int, str], None], period_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self._emit, self._period, self._clock = emit, float(period_s), clock
        self._count = 0
        self._last = ""
        self._next = float("-inf")
        self.total = 0

    def add(self, what: str) -> None:
        self._count += 1
        self.total += 1
        self._last = what
        now = self._clock()
        if now >= self._next:
            self._emit(self._count, what)
            self._count = 0
            self._next = now + self._period

    def flush(self) -> None:
        """Say what is still counted (at shutdown)."""
        if self._count:
            self._emit(self._count, self._last)
            self._count = 0
