"""``StateTable``: which radix-tree nodes hold a Mamba state, in which slot, and at which
token position; which nodes requests pin; the validation of slots handed to the tree; and
the table's own audit (pure bookkeeping: only the pool's free mask is read).

``end[slot]``: the position after the node's LAST token; it never changes (a split keeps the
state on the lower half). ``pins[node]`` counts locks taken on that very node, so ``lock_ref
== sum of pins over the subtree``; a state is protected while its node is pinned. ``lru``
(:class:`~radixkv.cache.hybrid.state_order.StateHeap`) and ``anc``
(:class:`~radixkv.cache.hybrid.state_order.StateAncestors`) are kept up to date by attach / detach.

All methods are O(1) except :meth:`attach` (O(log S) amortized), :meth:`unpinned`
(O(states)), :meth:`check_slots` (O(slots) plus one pool lookup) and the audits (O(tree)).
The hybrid audit is :mod:`radixkv.cache.hybrid.mamba_audit`; why: ``docs/internals.md``, "The state table".
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.cache.hybrid.state_order import StateAncestors, StateHeap
from radixkv.errors import InvalidArgumentError, InvalidIndexError, InvariantError, describe_ids

if TYPE_CHECKING:
    from radixkv.cache.hybrid.state_events import HybridEventRecorder
    from radixkv.cache.tree_node import TreeNode
    from radixkv.contracts import StatePool

__all__ = ["StateTable", "EventStateTable", "node_depths"]


def node_depths(heads: Iterable[TreeNode]) -> tuple[dict[TreeNode, int], list[TreeNode]]:
    """Every node below ``heads`` -> the position after its last token, and the nodes in an
    order where each comes after its parent (for the audits). O(tree)."""
    depth: dict[TreeNode, int] = {}
    order: list[TreeNode] = []
    stack = [(h, 0) for h in heads]
    while stack:
        node, d = stack.pop()
        for child in node.children.values():
            cd = d + (len(child.kbuf) >> 2)
            depth[child] = cd
            order.append(child)
            stack.append((child, cd))
    return depth, order


class StateTable:
    """Node <-> slot maps of the states a tree holds, their positions, and the pins.

    Attributes (read-only outside the cache): ``slot_of`` (node -> slot), ``node_of`` (slot
    -> node or ``None``, ``num_slots + 1`` entries, slot 0 unused), ``end`` (int64 per slot),
    ``pins`` (node -> count > 0), ``protected`` (states on pinned nodes), ``lru`` (the
    :class:`StateHeap` of the states' LRU order; ``slot_of``'s order is the attach order),
    ``anc`` (with ``track_ancestors``, the :class:`StateAncestors` of the ``flop`` order:
    each state's nearest state ancestor position; else ``None``). A cache that records
    events uses :class:`EventStateTable` instead, so this one does no event work at all.
    """

    __slots__ = ("num_slots", "slot_of", "node_of", "end", "pins", "protected", "lru", "anc", "free_host")

    #: The event recorder (:class:`EventStateTable` only); ``None`` here: no event work.
    events: HybridEventRecorder | None = None

    def __init__(self, num_slots: int, track_ancestors: bool = False):
        self.num_slots = int(num_slots)
        self.end = np.zeros(self.num_slots + 1, dtype=np.int64)
        self.slot_of: dict[TreeNode, int] = {}
        self.node_of: list[TreeNode | None] = [None] * (self.num_slots + 1)
        self.pins: dict[TreeNode, int] = {}
        self.protected = 0
        self.lru = StateHeap(self.num_slots)
        self.anc = StateAncestors(self.num_slots) if track_ancestors else None
        #: the pool's slot free mask as a numpy view (:meth:`bind_pool`), else ``None``
        self.free_host: np.ndarray | None = None

    def bind_pool(self, pool: StatePool) -> None:
        """Keep the numpy view of ``pool``'s slot free mask when its free list has one (a
        ``FreeSlots`` on CPU keeps it: the mask is allocated once and only written in
        place, so the view stays current), for :meth:`check_slot` and the cache's own
        inlined check: one array read instead of three Python calls."""
        get = getattr(pool.free_slots, "_host_mask", None)
        view = get() if callable(get) else None
        ok = isinstance(view, np.ndarray) and view.dtype == np.bool_ and view.shape == (self.num_slots + 1,)
        self.free_host = view if ok else None

    def clear(self) -> None:
        """Forget every state and pin (the caller frees the slots). In place: the maps stay
        the same objects, so bound lookups of them stay valid."""
        self.slot_of.clear()
        self.node_of[:] = [None] * (self.num_slots + 1)
        self.end[:] = 0
        self.pins.clear()
        self.protected = 0
        self.lru.clear()
        if self.anc is not None:
            self.anc.clear()

    # ---------------------------------------------------------------- counts
    def __len__(self) -> int:
        return len(self.slot_of)

    @property
    def evictable(self) -> int:
        return len(self.slot_of) - self.protected

    # ---------------------------------------------------------------- states
    def attach(self, node: TreeNode, slot: int, end: int) -> None:
        """``node`` now holds ``slot``, the state after ``end`` tokens (the caller checked
        that neither is taken). O(log S) amortized (the LRU heap), plus with ``anc`` the
        tombstones between ``node`` and the states above and below it."""
        slot_of = self.slot_of
        slot_of[node] = slot
        self.node_of[slot] = node
        self.end[slot] = end
        if self.anc is not None:
            self.anc.attach(node, slot, end, slot_of, self.end)
        if node in self.pins:
            self.protected += 1
        self.lru.push(node, slot, slot_of)

    def detach(self, node: TreeNode) -> int:
        """Drop ``node``'s state; returns its slot (now the caller's to free)."""
        slot = self.slot_of.pop(node)
        self.node_of[slot] = None
        self.lru.drop(slot)
        if self.anc is not None:
            self.anc.detach(node, slot, self.slot_of)
        if node in self.pins:
            self.protected -= 1
        return slot

    def unpinned(self) -> list[TreeNode]:
        """Nodes holding an evictable state. O(states)."""
        pins = self.pins
        return [n for n in self.slot_of if n not in pins]

    def check_slots(self, pool: StatePool, slots: Iterable[object], what: str, checks: bool = True) -> list[int]:
        """``slots`` as ints, each in ``1..pool.size``, distinct, not held by the tree and,
        with ``checks``, allocated in ``pool`` (``FreeSlots.free_among``: a host read of the
        free mask on CPU). Raises ``InvalidArgumentError`` / ``InvalidIndexError`` naming
        the bad slots. O(len)."""
        size, node_of = pool.size, self.node_of
        out: list[int] = []
        for s in slots:
            if isinstance(s, torch.Tensor) and s.numel() == 1 and not s.dtype.is_floating_point:
                s = s.item()
            if s is None or isinstance(s, bool) or not isinstance(s, (int, np.integer)):
                raise InvalidArgumentError(f"{what} must be an int slot, got {s!r}")
            s = int(s)
            if not 1 <= s <= size:
                raise InvalidIndexError(f"{what} {s} out of range 1..{size}")
            held = node_of[s]
            if held is not None:
                raise InvalidArgumentError(f"{what} {s} is the state of tree node {held.id}")
            out.append(s)
        if len(out) > 1 and len(set(out)) != len(out):
            raise InvalidArgumentError(f"{what} repeated: {describe_ids(out)}")
        if out and checks:
            bad = pool.free_slots.free_among(out)  # host-side mask read on CPU
            if bad:
                raise InvalidArgumentError(f"{what} not allocated in the Mamba pool: {describe_ids(bad)}")
        return out

    def check_slot(self, pool: StatePool, slot: object, what: str, checks: bool = True) -> int:
        """:meth:`check_slots` for one slot (the hot path of ``insert_with_state`` and
        ``fork_state``): the same checks, errors and messages, without the list; the free
        test reads the mask kept by :meth:`bind_pool` (``pool`` must be that pool) when
        there is one. O(1)."""
        if type(slot) is not int:
            return self.check_slots(pool, [slot], what, checks)[0]
        if not 1 <= slot <= pool.size:
            raise InvalidIndexError(f"{what} {slot} out of range 1..{pool.size}")
        node = self.node_of[slot]
        if node is not None:
            raise InvalidArgumentError(f"{what} {slot} is the state of tree node {node.id}")
        if checks and (pool.free_slots.is_free_one(slot) if (host := self.free_host) is None else host[slot]):
            raise InvalidArgumentError(f"{what} not allocated in the Mamba pool: {describe_ids([slot])}")
        return slot

    # ---------------------------------------------------------------- pins
    def pin(self, node: TreeNode) -> None:
        c = self.pins.get(node, 0)
        self.pins[node] = c + 1
        if c == 0 and node in self.slot_of:
            self.protected += 1

    def unpin(self, node: TreeNode) -> None:
        c = self.pins[node] - 1
        if c:
            self.pins[node] = c
        else:
            del self.pins[node]
            if node in self.slot_of:
                self.protected -= 1

    # ---------------------------------------------------------------- audit
    def check(self, heads: Iterable[TreeNode]) -> None:
        """Raise :class:`InvariantError` naming the node ids / slots unless: every state
        and pin is on a live node (reachable from ``heads``) and never on a head; the two
        maps are inverse and no slot is held twice; every state's ``end`` is its node's
        depth; every pin count is positive and every node's ``lock_ref`` equals the sum of
        the pins in its subtree; ``protected`` counts the pinned states; the LRU heap files
        every state once, under a key ``<= last_access``, within its size bound
        (:meth:`StateHeap.check`); with ``anc``, every state's nearest state ancestor
        position is current. O(tree)."""
        depth, order = node_depths(heads)
        dead = [n.id for n in self.slot_of if n not in depth]
        if dead:
            raise InvariantError(f"MambaRadixCache: states held by nodes not in the tree (leaked): "
                                 f"nodes {describe_ids(dead)}")
        back = [s for n, s in self.slot_of.items() if not 1 <= s <= self.num_slots or self.node_of[s] is not n]
        mapped = [s for s, n in enumerate(self.node_of) if n is not None and self.slot_of.get(n) != s]
        if back or mapped:
            raise InvariantError(f"MambaRadixCache: state slots held twice or mis-mapped (duplicated): "
                                 f"slots {describe_ids(set(back) | set(mapped))}")
        wrong = [n.id for n, s in self.slot_of.items() if int(self.end[s]) != depth[n]]
        if wrong:
            raise InvariantError(f"MambaRadixCache: states recorded at a position other than their "
                                 f"node's end: nodes {describe_ids(wrong)}")
        bad_pins = [n.id for n, c in self.pins.items() if n not in depth or c < 1]
        if bad_pins:
            raise InvariantError(f"MambaRadixCache: pins on dead nodes or non-positive: nodes "
                                 f"{describe_ids(bad_pins)}")
        sub = {n: self.pins.get(n, 0) for n in order}
        for n in reversed(order):  # children come after their parent in ``order``
            p = n.parent
            if p in sub:
                sub[p] += sub[n]
        off = [n.id for n in order if n.lock_ref != sub[n]]
        if off:
            raise InvariantError(f"MambaRadixCache: lock_ref differs from the pins below the node "
                                 f"(a lock taken or released around the cache): nodes {describe_ids(off)}")
        prot = sum(1 for n in self.slot_of if n in self.pins)
        if prot != self.protected:
            raise InvariantError(f"MambaRadixCache: protected state count {self.protected} != "
                                 f"{prot} pinned states")
        self.lru.check(self.slot_of, self.node_of)
        if self.anc is not None:
            self.anc.check(self.slot_of, self.end, order)
        if self.events is not None:
            self._check_events()

    def _check_events(self) -> None:
        """The recorder's live states are exactly the table's: block hash of each state
        node's last page -> its end."""
        slot_of: dict[Any, int] = self.slot_of  # TreeNodes whose block_hashes are set (events on)
        mine = {n.block_hashes[-1]: int(self.end[s]) for n, s in slot_of.items()}
        rec = self.events
        if rec is None:
            return
        theirs = rec.live_states(rec.medium)
        bad = sorted(h for h in mine.keys() | theirs.keys() if mine.get(h) != theirs.get(h))
        if bad:
            nodes = [n.id for n in slot_of if n.block_hashes[-1] in set(bad)]
            raise InvariantError(f"MambaRadixCache: the event recorder's live states differ from the "
                                 f"tree's at blocks {describe_ids(bad)} (tree nodes {describe_ids(nodes)})")
        rec.check_invariants()


class EventStateTable(StateTable):
    """A :class:`StateTable` that reports every state gained or lost to ``events`` (a
    :class:`~radixkv.cache.hybrid.state_events.HybridEventRecorder`): :meth:`attach` records
    ``StateStored(node.block_hashes[-1], end)``, :meth:`detach` ``StateRemoved([node.block_hashes[-1]])``
    (before the ``BlockRemoved`` of a node that goes too), each before the table changes (the
    recorder validates before it records, so a refusal leaves both as they were). The cache
    uses it only when it records events. O(1) more per attach / detach."""

    __slots__ = ("events",)
    events: HybridEventRecorder  # set by the cache right after construction

    def __init__(self, num_slots: int, track_ancestors: bool = False,
                 events: HybridEventRecorder | None = None):
        super().__init__(num_slots, track_ancestors)
        self.events = events  # type: ignore[assignment]  # None until the cache sets its recorder

    # ``node: Any``: a TreeNode whose ``block_hashes`` are set (the cache records events)
    def attach(self, node: Any, slot: int, end: int) -> None:
        self.events.on_state_stored(node.block_hashes[-1], end)
        StateTable.attach(self, node, slot, end)

    def detach(self, node: Any) -> int:
        self.events.on_state_removed((node.block_hashes[-1],))
        return StateTable.detach(self, node)
