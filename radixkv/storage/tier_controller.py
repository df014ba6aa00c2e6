"""``StorageController``: the storage tier (L3) behind the host tier, off the caller's path.

One worker thread owns the backend (a :class:`~radixkv.contracts.StorageBackend`) and a
staging buffer of ``batch_pages`` rows registered with it (writes go through it; reads land in
fresh rows, :mod:`radixkv.storage.host_rows`). Jobs wait in one priority queue, reads first:

* ``backup(keys, rows)``: enqueue pages to write; never blocks (past ``max_pending_pages``: dropped).
* ``fetch(keys)``: prefetched pages, then ``batch_exists`` + ``batch_get`` waited for at most
  ``timeout_s``; a late read goes on and its pages wait (``max_ready_pages``) for a later fetch.
  One read per first key, ``max_pending_reads`` in all: a slow backend costs hits, not calls.
* ``fetch_into(keys, reserve)``: the same straight into host-pool rows (a scattering backend),
  reserved for every key up front (one pass) or once the count is known.
* ``last_present(groups)``: the last group of keys held whole (a hybrid's deepest stored state).
* A batch of 16+ pages (a backend taking concurrent calls): slices read or written at once
  by the worker and ``read_threads - 1`` readers. A backend that raises: a miss or a failed write.
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixkv.contracts import (
    STORAGE_ADMIT,
    ConcurrentStorageBackend,
    PageBuffers,
    ScatterStorageBackend,
    StorageBackend,
)
from radixkv.errors import InvalidArgumentError, InvariantError, LengthMismatchError
from radixkv.storage.host_rows import fresh_rows

__all__ = ["StorageController", "StorageStats"]

log = logging.getLogger(__name__)

#: A read is split only when every slice gets at least this many pages.
MIN_SLICE_PAGES = 8


@dataclass
class StorageStats:
    """Counters of the storage tier (pages unless named otherwise): ``queued`` pages were
    accepted by ``backup``; ``fetched`` pages were returned by ``fetch``, which spent ``wait_us``
    waiting; ``prefetched`` pages arrived after their fetch had returned, ``prefetch_used`` of them
    a later fetch returned."""

    written: int = 0
    write_failed: int = 0
    backup_dropped: int = 0
    fetched: int = 0
    fetch_timeouts: int = 0
    errors: int = 0
    pending: int = 0
    queued: int = 0
    wait_us: int = 0
    prefetched: int = 0
    prefetch_used: int = 0

    def snapshot(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Read:
    keys: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    late: bool = False  # its caller returned: the rows go to the ready pages
    rows: torch.Tensor | None = None
    # fetch_into only: the worker sets ``present`` then ``asked``; the caller sets ``dst``
    # (the pages' destinations, maybe fewer) or ``late``, then ``given``; ``hits`` read into dst.
    direct: bool = False
    present: int = 0
    asked: threading.Event = field(default_factory=threading.Event)
    given: threading.Event = field(default_factory=threading.Event)
    dst: list[list[torch.Tensor | memoryview]] | None = None
    hits: int = 0
    upfront: bool = False  # ``dst`` given with the job: no count, no hand-off


@dataclass
class _Probe:
    groups: list[list[str]]
    done: threading.Event = field(default_factory=threading.Event)
    found: int = -1
    late: bool = False  # its caller returned: the worker stops probing


@dataclass
class _Slice:
    """Contiguous keys of one backend call split over threads and their rows or page
    buffers; ``flags`` one per key once ``done``."""

    what: str  # the backend call: batch_get or batch_set
    keys: list[str]
    buf: Any
    start: int  # the first key's index in the batch
    cut: list[int] | None  # a read's [first miss seen so far], shared by its slices
    flags: list[bool] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


def default_read_threads() -> int:
    """Threads reading one storage batch by default: min(4, CPUs this process may use)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


class StorageController:
    """Runs a storage backend's calls on one worker thread (see the module docstring).

    Args:
        backend: the storage backend (its calls may block).
        page_bytes: bytes of one page row (the host pool's ``page_bytes``).
        timeout_s: the longest a ``fetch`` waits.
        batch_pages: pages per backend call (SGLang uses at most 128).
        max_pending_pages: queued backup pages past which backups are dropped.
        admit: ``all`` (back up every inserted page) or ``reused`` (pages hit once since).
        max_pending_reads: reads in flight past which a fetch returns nothing.
        max_ready_pages: prefetched pages kept for a later fetch (default ``batch_pages``).
        read_threads: threads calling a backend that takes concurrent calls on a batch's slices.
    """

    def __init__(self, backend: StorageBackend, page_bytes: int, *, timeout_s: float = 0.05,
                 batch_pages: int = 128, max_pending_pages: int = 8192, admit: str = "all",
                 max_pending_reads: int = 64, max_ready_pages: int | None = None,
                 read_threads: int | None = None) -> None:
        if read_threads is None:
            read_threads = default_read_threads()
        if isinstance(read_threads, bool) or not isinstance(read_threads, int) or read_threads < 1:
            raise InvalidArgumentError(f"storage read threads must be an int >= 1, got {read_threads!r}")
        if admit not in STORAGE_ADMIT:
            raise InvalidArgumentError(f"storage admit must be 'all' or 'reused', got {admit!r}")
        if not timeout_s >= 0:
            raise InvalidArgumentError(f"storage timeout must be >= 0 seconds, got {timeout_s!r}")
        self.backend = backend
        self.page_bytes = int(page_bytes)
        self.timeout_s = float(timeout_s)
        self.batch_pages = int(batch_pages)
        self.max_pending_pages = int(max_pending_pages)
        self.max_pending_reads = int(max_pending_reads)
        self.max_ready_pages = self.batch_pages if max_ready_pages is None else int(max_ready_pages)
        self.admit = admit
        self.read_threads = read_threads
        self._reads: dict[str, _Read] = {}  # reads in flight by first key
        self._ready: OrderedDict[str, torch.Tensor] = OrderedDict()  # prefetched page rows by key
        self.stats = StorageStats()
        self._staging = torch.zeros((self.batch_pages, self.page_bytes), dtype=torch.uint8)
        self._jobs: queue.PriorityQueue[tuple[int, int, _Read | _Probe | tuple[list[str], torch.Tensor] | None]] = \
            queue.PriorityQueue()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._warned = False
        self._closed = False
        #: The backend reads pages straight into caller buffers (``fetch_into`` may be used).
        self.scatters = isinstance(backend, ScatterStorageBackend) and backend.scatter_reads is True
        self._call("register_buffer", backend.register_buffer, self._staging)
        self._thread = threading.Thread(target=self._run, name=f"radixkv-storage-{backend.name}", daemon=True)
        self._thread.start()
        self._slices: queue.SimpleQueue[_Slice | None] = queue.SimpleQueue()
        # (a backend that serializes its calls would only pay more calls for them)
        concurrent = isinstance(backend, ConcurrentStorageBackend) and backend.concurrent_calls is True
        self._readers = [threading.Thread(target=self._run_reader, name=f"radixkv-storage-{backend.name}-read{i}",
                                          daemon=True) for i in range(1, read_threads if concurrent else 1)]
        for t in self._readers:
            t.start()

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
            self.stats.queued += n
        self._jobs.put((1, next(self._seq), (list(keys), rows)))
        return True

    def fetch(self, keys: Sequence[str], timeout_s: float | None = None) -> torch.Tensor:
        """The leading pages of ``keys`` that storage holds, as rows ``[k, page_bytes]``
        (k may be 0; read-only: a read's own rows are returned uncopied, maybe to two callers):
        prefetched pages first, then a read waited for at most ``timeout_s``; a timeout is
        counted, returns what was prefetched and leaves the read running. ``timeout_s``: by
        default the controller's."""
        if not keys or self._closed:
            return self._staging[:0].clone()
        t0 = time.perf_counter_ns()
        with self._lock:
            rows = self._take_ready(keys)
            rest = list(keys[len(rows):])
            job = self._reads.get(rest[0]) if rest else None
            if rest and job is None and len(self._reads) < self.max_pending_reads:
                job = self._reads[rest[0]] = _Read(rest)
                self._jobs.put((0, next(self._seq), job))
        if job is not None:
            job.done.wait(self.timeout_s if timeout_s is None else max(timeout_s, 0.0))
        block: torch.Tensor | None = None  # the read's leading rows when no prefetched row came first
        with self._lock:
            self.stats.wait_us += (time.perf_counter_ns() - t0) // 1000
            if job is not None and job.done.is_set():
                if job.late:  # given up by an earlier fetch: its pages wait among the ready ones
                    rows += self._take_ready(rest)
                elif job.rows is not None:
                    same = next((i for i, (a, b) in enumerate(zip(job.keys, rest)) if a != b), len(rest))
                    if rows:
                        rows += list(job.rows[:same])
                    else:  # no copy: fresh memory costs a page fault per 4 KiB (storage/host_rows.py)
                        block = job.rows[:same]
            elif rest:
                if job is not None:
                    job.late = True
                self.stats.fetch_timeouts += 1
                self._warn("a storage read took longer than the timeout; serving from the faster tiers")
            self.stats.fetched += len(rows) if block is None else int(block.shape[0])
        if block is not None:
            return block
        return torch.stack(rows) if rows else self._staging[:0].clone()

    def fetch_into(self, keys: Sequence[str], reserve: Callable[[int], PageBuffers] | PageBuffers
                   ) -> tuple[int, threading.Event | None]:
        """``fetch`` straight into the caller's buffers (a scattering backend only). ``reserve``
        is either every key's page buffers (one pass: the worker reads the leading pages at
        once, no count first) or a callable: once the worker has counted the leading pages
        storage holds (prefetched ones first), ``reserve(n)`` runs here, once, and returns up to
        ``n`` pages' buffers. Returns ``(k, pending)``: the first ``k`` pages hold pages; when
        ``pending`` is an event (the read outlived ``timeout_s``), the pages after them stay the
        read's until it is set, else the caller may reuse them at once. Waits <= ``timeout_s``."""
        if not self.scatters:
            raise InvalidArgumentError(f"the {self.backend.name} storage backend cannot read into buffers")
        given = None if callable(reserve) else [list(b) for b in reserve]
        if given is not None and len(given) != len(keys):
            raise LengthMismatchError(f"{len(given)} pages' buffers for {len(keys)} keys")
        if not keys or self._closed:
            return 0, None
        t0 = time.perf_counter_ns()
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            ready = self._take_ready(keys)
            rest = list(keys[len(ready):])
            other = self._reads.get(rest[0]) if rest else None
        if other is not None and other.done.wait(self.timeout_s):  # a late read of these: its pages
            with self._lock:
                ready += self._take_ready(rest)
                rest = list(keys[len(ready):])
        with self._lock:
            job = None
            if rest and rest[0] not in self._reads and len(self._reads) < self.max_pending_reads:
                job = self._reads[rest[0]] = _Read(rest, direct=True)
                if given is not None:  # the read's destinations from the start: no hand-off back
                    job.dst, job.upfront = given[len(ready):], True
                self._jobs.put((0, next(self._seq), job))
        bufs = given if given is not None else self._reserve_counted(job, len(ready), reserve, deadline)  # type: ignore[arg-type]
        k = min(len(ready), len(bufs))
        for row, b in zip(ready, bufs):
            _fill(b, row)
        if job is not None:
            job.done.wait(max(deadline - time.monotonic(), 0.0))
        pending = None
        with self._lock:
            self.stats.wait_us += (time.perf_counter_ns() - t0) // 1000
            if job is not None and job.done.is_set():
                k += job.hits if k == len(ready) else 0
            elif job is not None:
                job.late = True
                pending = job.done if job.dst else None
                self.stats.fetch_timeouts += 1
                self._warn("a storage read took longer than the timeout; serving from the faster tiers")
            self.stats.fetched += k
        return k, pending

    def last_present(self, groups: Sequence[Sequence[str]], timeout_s: float | None = None) -> int:
        """The index of the last of ``groups`` (lists of keys) whose every key storage holds
        (-1: none, or the probe outlived ``timeout_s``, counted as a fetch timeout; the worker
        then stops it). One ``batch_exists`` a group on the worker, from the last group back.
        ``timeout_s``: by default the controller's."""
        if not groups or self._closed:
            return -1
        job = _Probe([list(g) for g in groups])
        t0 = time.perf_counter_ns()
        self._jobs.put((0, next(self._seq), job))
        done = job.done.wait(self.timeout_s if timeout_s is None else max(timeout_s, 0.0))
        with self._lock:
            self.stats.wait_us += (time.perf_counter_ns() - t0) // 1000
            if not done:
                job.late = True
                self.stats.fetch_timeouts += 1
                self._warn("a storage probe took longer than the timeout; serving from the faster tiers")
                return -1
        return job.found

    def _reserve_counted(self, job: _Read | None, n_ready: int, reserve: Callable[[int], PageBuffers],
                         deadline: float) -> list[list[torch.Tensor | memoryview]]:
        """``fetch_into``'s counting hand-off: wait (within the timeout) for the worker's count,
        call ``reserve`` once, give the read its buffers (or give it up)."""
        if job is not None:
            job.asked.wait(max(deadline - time.monotonic(), 0.0))
        bufs: list[list[torch.Tensor | memoryview]] = []
        try:
            want = n_ready + (job.present if job is not None and job.asked.is_set() else 0)
            bufs = [list(b) for b in reserve(want)][:want] if want else []
        finally:
            if job is not None:
                with self._lock:
                    if job.asked.is_set():
                        job.dst = bufs[n_ready:]
                    else:
                        job.late = True
                    job.given.set()
        return bufs

    def _take_ready(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """Pop the prefetched rows of the leading ``keys`` (the caller holds the lock)."""
        out = []
        for k in keys:
            row = self._ready.pop(k, None)
            if row is None:
                break
            out.append(row)
        self.stats.prefetch_used += len(out)
        return out

    def wait_reads(self, timeout_s: float) -> bool:
        """Wait until no read is in flight (prefetches landed), at most ``timeout_s``. True
        when none is."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._reads, timeout=timeout_s)

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
        for _ in self._readers:  # behind any slice still queued: a stuck reader stalls no one (daemon)
            self._slices.put(None)
        self._call("close", self.backend.close)
        with self._lock:
            self._ready.clear()

    def check_invariants(self) -> None:
        """Every page queued is written, failed or still pending (``queued == written +
        write_failed + pending``, ``pending >= 0``) and the reads keep their bounds; raises
        ``InvariantError``. O(1)."""
        with self._lock:
            s = self.stats
            if s.pending < 0 or s.queued != s.written + s.write_failed + s.pending:
                raise InvariantError(f"storage queue not conserved: queued {s.queued} != written {s.written} "
                                     f"+ failed {s.write_failed} + pending {s.pending}")
            if len(self._ready) > self.max_ready_pages or len(self._reads) > self.max_pending_reads:
                raise InvariantError(f"storage reads past their bounds: {len(self._ready)} ready pages "
                                     f"(max {self.max_ready_pages}), {len(self._reads)} reads in flight "
                                     f"(max {self.max_pending_reads})")

    # ------------------------------------------------------------------ worker side
    def _warn(self, msg: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("storage tier (%s): %s", self.backend.name, msg)

    def _call(self, what: str, fn: Callable[..., object], *args: object) -> object:
        try:
            return fn(*args)
        except Exception as e:  # a backend never fails the manager: counted, logged once
            with self._lock:  # (reader threads call it too)
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
            elif isinstance(job, _Probe):
                self._probe(job)
            else:
                self._write(*job)

    def _run_reader(self) -> None:
        while (part := self._slices.get()) is not None:
            self._run_slice(part)

    def _get(self, keys: list[str], dst: Any) -> list[bool]:
        """``batch_get`` of ``keys`` into ``dst`` (rows or page buffers) by :meth:`_split`; a
        slice past a miss already seen is not read (its pages are not in the lead)."""
        return self._split("batch_get", keys, dst, [len(keys)])

    def _split(self, what: str, keys: list[str], buf: Any, cut: list[int] | None) -> list[bool]:
        """Backend call ``what`` over ``keys`` and ``buf`` in contiguous slices; with reader
        threads and 16+ pages, small slices (>= ``MIN_SLICE_PAGES``, ~4 per thread) taken by
        whichever thread is free, the worker included. One flag per key (a slice that raised:
        all False). Returns once no slice touches ``buf`` any more."""
        n = len(keys)
        split = bool(self._readers) and n >= 2 * MIN_SLICE_PAGES
        size = self.batch_pages
        if split:
            size = min(size, max(MIN_SLICE_PAGES, -(-n // (4 * self.read_threads))))
        parts = [_Slice(what, keys[a:a + size], buf[a:a + size], a, cut) for a in range(0, n, size)]
        for part in parts[1:] if split else ():
            self._slices.put(part)
        for part in parts[:1] if split else parts:
            self._run_slice(part)
        while split:  # take the slices no reader took yet
            try:
                other = self._slices.get_nowait()
            except queue.Empty:
                break
            if other is None:  # closing: leave it for a reader
                self._slices.put(None)
                break
            self._run_slice(other)
        for part in parts:
            part.done.wait()
        return [f for part in parts for f in part.flags]

    def _run_slice(self, part: _Slice) -> None:
        m, cut = len(part.keys), part.cut
        try:
            part.flags = [False] * m
            if cut is not None and part.start >= cut[0]:  # after a miss: not in the lead whatever it holds
                return
            fn = self.backend.batch_get if part.what == "batch_get" else self.backend.batch_set
            ok = self._call(part.what, fn, part.keys, part.buf)
            if isinstance(ok, list):
                part.flags = ([bool(f) for f in ok] + part.flags)[:m]
            lead = _lead(part.flags)
            if cut is not None and lead < m:  # (a race may keep a later miss: never one before the first)
                cut[0] = min(cut[0], part.start + lead)
        finally:
            part.done.set()

    def _read(self, job: _Read) -> None:
        rows: torch.Tensor | None = None
        try:
            if job.upfront:
                if not self._closed:
                    self._read_into(job)
            elif not self._closed:
                present = self._call("batch_exists", self.backend.batch_exists, job.keys)
                n = int(present) if isinstance(present, int) else 0
                if job.direct:
                    rows = self._read_direct(job, n)
                elif n > 0:
                    rows = self._read_rows(job.keys[:n])
        finally:
            job.asked.set()  # (a caller still waiting on it would wait out its timeout otherwise)
            self._finish(job, rows)

    def _probe(self, job: _Probe) -> None:
        try:
            for i in range(len(job.groups) - 1, -1, -1):
                if job.late or self._closed:
                    break
                group = job.groups[i]
                if self._call("batch_exists", self.backend.batch_exists, group) == len(group):
                    job.found = i
                    break
        finally:
            job.done.set()

    def _read_direct(self, job: _Read, n: int) -> torch.Tensor | None:
        """Hand ``n`` to ``fetch_into``'s caller, wait for its buffers (it gives them or gives
        up within its timeout) and read into them; a caller that gave up gets fresh rows."""
        with self._lock:
            job.present = n
            if not job.late:
                job.asked.set()
        if n and not job.late:
            job.given.wait()
        with self._lock:
            dst = job.dst
        if dst is None:
            return self._read_rows(job.keys[:n]) if n else None
        self._read_into(job)
        return None

    def _read_into(self, job: _Read) -> None:
        """One ``batch_get`` of the leading keys into ``job.dst``; ``hits``: the leading pages
        read whole (a missing or corrupt page ends them)."""
        dst = job.dst
        if dst:
            job.hits = _lead(self._get(job.keys[:len(dst)], dst))

    def _finish(self, job: _Read, rows: torch.Tensor | None) -> None:
        """Publish a read: a late one's pages go to the ready ones (a late direct read's
        copied out of its buffers, which its caller reuses once ``done`` is set)."""
        with self._lock:
            job.rows = rows
            if self._reads.get(job.keys[0]) is job:
                del self._reads[job.keys[0]]
            if job.late and job.dst and job.hits:
                rows = torch.stack([torch.cat([_flat(b) for b in bufs]) for bufs in job.dst[:job.hits]])
            if rows is not None and job.late:  # its caller returned: keep the pages for the next fetch
                self.stats.prefetched += int(rows.shape[0])
                for k, row in zip(job.keys, rows):
                    self._ready[k] = row
                    self._ready.move_to_end(k)
                while len(self._ready) > self.max_ready_pages:
                    self._ready.popitem(last=False)
            job.done.set()
            self._idle.notify_all()

    def _read_rows(self, keys: list[str]) -> torch.Tensor | None:
        """The leading pages of ``keys`` read straight into one buffer of fresh (huge-page
        advised) rows, the rows ``fetch`` returns: no staging copy, no concatenation. ``None``
        when the first page misses. Rows never read are never touched (no memory)."""
        out = fresh_rows(len(keys), self.page_bytes)
        got = _lead(self._get(keys, out))
        return out[:got] if got else None

    def _write(self, keys: list[str], rows: torch.Tensor) -> None:
        for start in range(0, len(keys), self.batch_pages):
            part = keys[start:start + self.batch_pages]
            src = self._staging[:len(part)]
            src.copy_(rows[start:start + len(part)])
            flags = self._split("batch_set", part, src, None)
            with self._idle:  # one lock section: check_invariants sees the queue conserved
                self.stats.written += sum(bool(f) for f in flags)
                self.stats.write_failed += sum(not f for f in flags)
                self.stats.pending -= len(part)
                self._idle.notify_all()


def _lead(flags: list[bool]) -> int:
    """How many leading ``flags`` are true."""
    return next((i for i, f in enumerate(flags) if not f), len(flags))


def _flat(b: torch.Tensor | memoryview) -> torch.Tensor:
    """A page buffer as a flat uint8 tensor over the same bytes."""
    return torch.frombuffer(b, dtype=torch.uint8) if isinstance(b, memoryview) else b.reshape(-1)


def _fill(bufs: Sequence[torch.Tensor | memoryview], row: torch.Tensor) -> None:
    """Copy a page row into its buffers, in order."""
    at = 0
    for b in bufs:
        flat = _flat(b)
        flat.copy_(row[at:at + flat.numel()])
        at += flat.numel()
