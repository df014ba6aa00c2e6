"""Queue machinery of the scan-resistant baselines (:mod:`radixkv.bench.queue_baselines`)
under leaf-only eviction: :class:`QueuePolicy` (numbered queues, each filing its evictable
leaves in a :class:`~radixkv.bench.block_policy.LeafHeap`; a queue's "head" is its head-most
*evictable leaf*, non-leaf blocks wait in their queue until their children go) and
:class:`Ghost`, a bounded FIFO of evicted block ids with tokens as the unit (the
simulator's stand-in for a set of block hashes). O(log n) per callback.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from radixkv.bench.block_policy import BlockPolicy, LeafHeap
from radixkv.bench.block_policy import grow_array as _grow
from radixkv.errors import InvariantError, describe_ids

__all__ = ["Ghost", "QueuePolicy"]


class Ghost:
    """A bounded FIFO of evicted block ids, sized in tokens (a set of hashes in a real cache).

    ``add`` appends (re-adding moves it to the back), ``discard`` removes lazily, the front is
    trimmed while the total exceeds ``cap_tokens``. O(1) amortized per operation.
    """

    def __init__(self, n_blocks: int, cap_tokens: int):
        self.cap = int(cap_tokens)
        self.seq = np.zeros(n_blocks, dtype=np.int64)   # 0: absent, else entry number
        self.size_of = np.zeros(n_blocks, dtype=np.int64)
        self.fifo: deque = deque()
        self.n = 0
        self.tokens = 0

    def grow(self, n):
        self.seq = _grow(self.seq, n)
        self.size_of = _grow(self.size_of, n)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self.seq[ids] > 0

    def add(self, b: int, ln: int) -> None:
        self.discard(b)
        self.n += 1
        self.seq[b] = self.n
        self.size_of[b] = ln
        self.tokens += ln
        self.fifo.append((b, self.n))
        while self.tokens > self.cap and self.fifo:
            v, s = self.fifo.popleft()
            if self.seq[v] == s:
                self.discard(v)

    def discard(self, b: int) -> None:
        if self.seq[b]:
            self.seq[b] = 0
            self.tokens -= int(self.size_of[b])

    def check_invariants(self) -> None:
        """Token count = sizes of present ids, within the cap; each present id is queued."""
        present = np.flatnonzero(self.seq)
        tok = int(self.size_of[present].sum())
        if tok != self.tokens or self.tokens > self.cap:
            raise InvariantError(f"ghost counts {self.tokens} tokens (cap {self.cap}), holds {tok}")
        queued = {b for b, s in self.fifo if self.seq[b] == s}
        lost = [int(b) for b in present if int(b) not in queued]
        if lost:
            raise InvariantError(f"ghost ids missing from its FIFO: {describe_ids(lost)}")


class QueuePolicy(BlockPolicy):
    """Blocks live in numbered queues; each queue files its evictable leaves in a
    :class:`LeafHeap` under a per-block key (an LRU/FIFO position). ``qtok[q]`` counts the
    tokens of every cached block of queue ``q`` (leaf or not).

    With ``track_order`` every member is also kept in order (``order[q]``), so a policy can
    act on a queue's oldest block even when it is an interior block pinned by its children
    (promotion is not eviction); without it, blocks a later request extended would sit in
    a small queue forever and leave only the newest tails to evict."""

    n_queues = 2
    #: also keep every member (leaf or not) of each queue in order (``order[q]``)
    track_order = False

    def attach(self, sim):
        super().attach(sim)
        n = sim.n_blocks
        self.order = [LeafHeap(n) for _ in range(self.n_queues)] if self.track_order else []
        self.q = np.full(n, -1, dtype=np.int8)
        self.qkey = np.zeros(n, dtype=np.int64)
        self.is_leaf = np.zeros(n, dtype=bool)
        self.heaps = [LeafHeap(n) for _ in range(self.n_queues)]
        self.qtok = [0] * self.n_queues
        self.tick = 0

    def grow(self, n):
        self.q = _grow(self.q, n, -1)
        self.qkey = _grow(self.qkey, n)
        self.is_leaf = _grow(self.is_leaf, n)
        for h in self.heaps + self.order:
            h.grow(n)

    def place(self, ids: np.ndarray, q: int) -> None:
        """Put ``ids`` (cached or just inserted) at the back of queue ``q``."""
        bl = self.sim.block_len
        old = self.q[ids]
        for oq in range(self.n_queues):
            m = old == oq
            if m.any():
                self.qtok[oq] -= int(bl[ids[m]].sum())
        self.qtok[q] += int(bl[ids].sum())
        self.q[ids] = q
        keys = self.tick + 1 + np.arange(len(ids))
        self.tick += len(ids)
        self.qkey[ids] = keys
        if self.track_order:
            for b, oq, k in zip(ids.tolist(), old.tolist(), keys.tolist()):
                if oq >= 0:
                    self.order[oq].unfile(b)
                self.order[q].file(b, k)
        for b, oq in zip(ids[self.is_leaf[ids]].tolist(), old[self.is_leaf[ids]].tolist()):
            self.heaps[oq].unfile(b)
            self.heaps[q].file(b, int(self.qkey[b]))

    def leaf_added(self, b):
        self.is_leaf[b] = True
        self.heaps[self.q[b]].file(b, int(self.qkey[b]))

    def leaf_removed(self, b):
        self.is_leaf[b] = False
        self.heaps[self.q[b]].unfile(b)

    def on_evict(self, b):
        q = int(self.q[b])
        ln = int(self.sim.block_len[b])
        self.is_leaf[b] = False
        self.heaps[q].unfile(b)
        if self.track_order:
            self.order[q].unfile(b)
        self.qtok[q] -= ln
        self.q[b] = -1

    def evictable(self):
        return np.unique(np.concatenate([h.members() for h in self.heaps]))

    def check_invariants(self):
        sim = self.sim
        cached = sim.cached
        wrong = np.flatnonzero(cached != (self.q >= 0))
        if len(wrong):
            raise InvariantError(f"{self.name}: queue membership disagrees with the cache for {describe_ids(wrong)}")
        for qi in range(self.n_queues):
            tok = int(sim.block_len[self.q == qi].sum())
            if tok != self.qtok[qi]:
                raise InvariantError(f"{self.name}: queue {qi} counts {self.qtok[qi]} tokens, holds {tok}")
            filed = self.heaps[qi].members()
            bad = filed[self.q[filed] != qi]
            if len(bad):
                raise InvariantError(f"{self.name}: blocks {describe_ids(bad)} filed in queue {qi} but not in it")
            if self.track_order:
                members = np.flatnonzero(self.q == qi)
                listed = self.order[qi].members()
                if not np.array_equal(members, listed):
                    odd = np.setxor1d(members, listed)
                    raise InvariantError(f"{self.name}: queue {qi} order list disagrees on {describe_ids(odd)}")
        for h in self.heaps + self.order:
            h.check_invariants()
        for g in (getattr(self, "ghost", None), getattr(self, "b1", None), getattr(self, "b2", None)):
            if g is not None:
                g.check_invariants()
