"""Fault injection, the driver side: start worker processes, kill, pause and watch them.

* :class:`StandbyPool` runs chaos workers (:mod:`~tooling.chaos_worker` describes
  what they do and the points where they kill themselves). Every worker is a fresh
  interpreter started with ``subprocess.Popen([sys.executable, "-m",
  "tooling.chaos_worker"])``: processes that share gRPC are never forked, not even
  from a zygote that has only imported grpc. To keep a kill cycle from waiting for an
  interpreter start (~0.3 s of imports, more on a loaded machine), a background thread
  keeps ``standby`` workers started ahead of need, each blocked on its stdin for a spec
  (started at nice +10 so background starts do not take CPU from the manager under test;
  normal priority again once handed a spec); :meth:`StandbyPool.spawn` hands the spec to a
  ready one and the pool is replenished. Callers that must never block check
  :meth:`StandbyPool.ready` first.
  Events of every worker arrive on :attr:`StandbyPool.events` (one pipe shared by all, one
  atomic write per line). Each worker is signalled through a pidfd opened when it is
  started, so a signal can never hit a recycled pid. :meth:`StandbyPool.close` kills every
  worker and standby and reaps them.
* :func:`proc_sample`: RSS, thread count and open file descriptors of a process (from
  ``/proc``), what the soak watches for drift.

Used by ``tests/reliability/`` and ``benchmarks/soak.py``. Linux only (pidfds, ``/proc``).
"""
from __future__ import annotations

import collections
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, NamedTuple

from radixkv.errors import InvalidArgumentError, InvariantError

__all__ = ["StandbyPool", "WorkerProc", "PoolStats", "KILL_POINTS"]

KILL_POINTS = ("after_alloc", "after_cache_unfinished", "mid_call", "mid_batch", "after_decode")
WORKER_MODULE = "tooling.chaos_worker"
#: The directory that holds the ``tooling`` package (a worker's PYTHONPATH starts with it).
TOOLING_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STANDBY_NICE_ENV = "RADIXKV_CHAOS_STANDBY_NICE"  # read by the worker module before its imports


class WorkerProc:
    """One worker process: its id (``wid``, -1 while a standby), pid, a pidfd (signals go
    through it) and the pipe to its stdin (the spec goes there; closing it ends the worker)."""

    def __init__(self, wid: int, popen: subprocess.Popen[bytes]):
        self.wid = wid
        self.popen = popen
        self.pid = popen.pid
        try:
            self._fd: int | None = os.pidfd_open(popen.pid)
        except ProcessLookupError:  # pragma: no cover - our unreaped child cannot vanish
            self._fd = None

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
        """Whether the process still runs (a zombie counts as gone)."""
        if self._fd is None:
            return False
        p = select.poll()
        p.register(self._fd, select.POLLIN)
        return not p.poll(0)

    def send(self, line: bytes) -> None:
        """Write ``line`` to the worker's stdin (``OSError`` when the worker has died)."""
        if self.popen.stdin is None:
            raise BrokenPipeError(f"worker {self.pid} was started without a stdin pipe")
        self.popen.stdin.write(line)
        self.popen.stdin.flush()

    def close(self) -> None:
        """Close the stdin pipe (a live worker then kills itself) and the pidfd."""
        if self.popen.stdin is not None:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class PoolStats(NamedTuple):
    """Counters of a :class:`StandbyPool`: interpreters ``started``; workers ``spawned``;
    ``waits``: spawns that found no ready standby and waited for one (``wait_s_max``,
    ``wait_s_total``); standbys that ``died_unused``; ``ready`` / ``starting`` standbys now."""

    started: int
    spawned: int
    waits: int
    wait_s_max: float
    wait_s_total: float
    died_unused: int
    ready: int
    starting: int


class StandbyPool:
    """Chaos worker processes, each a fresh interpreter, with ``standby`` started ahead.

    Args:
        standby: how many started-but-unused workers to keep (>= 1). Size it to the rate
            at which workers are consumed times the interpreter start time.
        timeout_s: how long the constructor waits for the standbys to be ready (it raises
            ``TimeoutError`` when none is, or when as many as ``standby`` died at start).
        env: extra environment of the workers (defaults: one BLAS / OpenMP thread each).
        standby_nice: niceness increment of a standby while it starts and waits (0: none), so
            background starts do not take CPU from the manager and the running workers; a
            worker gets its parent's priority back when handed its spec (where the OS allows
            raising it again: root, ``CAP_SYS_NICE`` or ``RLIMIT_NICE``; else it keeps it).

    Thread-safety: ``spawn`` / ``kill`` / ``close`` from one driver thread; the pool's
    own threads (replenisher, event reader) share state with it under a lock.
    """

    def __init__(self, standby: int = 4, timeout_s: float = 60.0, env: dict[str, str] | None = None,
                 standby_nice: int = 10):
        if isinstance(standby, bool) or not isinstance(standby, int) or not 1 <= standby <= 64:
            raise InvalidArgumentError(f"standby must be an int in [1, 64], got {standby!r}")
        if isinstance(standby_nice, bool) or not isinstance(standby_nice, int) or not 0 <= standby_nice <= 19:
            raise InvalidArgumentError(f"standby_nice must be an int in [0, 19], got {standby_nice!r}")
        self.standby = standby
        self._env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self._env[STANDBY_NICE_ENV] = str(standby_nice)
        self._env.update(env or {})
        # The worker module lives in benchmarks/tooling/ (not installed): its interpreter finds
        # it through PYTHONPATH, as the test process found it through pytest's pythonpath.
        inherited = (self._env.get("PYTHONPATH") or "").split(os.pathsep)
        self._env["PYTHONPATH"] = os.pathsep.join([TOOLING_PARENT] + [p for p in inherited if p])
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.workers: dict[int, WorkerProc] = {}
        self._cv = threading.Condition()
        self._ready: collections.deque[WorkerProc] = collections.deque()
        self._starting: dict[int, WorkerProc] = {}  # pid -> standby not ready yet
        self._announced: set = set()  # pids that said "standby" before being filed (a race)
        self._dead: list[WorkerProc] = []  # signalled or finished, not reaped yet
        self._closed = False
        self._started = self._spawned = self._waits = self._died_unused = 0
        self._wait_max = self._wait_total = 0.0
        self._last_death = 0.0  # when a standby last died unused (starts back off after one)
        self._rfd, self._wfd = os.pipe()  # the shared event pipe (not inherited but as stdout)
        self._reader = threading.Thread(target=self._read, name="chaos-events", daemon=True)
        self._reader.start()
        self._filler = threading.Thread(target=self._replenish, name="chaos-standby", daemon=True)
        self._filler.start()
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while len(self._ready) < standby and time.monotonic() < deadline and self._died_unused < standby:
                self._cv.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            ok, died = bool(self._ready), self._died_unused
        if not ok:
            self.close()
            raise TimeoutError(f"no chaos worker was ready within {timeout_s} s ({died} died at start; "
                               f"run python -m {WORKER_MODULE} to see why)")

    # ------------------------------------------------------------------ threads
    def _start_one(self) -> None:
        if time.monotonic() - self._last_death < 1.0:
            time.sleep(1.0)  # standbys die at start: do not spin
        p = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE, stdout=self._wfd,
                             env=self._env, close_fds=True)
        w = WorkerProc(-1, p)
        with self._cv:
            self._started += 1
            if self._closed:
                self._dead.append(w)
                w.signal(signal.SIGKILL)
                return
            if w.pid in self._announced:
                self._announced.discard(w.pid)
                self._ready.append(w)
                self._cv.notify_all()
            else:
                self._starting[w.pid] = w

    def _replenish(self) -> None:
        """Keep ``standby`` workers started and unused; drop standbys that died unused."""
        while True:
            with self._cv:
                while not self._closed and len(self._ready) + len(self._starting) >= self.standby:
                    self._cv.wait(0.5)
                    self._drop_dead_standbys()
                if self._closed:
                    return
            try:
                self._start_one()
            except OSError as e:  # cannot start interpreters: report, retry slowly
                self.events.put({"ev": "error", "wid": None, "msg": f"cannot start a chaos worker: {e}"})
                time.sleep(1.0)

    def _drop_dead_standbys(self) -> None:
        """(Under the lock.) Forget standbys whose process ended before being used, and
        reap the dead workers (called every 0.5 s by the replenisher)."""
        self._dead = [w for w in self._dead if w.popen.poll() is None]
        for w in [w for w in list(self._starting.values()) + list(self._ready) if w.popen.poll() is not None]:
            self._starting.pop(w.pid, None)
            if w in self._ready:
                self._ready.remove(w)
            self._died_unused += 1
            self._last_death = time.monotonic()
            w.close()

    def _read(self) -> None:
        with os.fdopen(self._rfd, "rb") as f:
            for line in f:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("ev") == "standby":
                    with self._cv:
                        w = self._starting.pop(ev.get("pid"), None)
                        if w is None:
                            self._announced.add(ev.get("pid"))
                        else:
                            self._ready.append(w)
                        self._cv.notify_all()
                    continue
                self.events.put(ev)

    # ------------------------------------------------------------------ events
    def wait_event(self, pred: Any, timeout_s: float) -> dict[str, Any] | None:
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

    def drain(self, timeout_s: float = 0.0) -> list[dict[str, Any]]:
        """Every queued event, waiting up to ``timeout_s`` for the first."""
        out: list[dict[str, Any]] = []
        try:
            out.append(self.events.get(timeout=timeout_s) if timeout_s > 0 else self.events.get_nowait())
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    # ------------------------------------------------------------------ workers
    def ready(self) -> int:
        """How many standbys are ready now (a :meth:`spawn` would not wait). O(1)."""
        with self._cv:
            return len(self._ready)

    def spawn(self, spec: dict[str, Any], timeout_s: float = 30.0) -> WorkerProc:
        """Hand ``spec`` (``wid``, ``address``, ``token`` required) to a ready standby and
        return it; waits (counted in :meth:`stats`) only when no standby is ready.

        Raises ``InvalidArgumentError`` (bad spec or a ``wid`` in use), ``TimeoutError``
        (no standby became ready within ``timeout_s``)."""
        wid = spec.get("wid") if isinstance(spec, dict) else None
        if isinstance(wid, bool) or not isinstance(wid, int) or wid < 0:
            raise InvalidArgumentError(f"a chaos spec needs an int wid >= 0, got {spec!r:.200}")
        if wid in self.workers:
            raise InvalidArgumentError(f"worker id {wid} is in use")
        try:
            line = (json.dumps({"spec": spec}) + "\n").encode()
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"a chaos spec must be JSON-able: {e}") from None
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        waited = False
        while True:
            with self._cv:
                if self._closed:
                    raise InvalidArgumentError("the standby pool is closed")
                while not self._ready:
                    waited = True
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"no chaos worker became ready within {timeout_s} s "
                                           f"({self._died_unused} died before use)")
                    self._cv.wait(min(left, 0.5))
                    self._drop_dead_standbys()
                w = self._ready.popleft()
                self._cv.notify_all()  # the replenisher starts the next one
            try:
                w.send(line)
                break
            except OSError:  # it died while on standby: take the next one
                with self._cv:
                    self._died_unused += 1
                    self._dead.append(w)
                w.close()
        with self._cv:
            self._spawned += 1
            if waited:
                dt = time.monotonic() - t0
                self._waits += 1
                self._wait_total += dt
                self._wait_max = max(self._wait_max, dt)
        w.wid = wid
        self.workers[wid] = w
        self._reap()
        return w

    def kill(self, wid: int) -> bool:
        """SIGKILL worker ``wid`` (False when it was already gone) and forget it; its exit
        status is collected soon after (call it also for a worker that ended by itself, or
        it stays a zombie until :meth:`close`)."""
        w = self.workers.pop(wid, None)
        if w is None:
            return False
        ok = w.signal(signal.SIGKILL)
        w.close()
        with self._cv:
            self._dead.append(w)
        self._reap()
        return ok

    def _reap(self) -> None:
        """Collect the exit status of dead workers (no zombies pile up). Non-blocking."""
        with self._cv:
            self._dead = [w for w in self._dead if w.popen.poll() is None]

    def stats(self) -> PoolStats:
        """The counters so far (see :class:`PoolStats`)."""
        with self._cv:
            return PoolStats(self._started, self._spawned, self._waits, round(self._wait_max, 4),
                             round(self._wait_total, 4), self._died_unused, len(self._ready), len(self._starting))

    def check_invariants(self) -> None:
        """Every process is in exactly one place (a standby starting or ready, a worker, or
        dead awaiting its reap), no pid appears twice, workers carry their own id. Raises
        ``InvariantError`` naming the pids / ids."""
        with self._cv:
            places: dict[int, list[str]] = {}
            for w in self._starting.values():
                places.setdefault(w.pid, []).append("starting")
            for w in self._ready:
                places.setdefault(w.pid, []).append("ready")
            for wid, w in self.workers.items():
                places.setdefault(w.pid, []).append(f"worker {wid}")
                if w.wid != wid:
                    raise InvariantError(f"worker filed under id {wid} says it is {w.wid} (pid {w.pid})")
            for w in self._dead:
                places.setdefault(w.pid, []).append("dead")
            twice = {pid: where for pid, where in places.items() if len(where) > 1}
            if twice:
                raise InvariantError(f"chaos processes filed twice (duplicated): {twice}")
            bad = sorted(pid for pid, w in self._starting.items() if w.pid != pid)
            if bad:
                raise InvariantError(f"standbys filed under another pid: {bad}")

    def close(self) -> None:
        """Kill every worker and standby, reap them, stop the threads (idempotent)."""
        with self._cv:
            if self._closed and self._wfd < 0:
                return
            self._closed = True
            self._cv.notify_all()
        self._filler.join(30)
        for wid in list(self.workers):
            self.kill(wid)
        with self._cv:
            rest = list(self._starting.values()) + list(self._ready) + self._dead
            self._starting.clear()
            self._ready.clear()
            self._dead = []
        for w in rest:
            w.signal(signal.SIGKILL)
            w.close()
        for w in rest:
            try:
                w.popen.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait
                pass
        if self._wfd >= 0:
            os.close(self._wfd)
            self._wfd = -1
        self._reader.join(10)

    def __enter__(self) -> StandbyPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
