"""The evictable-leaf index of the radix trees: a binary heap (``heapq``) with lazy deletion.

Order: a leaf is filed under the sort key it carries (``node.skey``) and a filing number, so
the front is the smallest key and, among equal keys, the leaf filed first: the order of a
``sortedcontainers.SortedKeyList`` keyed by ``skey`` (which puts an added item after the
equal ones), at a fraction of its per-call work (one C ``heappush`` / ``heappop`` and one
dict write instead of bisections of Python lists).

Deletion is lazy: ``remove`` forgets the node's filing number; its heap entry goes stale and
is dropped when it reaches the front, or by a compaction once stale entries outnumber the
live ones (so the heap holds at most about twice the filed leaves).
"""
from __future__ import annotations

from collections.abc import Iterator
from heapq import heapify, heappop, heappush
from itertools import count
from typing import Any, Generic, Protocol, TypeVar

from radixkv.errors import InvariantError

__all__ = ["Filed", "LeafIndex"]


class Filed(Protocol):
    """What the index reads of a node: the sort key it is filed under."""

    skey: Any


N = TypeVar("N", bound=Filed)  # a tree node

_SLACK = 64  # stale entries tolerated beyond the live count before a compaction


class LeafIndex(Generic[N]):
    """The unlocked, childless nodes of a tree, front = next victim. ``add`` / ``remove``
    / ``pop`` are O(log L) (amortized over compactions); ``len`` and membership O(1).
    Iteration yields the filed nodes in no particular order."""

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, N]] = []  # (skey, filing number, node)
        self._live: dict[N, int] = {}  # filed node -> the filing number of its live entry
        self._seq = count()

    def add(self, node: N) -> None:
        """File ``node`` under its ``skey``, behind the filed nodes of an equal key. Raises
        InvariantError (nothing changed) when it is filed already."""
        seq = next(self._seq)
        if self._live.setdefault(node, seq) != seq:
            raise InvariantError(f"leaf index: node {getattr(node, 'id', node)} filed twice")
        heappush(self._heap, (node.skey, seq, node))

    def remove(self, node: N) -> None:
        """Unfile ``node``. Raises KeyError when it is not filed."""
        del self._live[node]
        if len(self._heap) > 2 * len(self._live) + _SLACK:
            self._compact()

    def pop(self) -> N | None:
        """Unfile and return the front node, or ``None`` when none is filed."""
        heap, live = self._heap, self._live
        while heap:
            _, seq, node = heappop(heap)
            if live.get(node) == seq:
                del live[node]
                return node
        return None

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def _compact(self) -> None:
        live = self._live
        self._heap = [e for e in self._heap if live.get(e[2]) == e[1]]
        heapify(self._heap)  # same (key, number) pairs: the order does not change

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[N]:
        return iter(self._live)

    def __contains__(self, node: object) -> bool:
        return node in self._live

    def check_invariants(self) -> None:
        """Raise InvariantError unless the heap is ordered and every filed node has exactly
        one live entry, under the key it carries."""
        heap, live = self._heap, self._live
        bad = [i for i in range(1, len(heap)) if heap[i][:2] < heap[(i - 1) >> 1][:2]]
        if bad:
            raise InvariantError(f"leaf index: heap order broken at entries {bad[:10]}")
        entries = {e[1]: e for e in heap if live.get(e[2]) == e[1]}
        missing = [getattr(n, "id", n) for n, s in live.items() if s not in entries]
        wrong = [getattr(e[2], "id", e[2]) for e in entries.values() if e[0] != e[2].skey]
        if missing or wrong:
            raise InvariantError(f"leaf index: filed without an entry {missing[:10]}, "
                                 f"entry under a stale key {wrong[:10]}")
