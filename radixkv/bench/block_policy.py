"""The eviction-policy side of :mod:`radixkv.bench.blocksim`: the callback interface
(:class:`BlockPolicy`), the lazily invalidated heap of evictable leaves (:class:`LeafHeap`),
sort-key policies (:class:`KeyPolicy`) and :class:`TreePolicy`, which runs the RadixCache's own
policy objects (lru, lfu, fifo, filo, mru, priority) on blocks: one family of policies for
the tree and the simulator. Block-level research policies (queue baselines, history
policies) build on these classes in ``benchmarks/policy_research``. The simulator itself
(which blocks are cached, the protected path, the replay loop) is
:mod:`radixkv.bench.blocksim`.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Any

import numpy as np

from radixkv.cache.policies.base import EvictionPolicy
from radixkv.errors import InvalidArgumentError, InvariantError, describe_ids

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.bench.blocksim import BlockSim

__all__ = ["LeafHeap", "BlockPolicy", "KeyPolicy", "BlockNode", "TreePolicy", "runs_on_blocks", "grow_array"]

#: A leaf's sort key: any comparable value (a policy's ``EvictionPolicy.sort_key``, typed
#: ``Any`` there for the same reason: numbers, tuples, whatever orders the policy's leaves).
SortKey = Any


def grow_array(a: np.ndarray, n: int, fill: float = 0) -> np.ndarray:
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
        self._heap: list[tuple[SortKey, int, int]] = []
        self._stamp = np.zeros(n_blocks, dtype=np.int64)
        self._seq = 0
        self.live = 0

    def grow(self, n_blocks: int) -> None:
        if n_blocks > len(self._stamp):
            self._stamp = np.concatenate([self._stamp, np.zeros(n_blocks - len(self._stamp), np.int64)])

    def __contains__(self, b: int) -> bool:
        return bool(self._stamp[b])

    def file(self, b: int, key: SortKey) -> None:
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

    def peek_key(self) -> SortKey | None:
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

    def attach(self, sim: BlockSim) -> None:
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

    def attach(self, sim: BlockSim) -> None:
        super().attach(sim)
        self.leaves = LeafHeap(sim.n_blocks)

    def grow(self, n_blocks: int) -> None:
        self.leaves.grow(n_blocks)

    def key(self, b: int) -> SortKey:
        raise NotImplementedError

    def leaf_added(self, b: int) -> None:
        self.leaves.file(b, self.key(b))

    def leaf_removed(self, b: int) -> None:
        self.leaves.unfile(b)

    def victim(self) -> int:
        return self.leaves.peek()

    def on_evict(self, b: int) -> None:
        self.leaves.unfile(b)

    def evictable(self) -> np.ndarray:
        return self.leaves.members()

    def check_invariants(self) -> None:
        self.leaves.check_invariants()


# ---------------------------------------------------------------------- the tree's policies
#: The hooks a policy object may override; one that overrides none is a pure sort key.
_HOOKS = ("on_insert", "on_hit", "on_split", "on_evict", "bind", "reset", "check_invariants")


def runs_on_blocks(policy: EvictionPolicy) -> bool:
    """True when ``policy`` orders leaves by ``sort_key`` alone (it overrides none of the
    hooks), so that the simulator can run it on blocks exactly as the tree runs it on nodes."""
    return all(getattr(type(policy), h) is getattr(EvictionPolicy, h) for h in _HOOKS)


class BlockNode:
    """One block as a RadixCache policy sees a node: the fields the tree keeps for every
    policy. :class:`TreePolicy` refills one instance per filing (no object per block)."""

    __slots__ = ("last_access", "created", "hits", "priority")

    def __init__(self) -> None:
        self.last_access = self.created = self.hits = self.priority = 0


class TreePolicy(KeyPolicy):
    """A RadixCache policy object (:class:`~radixkv.cache.policies.base.EvictionPolicy`) run
    by the simulator: a block is filed under ``policy.sort_key(node)``, ``node`` holding the
    block's fields as the tree keeps them, in request-index ticks (``last_access``, ``created``,
    ``hits``; ``priority`` 0).

    Only pure sort-key policies run here (:func:`runs_on_blocks`); others need the tree
    (``--engine radix``). A block's fields change only while it is on the current request's
    path, where it is not a filed leaf, so the key frozen at filing is current.

    Raises (constructor): InvalidArgumentError for a policy with hooks.
    """

    def __init__(self, policy: EvictionPolicy):
        if not runs_on_blocks(policy):
            raise InvalidArgumentError(
                f"eviction policy {policy.name!r} keeps per-node state in hooks and runs on the "
                f"tree only (--engine radix); its block-level research variant runs with "
                f"benchmarks/bench_policies.py of a source checkout")
        self.policy = policy
        self.name = policy.name
        self._node = BlockNode()

    def attach(self, sim: BlockSim) -> None:
        super().attach(sim)
        n = sim.n_blocks
        self.last = np.zeros(n, dtype=np.int64)
        self.created = np.zeros(n, dtype=np.int64)
        self.hits = np.zeros(n, dtype=np.int64)

    def grow(self, n: int) -> None:
        super().grow(n)
        self.last, self.created, self.hits = (grow_array(a, n) for a in (self.last, self.created, self.hits))

    def on_hit(self, ids: np.ndarray) -> None:
        self.last[ids] = self.sim.now
        self.hits[ids] += 1

    def on_insert(self, ids: np.ndarray) -> None:
        self.last[ids] = self.created[ids] = self.sim.now
        self.hits[ids] = 0

    def key(self, b: int) -> SortKey:
        node = self._node
        node.last_access = int(self.last[b])
        node.created = int(self.created[b])
        node.hits = int(self.hits[b])
        return self.policy.sort_key(node)
