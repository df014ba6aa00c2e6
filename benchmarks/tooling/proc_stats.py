"""Resource samples of a process (resident memory, threads, open file descriptors) read from
``/proc``, and their drift over a run: what the soak benchmark watches for leaks."""
from __future__ import annotations

import os
import time
from typing import NamedTuple

__all__ = ["ProcSample", "proc_sample", "drift"]


class ProcSample(NamedTuple):
    """One look at a process: resident memory (KiB), threads, open file descriptors."""

    t: float
    rss_kib: int
    threads: int
    fds: int


def proc_sample(pid: int) -> ProcSample:
    """Read ``/proc/<pid>/status`` and ``/proc/<pid>/fd``. Raises ``OSError`` when gone."""
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    return ProcSample(time.monotonic(), rss, threads, fds)


def drift(samples: list[ProcSample], field: str) -> dict[str, float]:
    """First, last, min, max of ``field`` over ``samples`` and last - first."""
    vals = [getattr(s, field) for s in samples]
    if not vals:
        return {}
    return {"first": vals[0], "last": vals[-1], "min": min(vals), "max": max(vals), "drift": vals[-1] - vals[0]}
