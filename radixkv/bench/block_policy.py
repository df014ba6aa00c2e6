"""The eviction-policy side of :mod:`radixkv.bench.blocksim`: the callback interface
(:class:`BlockPolicy`), the lazily invalidated heap of evictable leaves (:class:`LeafHeap`),
sort-key policies (:class:`KeyPolicy`, the form RadixCache policies take) and the baselines
LRU / FIFO / LFU. The simulator itself (which blocks are cached, the protected path, the
replay loop) stays in :mod:`radixkv.bench.blocksim`, which re-exports these names.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from radixkv.errors import InvariantError, describe_ids

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.bench.blocksim import BlockSim

__all__ = ["LeafHeap", "BlockPolicy", "KeyPolicy", "LRU", "FIFO", "LFU", "grow_array"]


def grow_array(a: np.ndarray, n: int, fill=0) -> np.ndarray:
    """``a`` extended to length ``n`` with ``fill`` (unchanged when already long enough)."""
    return a if n <= len(a) else np.concatenate([a, np.full(n - len(a), fill, a.dtype)])


class LeafHeap:
    """The evictable leaves of one class, ordered by a key frozen when filed (smallest first).

    A binary heap with lazy invalidation: ``file`` pushes ``(key, stamp, block)`` and records
    the stamp; ``unfile`` forgets the stamp; stale entries are skipped when they reach the
    top and the heap is rebuilt when garbage exceeds live entries. O(log n) amortized each.
    Equivalent to a ``SortedKeyList`` keyed by ``sort_key``, ties broken by filing order.
    """

    def __init__(self, n_blocks: int):
        self._heap: list = []
        self._stamp = np.zeros(n_blocks, dtype=np.int64)
        self._seq = 0
        self.live = 0

    def grow(self, n_blocks: int) -> None:
        if n_blocks > len(self._stamp):
            self._stamp = np.concatenate([self._stamp, np.zeros(n_blocks - len(self._stamp), np.int64)])

    def __contains__(self, b: int) -> bool:
        return bool(self._stamp[b])

    def file(self, b: int, key) -> None:
        """File ``b`` under ``key`` (re-filing replaces its previous entry)."""
        if not self._stamp[b]:
            self.live += 1
        self._seq += 1
        self._stamp[b] = self._seq
        heapq.heappush(self._heap, (key, self._seq, b))
        if len(self._heap) > 2 * self.live + 4096:
            self._heap = [e for e in self._heap if self._stamp[e[2]] == e[1]]
            heapq.heapify(self._heap)

    def unfile(self, b: int) -> None:
        if self._stamp[b]:
            self._stamp[b] = 0
            self.live -= 1

    def peek(self) -> int:
        """The block with the smallest key, or -1 when empty (does not remove it)."""
        h, st = self._heap, self._stamp
        while h:
            _, s, b = h[0]
            if st[b] == s:
                return b
            heapq.heappop(h)
        return -1

    def peek_key(self):
        b = self.peek()
        return self._heap[0][0] if b >= 0 else None

    def members(self) -> np.ndarray:
        return np.flatnonzero(self._stamp)

    def check_invariants(self) -> None:
        """``live`` counts the filed blocks and each has its current entry in the heap."""
        filed = self.members()
        if len(filed) != self.live:
            raise InvariantError(f"leaf heap counts {self.live} live blocks, {len(filed)} are filed")
        current = {b for _, s, b in self._heap if self._stamp[b] == s}
        lost = [int(b) for b in filed if int(b) not in current]
        if lost:
            raise InvariantError(f"filed blocks without a heap entry: {describe_ids(lost)}")


class BlockPolicy:
    """Eviction policy interface of :class:`BlockSim` (all callbacks O(len(ids)) or O(log n)).

    Callback order per request: the matched path's tail leaves the evictable set
    (``leaf_removed``), ``on_hit(path)``, evictions (``victim`` -> ``on_evict``, which may
    make the parent an evictable leaf: ``leaf_added``), ``on_insert(new)``, then the new tail
    and the unprotected path tail become evictable (``leaf_added``).
    """

    name = "base"

    def attach(self, sim: "BlockSim") -> None:
        """Called once; allocate per-block state sized ``sim.n_blocks``."""
        self.sim = sim

    def grow(self, n_blocks: int) -> None:
        """The block universe grew to ``n_blocks`` (token-driven replays)."""

    def on_hit(self, ids: np.ndarray) -> None:
        """``ids`` (a chain, root first) were matched by the current request."""

    def on_insert(self, ids: np.ndarray) -> None:
        """``ids`` (a chain) were just cached."""

    def on_evict(self, b: int) -> None:
        """``b`` (the last ``victim``) was evicted; forget it."""

    def leaf_added(self, b: int) -> None:
        raise NotImplementedError

    def leaf_removed(self, b: int) -> None:
        raise NotImplementedError

    def victim(self) -> int:
        """An evictable leaf to evict next (not removed yet), or -1 when none."""
        raise NotImplementedError

    def evictable(self) -> np.ndarray:
        """Blocks the policy currently considers evictable (for invariant checks)."""
        raise NotImplementedError

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` when the policy's own state is inconsistent."""


class KeyPolicy(BlockPolicy):
    """A policy given by ``key(b)``: evict the evictable leaf with the smallest key, the key
    computed when the leaf is filed (it becomes an unprotected leaf). Subclasses keep per-block
    statistics in numpy arrays updated by ``on_hit`` / ``on_insert`` and define ``key``."""

    def attach(self, sim):
        super().attach(sim)
        self.leaves = LeafHeap(sim.n_blocks)

    def grow(self, n_blocks):
        self.leaves.grow(n_blocks)

    def key(self, b: int):
        raise NotImplementedError

    def leaf_added(self, b):
        self.leaves.file(b, self.key(b))

    def leaf_removed(self, b):
        self.leaves.unfile(b)

    def victim(self):
        return self.leaves.peek()

    def on_evict(self, b):
        self.leaves.unfile(b)

    def evictable(self):
        return self.leaves.members()

    def check_invariants(self):
        self.leaves.check_invariants()


# ---------------------------------------------------------------------- baselines
class LRU(KeyPolicy):
    """Least recently used leaf first (key: last request that touched the block)."""

    name = "lru"

    def attach(self, sim):
        super().attach(sim)
        self.last = np.zeros(sim.n_blocks, dtype=np.int64)

    def grow(self, n):
        super().grow(n)
        self.last = np.concatenate([self.last, np.zeros(n - len(self.last), np.int64)])

    def on_hit(self, ids):
        self.last[ids] = self.sim.now

    on_insert = on_hit

    def key(self, b):
        return int(self.last[b])


class FIFO(LRU):
    """Oldest inserted leaf first; hits do not matter."""

    name = "fifo"

    def on_hit(self, ids):
        pass

    def on_insert(self, ids):
        self.last[ids] = self.sim.now


class LFU(LRU):
    """Fewest requests through the block first; ties by least recent use."""

    name = "lfu"

    def attach(self, sim):
        super().attach(sim)
        self.freq = np.zeros(sim.n_blocks, dtype=np.int64)

    def grow(self, n):
        super().grow(n)
        self.freq = np.concatenate([self.freq, np.zeros(n - len(self.freq), np.int64)])

    def on_hit(self, ids):
        self.last[ids] = self.sim.now
        self.freq[ids] += 1

    def on_insert(self, ids):
        self.last[ids] = self.sim.now
        self.freq[ids] = 1

    def key(self, b):
        return (int(self.freq[b]), int(self.last[b]))
