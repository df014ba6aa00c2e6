"""``StorageController``: the storage tier (L3) behind the host tier, off the caller's path.

One worker thread owns the backend (a :class:`~radixkv.contracts.StorageBackend`) and a
staging buffer of ``batch_pages`` page rows registered with it; every backend call moves
whole pages through that buffer. Jobs wait in one priority queue, reads before writes:

* ``backup(keys, rows)``: enqueue pages to write (the rows are the caller's snapshot);
  never blocks: past ``max_pending_pages`` queued pages the backup is dropped and counted.
* ``fetch(keys)``: ``batch_exists`` then ``batch_get`` of the leading present pages; the
  caller waits at most ``timeout_s`` and otherwise gets nothing (the late answer is
  discarded), so a slow or dead backend costs hits, never a stalled call.
* A backend that raises is a miss or a failed write, counted and logged once.

Cost on the caller's thread: one queue put (backup), one wait bounded by the timeout (fetch).
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from radixkv.contracts import STORAGE_ADMIT, StorageBackend
from radixkv.errors import InvalidArgumentError

__all__ = ["StorageController", "StorageStats"]

log = logging.getLogger(__name__)


@dataclass
class StorageStats:
    """Counters of the storage tier (pages unless named otherwise)."""

    written: int = 0
    write_failed: int = 0
    backup_dropped: int = 0
    fetched: int = 0
    fetch_timeouts: int = 0
    errors: int = 0
    pending: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Read:
    keys: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False
    rows: torch.Tensor | None = None


class StorageController:
    """Runs a storage backend's calls on one worker thread (see the module docstring).

    Args:
        backend: the storage backend (its calls may block).
        page_bytes: bytes of one page row (the host pool's ``page_bytes``).
        timeout_s: the longest a ``fetch`` waits.
        batch_pages: pages per backend call (SGLang uses at most 128).
        max_pending_pages: queued backup pages past which backups are dropped.
        admit: ``all`` (back up every inserted page) or ``reused`` (pages hit once since).
    """

    def __init__(self, backend: StorageBackend, page_bytes: int, *, timeout_s: float = 0.05,
                 batch_pages: int = 128, max_pending_pages: int = 8192, admit: str = "all") -> None:
        if admit not in STORAGE_ADMIT:
            raise InvalidArgumentError(f"storage admit must be 'all' or 'reused', got {admit!r}")
        if not timeout_s >= 0:
            raise InvalidArgumentError(f"storage timeout must be >= 0 seconds, got {timeout_s!r}")
        self.backend = backend
        self.page_bytes = int(page_bytes)
        self.timeout_s = float(timeout_s)
        self.batch_pages = int(batch_pages)
        self.max_pending_pages = int(max_pending_pages)
        self.admit = admit
        self.stats = StorageStats()
        self._staging = torch.zeros((self.batch_pages, self.page_bytes), dtype=torch.uint8)
        self._jobs: queue.PriorityQueue[tuple[int, int, _Read | tuple[list[str], torch.Tensor] | None]] = \
            queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._warned = False
        self._closed = False
        self._call("register_buffer", backend.register_buffer, self._staging)
        self._thread = threading.Thread(target=self._run, name=f"radixkv-storage-{backend.name}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller side
    def backup(self, keys: Sequence[str], rows: torch.Tensor) -> bool:
        """Queue ``rows`` (``[len(keys), page_bytes]`` uint8 CPU, not touched afterwards by
        the caller) to be written under ``keys``. False (counted) when the queue is full."""
        n = len(keys)
        if not n:
            return True
        with self._lock:
            if self._closed or self.stats.pending + n > self.max_pending_pages:
                self.stats.backup_dropped += n
                return False
            self.stats.pending += n
        self._jobs.put((1, next(self._seq), (list(keys), rows)))
        return True

    def fetch(self, keys: Sequence[str]) -> torch.Tensor:
        """The leading pages of ``keys`` that storage holds, as rows ``[k, page_bytes]``
        (k may be 0), waiting at most ``timeout_s``; a timeout is counted and returns none."""
        if not keys or self._closed:
            return self._staging[:0].clone()
        job = _Read(list(keys))
        self._jobs.put((0, next(self._seq), job))
        if not job.done.wait(self.timeout_s):
            with self._lock:
                job.abandoned = True
                if not job.done.is_set():
                    self.stats.fetch_timeouts += 1
                    self._warn("a storage read took longer than the timeout; serving from the faster tiers")
                    return self._staging[:0].clone()
        rows = job.rows
        return rows if rows is not None else self._staging[:0].clone()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued backup was written (or failed), at most ``timeout_s``.
        True when the queue is empty."""
        with self._idle:
            return self._idle.wait_for(lambda: self.stats.pending == 0, timeout=timeout_s)

    def close(self, drain_timeout_s: float = 0.0) -> None:
        """Drain (bounded), stop the worker, close the backend. Idempotent."""
        if self._closed:
            return
        self.drain(drain_timeout_s)
        with self._lock:
            self._closed = True
        self._jobs.put((2, next(self._seq), None))
        self._thread.join(timeout=max(drain_timeout_s, 1.0))
        self._call("close", self.backend.close)

    # ------------------------------------------------------------------ worker side
    def _warn(self, msg: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("storage tier (%s): %s", self.backend.name, msg)

    def _call(self, what: str, fn: Callable[..., object], *args: object) -> object:
        try:
            return fn(*args)
        except Exception as e:  # a backend never fails the manager: counted, logged once
            self.stats.errors += 1
            self._warn(f"{what} raised {type(e).__name__}: {e}")
            return None

    def _run(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, _Read):
                self._read(job)
            else:
                self._write(*job)

    def _read(self, job: _Read) -> None:
        got: list[torch.Tensor] = []
        if not job.abandoned:
            present = self._call("batch_exists", self.backend.batch_exists, job.keys)
            n = int(present) if isinstance(present, int) else 0
            for start in range(0, n, self.batch_pages):
                keys = job.keys[start:min(n, start + self.batch_pages)]
                dst = self._staging[:len(keys)]
                ok = self._call("batch_get", self.backend.batch_get, keys, dst)
                flags = list(ok) if isinstance(ok, list) else [False] * len(keys)
                lead = next((i for i, f in enumerate(flags) if not f), len(keys))
                if lead:
                    got.append(dst[:lead].clone())
                if lead < len(keys):
                    break
        with self._lock:
            job.rows = torch.cat(got) if got else None
            if not job.abandoned and job.rows is not None:
                self.stats.fetched += int(job.rows.shape[0])
            job.done.set()

    def _write(self, keys: list[str], rows: torch.Tensor) -> None:
        for start in range(0, len(keys), self.batch_pages):
            part = keys[start:start + self.batch_pages]
            src = self._staging[:len(part)]
            src.copy_(rows[start:start + len(part)])
            ok = self._call("batch_set", self.backend.batch_set, part, src)
            flags = list(ok) if isinstance(ok, list) else [False] * len(part)
            with self._lock:
                self.stats.written += sum(bool(f) for f in flags)
                self.stats.write_failed += sum(not f for f in flags)
        with self._idle:
            self.stats.pending -= len(keys)
            self._idle.notify_all()
