"""Per-op timing for the benchmarks: each call's wall time (``perf_counter_ns``) and, around
it, the calling thread's CPU time (``thread_time_ns``, ~0.4 µs of its own per call), which a
busy machine does not inflate when it deschedules the process."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["op_timer"]


def op_timer(ops: Iterable[str]) -> tuple[dict[str, list[int]], dict[str, list[int]], Callable[..., Any]]:
    """``(wall, cpu, timed)``: per-op lists of nanoseconds, and ``timed(op, fn, *args)``,
    which calls ``fn(*args)``, appends its wall and CPU nanoseconds under ``op`` and
    returns its result."""
    wall: dict[str, list[int]] = {op: [] for op in ops}
    cpu: dict[str, list[int]] = {op: [] for op in ops}
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns

    def timed(op: str, fn: Callable[..., Any], *args: Any) -> Any:
        c0 = cpu_clock()
        t0 = clock()
        out = fn(*args)
        t1 = clock()
        cpu[op].append(cpu_clock() - c0)
        wall[op].append(t1 - t0)
        return out

    return wall, cpu, timed
