"""Fault injection, the driver side: start cheap worker processes, kill, pause and watch them.

* :class:`Zygote` starts ``python -m radixkv.service.chaos_worker`` once and asks it to fork
  worker processes (:mod:`~radixkv.service.chaos_worker` describes what they do and the
  points where they kill themselves); their events arrive on :attr:`Zygote.events`. Each
  worker is signalled through a pidfd opened when its fork is reported, so a signal can
  never hit a recycled pid. :meth:`Zygote.close` kills every worker and the zygote.
* :func:`proc_sample`: RSS, thread count and open file descriptors of a process (from
  ``/proc``), what the soak watches for drift.

Used by ``tests/reliability/`` and ``benchmarks/soak.py``. Linux only (pidfds, ``/proc``).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, NamedTuple, Optional

__all__ = ["Zygote", "WorkerProc", "ProcSample", "proc_sample", "KILL_POINTS"]

KILL_POINTS = ("after_alloc", "after_cache_unfinished", "mid_call", "mid_batch", "after_decode")


class WorkerProc:
    """One forked worker: its id, pid and a pidfd (signals go through the pidfd)."""

    def __init__(self, wid: int, pid: int):
        self.wid = wid
        self.pid = pid
        try:
            self._fd: Optional[int] = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd = None  # already gone (it killed itself)

    def signal(self, sig: int) -> bool:
        """Send ``sig``; False when the process is already gone."""
        if self._fd is None:
            return False
        try:
            signal.pidfd_send_signal(self._fd, sig)
            return True
        except ProcessLookupError:
            return False

    def alive(self) -> bool:
        if self._fd is None:
            return False
        import select

        p = select.poll()
        p.register(self._fd, select.POLLIN)
        return not p.poll(0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Zygote:
    """A process that forks chaos workers on request (see the module docstring).

    Args:
        timeout_s: how long to wait for the zygote to start.
    """

    def __init__(self, timeout_s: float = 60.0):
        env = dict(os.environ)
        env.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
        self._p = subprocess.Popen([sys.executable, "-m", "radixkv.service.chaos_worker"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, env=env, bufsize=0)
        self.events: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.workers: Dict[int, WorkerProc] = {}
        self._forked: Dict[int, "queue.Queue[int]"] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="chaos-zygote-reader", daemon=True)
        self._reader.start()
        ev = self.wait_event(lambda e: e.get("ev") == "ready", timeout_s)
        if ev is None:
            self.close()
            raise TimeoutError("the chaos zygote did not start")

    def _read(self) -> None:
        for line in self._p.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("ev") == "forked":
                with self._lock:
                    q = self._forked.pop(ev["wid"], None)
                if q is not None:
                    q.put(ev["pid"])
                continue
            self.events.put(ev)

    def wait_event(self, pred: Any, timeout_s: float) -> Optional[Dict[str, Any]]:
        """The next event matching ``pred`` (others are dropped), or None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                ev = self.events.get(timeout=left)
            except queue.Empty:
                return None
            if pred(ev):
                return ev

    def drain(self, timeout_s: float = 0.0) -> List[Dict[str, Any]]:
        """Every queued event, waiting up to ``timeout_s`` for the first."""
        out: List[Dict[str, Any]] = []
        try:
            out.append(self.events.get(timeout=timeout_s) if timeout_s > 0 else self.events.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def spawn(self, spec: Dict[str, Any], timeout_s: float = 30.0) -> WorkerProc:
        """Fork a worker running ``spec`` (``wid``, ``address``, ``token`` required)."""
        q: "queue.Queue[int]" = queue.Queue()
        with self._lock:
            self._forked[spec["wid"]] = q
        self._p.stdin.write((json.dumps({"cmd": "spawn", "spec": spec}) + "\n").encode())
        self._p.stdin.flush()
        pid = q.get(timeout=timeout_s)
        w = WorkerProc(spec["wid"], pid)
        self.workers[spec["wid"]] = w
        return w

    def kill(self, wid: int) -> bool:
        """SIGKILL worker ``wid`` (False when it was already gone) and forget it."""
        w = self.workers.pop(wid, None)
        if w is None:
            return False
        ok = w.signal(signal.SIGKILL)
        w.close()
        return ok

    def close(self) -> None:
        """Kill every worker, then the zygote (idempotent)."""
        for wid in list(self.workers):
            self.kill(wid)
        if self._p.poll() is None:
            try:
                self._p.stdin.write(b'{"cmd": "exit"}\n')
                self._p.stdin.flush()
                self._p.stdin.close()
            except OSError:
                pass
            try:
                self._p.wait(10)
            except subprocess.TimeoutExpired:
                self._p.kill()
                self._p.wait(10)
        self._reader.join(10)

    def __enter__(self) -> "Zygote":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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


def drift(samples: List[ProcSample], field: str) -> Dict[str, float]:
    """First, last, min, max of ``field`` over ``samples`` and last - first."""
    vals = [getattr(s, field) for s in samples]
    if not vals:
        return {}
    return {"first": vals[0], "last": vals[-1], "min": min(vals), "max": max(vals), "drift": vals[-1] - vals[0]}
