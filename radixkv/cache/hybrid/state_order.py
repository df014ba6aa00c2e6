"""What the state eviction orders of a
:class:`~radixkv.cache.hybrid.mamba_radix_cache.MambaRadixCache` keep up to date as states come and
go (pure bookkeeping): ``StateHeap`` and ``StateAncestors``.

``StateHeap``: the ``lru`` order (lowest ``last_access``, ties in attach order) as a lazy
min-heap, the same victims as a stable sort in O(log S) amortized per victim, nothing on the
match path. Keys only rise, so a filed key is a lower bound: :meth:`StateHeap.pop_victims`
drops dead entries, re-files stale ones, sets pinned ones aside. :meth:`StateHeap.compact`
rebuilds past ``2 x states + 64`` entries. Invariants (:meth:`StateHeap.check`): one live
entry per state under a key ``<= last_access``; ``seq_at`` 0 exactly on stateless slots.

``StateAncestors.above[slot]``: the end of the nearest state strictly above (the ``flop``
order's marginal utility); attach / detach cost O(tombstones crossed). Why each step is
right: ``docs/internals.md``, "The incremental state orders".
"""
from __future__ import annotations

from collections.abc import Sequence
from heapq import heapify, heappop, heappush, heapreplace
from typing import TYPE_CHECKING, Any

import numpy as np

from radixkv.errors import InvariantError, describe_ids

if TYPE_CHECKING:
    from radixkv.cache.tree_node import TreeNode

__all__ = ["StateHeap", "StateAncestors", "COMPACT_SLACK"]

COMPACT_SLACK = 64  # the heap is rebuilt once it holds more than 2 x states + COMPACT_SLACK entries


class StateHeap:
    """Lazy min-heap of ``(last_access, seq, slot, node)`` over the states of a tree.

    ``heap`` (the entries), ``seq_at`` (per slot, the ``seq`` of its live attach, 0: free),
    ``next_seq`` (the last ``seq`` handed out). Keys ``(last_access, seq)`` are unique, so
    entries never compare their slots or nodes.
    """

    __slots__ = ("heap", "seq_at", "next_seq")

    def __init__(self, num_slots: int):
        self.heap: list[tuple[int, int, int, TreeNode]] = []  # (last_access, seq, slot, node)
        self.seq_at: list[int] = [0] * (int(num_slots) + 1)
        self.next_seq = 0

    def clear(self) -> None:
        """Forget every entry (``seq`` keeps growing: keys stay unique). O(slots)."""
        self.heap.clear()
        self.seq_at[:] = [0] * len(self.seq_at)

    def push(self, node: TreeNode, slot: int, live: dict[TreeNode, int]) -> None:
        """``node`` just got ``slot`` (``live``: node -> slot, ``node`` included). O(log S)
        amortized (a rebuild when the heap outgrew its bound)."""
        self.next_seq += 1
        self.seq_at[slot] = seq = self.next_seq
        heap = self.heap
        if len(heap) >= 2 * len(live) + COMPACT_SLACK:
            self.compact(live)  # files ``node`` with the others
        else:
            heappush(heap, (node.last_access, seq, slot, node))

    def drop(self, slot: int) -> None:
        """The state in ``slot`` left the tree: its entry is dead from now on. O(1)."""
        self.seq_at[slot] = 0

    def compact(self, live: dict[TreeNode, int]) -> None:
        """Rebuild the heap from the live states (node -> slot), one entry each, keyed by
        their current ``last_access``. O(S)."""
        seq_at = self.seq_at
        heap = [(n.last_access, seq_at[s], s, n) for n, s in live.items()]
        heapify(heap)
        self.heap = heap

    def maybe_compact(self, live: dict[TreeNode, int]) -> None:
        """:meth:`compact` when the heap holds more than ``2 x states + 64`` entries. O(1)
        unless it rebuilds."""
        if len(self.heap) > 2 * len(live) + COMPACT_SLACK:
            self.compact(live)

    def pop_victims(self, k: int, pins: dict[TreeNode, int]) -> list[TreeNode]:
        """Remove and return the first ``k`` unpinned states of the order (fewer when fewer
        are unpinned), first victim first; the caller detaches them. Pinned states keep their
        entries. O((k + stale + pinned entries met) x log S)."""
        heap, seq_at = self.heap, self.seq_at
        out: list[TreeNode] = []
        aside = []
        while len(out) < k and heap:
            entry = heap[0]
            key, seq, slot, node = entry
            if seq_at[slot] != seq:  # detached (or re-attached since): a dead entry
                heappop(heap)
            elif node.last_access != key:  # touched since filed: re-file under its key
                heapreplace(heap, (node.last_access, seq, slot, node))
            elif node in pins:
                aside.append(heappop(heap))
            else:
                heappop(heap)
                out.append(node)
        for entry in aside:
            heappush(heap, entry)
        return out

    # ---------------------------------------------------------------- audit
    def check(self, live: dict[TreeNode, int], node_of: Sequence[TreeNode | None]) -> None:
        """Raise :class:`InvariantError` naming the node ids / slots unless the invariants
        of the module docstring hold (``live``: node -> slot; ``node_of``: slot -> node).
        O(heap + slots)."""
        seq_at = self.seq_at
        filed: dict[int, int] = {}
        wrong_node, ahead = [], []
        for key, seq, slot, node in self.heap:
            if seq_at[slot] != seq:
                continue
            filed[slot] = filed.get(slot, 0) + 1
            if node_of[slot] is not node:
                wrong_node.append(slot)
            elif key > node.last_access:
                ahead.append(node.id)
        if wrong_node:
            raise InvariantError(f"StateHeap: live entries naming another node than their slot's: "
                                 f"slots {describe_ids(wrong_node)}")
        if ahead:
            raise InvariantError(f"StateHeap: entries filed under a key above their node's last_access "
                                 f"(would evict out of order): nodes {describe_ids(ahead)}")
        missing = [n.id for n, s in live.items() if seq_at[s] == 0 or filed.get(s, 0) == 0]
        if missing:
            raise InvariantError(f"StateHeap: states with no entry in the LRU heap (never evictable "
                                 f"by it): nodes {describe_ids(missing)}")
        twice = [n.id for s, c in filed.items() if c > 1 and (n := node_of[s]) is not None]  # never None: wrong_node
        if twice:
            raise InvariantError(f"StateHeap: states filed twice in the LRU heap (duplicated): "
                                 f"nodes {describe_ids(twice)}")
        held = set(live.values())
        stray = [s for s, q in enumerate(seq_at) if q and s not in held]
        if stray:
            raise InvariantError(f"StateHeap: attach marks on slots no state holds (leaked): "
                                 f"slots {describe_ids(stray)}")
        bound = 2 * len(live) + COMPACT_SLACK
        if len(self.heap) > bound:
            raise InvariantError(f"StateHeap: {len(self.heap)} entries for {len(live)} states "
                                 f"(bound {bound}): never compacted")


class StateAncestors:
    """``above`` (int64 per slot, slot 0 unused): for each slot holding a state, the end of
    the nearest state strictly above it, 0 when there is none. Kept by ``StateTable`` when
    its eviction order needs it (``flop``); see the module docstring."""

    __slots__ = ("above",)

    def __init__(self, num_slots: int):
        self.above = np.zeros(int(num_slots) + 1, dtype=np.int64)

    def clear(self) -> None:
        self.above[:] = 0

    @staticmethod
    def _frontier(node: TreeNode, live: dict[TreeNode, int]) -> list[int]:
        """Slots of the states below ``node`` with only tombstones in between."""
        out: list[int] = []
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            s = live.get(n)
            if s is None:
                stack.extend(n.children.values())
            else:
                out.append(s)
        return out

    def attach(self, node: TreeNode, slot: int, end: int, live: dict[TreeNode, int], ends: np.ndarray) -> None:
        """``node`` got the state ``slot`` at ``end`` (already in ``live``: node -> slot;
        ``ends``: end per slot). O(tombstones above and below up to the nearest states)."""
        p: Any = node.parent  # a TreeNode (a NamespaceHead at the top, never None): a state node is no head
        while p.parent is not None and p not in live:
            p = p.parent
        self.above[slot] = 0 if p.parent is None else ends[live[p]]
        below = self._frontier(node, live)
        if below:
            self.above[below] = end

    def detach(self, node: TreeNode, slot: int, live: dict[TreeNode, int]) -> None:
        """``node`` lost the state ``slot``: the states just below it now see the one above
        it. O(tombstones below up to the nearest states)."""
        if node.children:
            below = self._frontier(node, live)
            if below:
                self.above[below] = self.above[slot]

    def check(self, live: dict[TreeNode, int], ends: np.ndarray, nodes: Sequence[TreeNode]) -> None:
        """Raise :class:`InvariantError` naming the state nodes whose ``above`` is not the
        end of their nearest state ancestor (``nodes``: every real node, parents first). O(tree)."""
        near: dict[TreeNode, int] = {}
        wrong = []
        for n in nodes:
            p: Any = n.parent  # a TreeNode or NamespaceHead: ``nodes`` holds no heads
            e = 0 if p.parent is None else (int(ends[live[p]]) if p in live else near[p])
            near[n] = e
            s = live.get(n)
            if s is not None and int(self.above[s]) != e:
                wrong.append(n.id)
        if wrong:
            raise InvariantError(f"StateAncestors: nearest state ancestor position out of date: "
                                 f"nodes {describe_ids(wrong)}")
