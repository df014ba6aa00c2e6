"""The leases' clock: seconds that do not count the manager's own stalls.

A lease measures a worker's silence. While the manager's one event loop is stuck (a long
call, a swap storm, the process stopped), the workers' keep-alives wait unread in their
sockets; counting that time would expire every live worker's lease and quarantine its rows
for the manager's fault. :class:`LoopClock` advances with its base clock (``time.monotonic``)
only while the loop makes progress: a ticker task on the loop beats every ``tick_s``; when a
beat comes later than ``tick_s + slack_s`` the excess is a stall and is not counted. Between
beats the clock is frozen at ``last beat + tick_s + slack_s``, so a sweep or a fence that runs
right after a stall (before the ticker could run) does not see the stall either.

Without a running ticker (before ``start``, after ``stop``) it is the base clock less the
stalls seen so far. ``stalls`` and ``stalled_s`` say what was left out.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["LoopClock"]


class LoopClock:
    """A non-decreasing clock in seconds that leaves out the loop's stalls (module doc)."""

    def __init__(self, base: Callable[[], float] = time.monotonic, tick_s: float = 0.05, slack_s: float = 0.25):
        self._base = base
        self._tick_s = float(tick_s)
        self._allowed = float(tick_s) + float(slack_s)
        self._last = float(base())
        self._task: asyncio.Task[None] | None = None
        self.stalled_s = 0.0  # seconds left out so far
        self.stalls = 0  # how many stalls

    def _excess(self, now: float) -> float:
        return max(0.0, now - self._last - self._allowed) if self._task is not None else 0.0

    def __call__(self) -> float:
        now = float(self._base())
        return now - self.stalled_s - self._excess(now)

    def beat(self) -> None:
        """Count the time since the last beat; what passed beyond ``tick_s + slack_s`` was a
        stall and is left out. The ticker calls it; tests may too."""
        now = float(self._base())
        excess = self._excess(now)
        if excess > 0:
            self.stalled_s += excess
            self.stalls += 1
        self._last = now

    def start(self) -> None:
        """Start the ticker on the running loop (idempotent)."""
        if self._task is None:
            self._last = float(self._base())
            self._task = asyncio.ensure_future(self._ticker())

    async def stop(self) -> None:
        """Stop the ticker (idempotent)."""
        self.beat()  # a stall in progress is left out too
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            self.beat()
