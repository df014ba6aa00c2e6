"""Counters every storage backend keeps: :class:`StorageStats` (a snapshot) and
:class:`StatsRecorder` (the thread-safe accumulator a backend updates once per batch call).

A page asked for is either a hit or a miss; ``corrupt`` and ``read_errors`` are the misses
whose page was present but unusable (failed validation / an I/O error), so ``misses`` also
counts them. A page given to ``batch_set`` is either a write or a write error.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

from radixkv.errors import InvariantError

__all__ = ["StorageStats", "StatsRecorder"]


class StorageStats(NamedTuple):
    """One backend's counters since it was opened (a snapshot; add two with :meth:`plus`)."""

    hits: int = 0             #: pages read back bit-equal (``batch_get`` ``True``)
    misses: int = 0           #: pages asked for and not returned (absent, corrupt, error)
    corrupt: int = 0          #: of the misses: present but failed validation (checksum, key, length)
    read_errors: int = 0      #: of the misses: present but the read failed (I/O, permission)
    writes: int = 0           #: pages stored (``batch_set`` ``True``)
    write_errors: int = 0     #: pages not stored: disk full, read-only, I/O error, backend down
    bytes_read: int = 0       #: payload bytes of the hits
    bytes_written: int = 0    #: payload bytes of the pages stored
    read_seconds: float = 0.0   #: wall time inside ``batch_get``
    write_seconds: float = 0.0  #: wall time inside ``batch_set``

    def plus(self, other: StorageStats) -> StorageStats:
        """The field-wise sum (several backends, or several shards, as one)."""
        return StorageStats._make(a + b for a, b in zip(self, other, strict=True))


class StatsRecorder:
    """A lock-guarded :class:`StorageStats`: one :meth:`add` per batch call, O(fields)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = StorageStats()

    def add(self, **deltas: float) -> None:
        """Add ``deltas`` (field name -> amount) to the counters."""
        with self._lock:
            cur = self._stats
            self._stats = cur._replace(**{k: getattr(cur, k) + v for k, v in deltas.items()})

    def check_invariants(self, page_bytes: int | None = None) -> None:
        """Raises ``InvariantError`` naming the counters that disagree: a negative one, more
        corrupt + unreadable pages than misses, or (with ``page_bytes``) bytes not equal to
        pages x ``page_bytes``."""
        st = self.snapshot()
        bad = [f"{k}={v}" for k, v in st._asdict().items() if v < 0]
        if st.corrupt + st.read_errors > st.misses:
            bad.append(f"corrupt + read_errors = {st.corrupt + st.read_errors} > misses = {st.misses}")
        if page_bytes is not None:
            for pages, nbytes in (("hits", "bytes_read"), ("writes", "bytes_written")):
                if getattr(st, nbytes) != getattr(st, pages) * page_bytes:
                    bad.append(f"{nbytes} = {getattr(st, nbytes)} != {pages} x {page_bytes}")
        if bad:
            raise InvariantError("storage counters disagree: " + "; ".join(bad))

    def snapshot(self) -> StorageStats:
        """The counters now (immutable)."""
        with self._lock:
            return self._stats
