"""``StateTable``: which radix-tree nodes hold a Mamba state, in which slot, and at which
token position; which nodes requests pin; the validation of slots handed to the tree; and
the audit of all that (pure bookkeeping: no state tensor is touched here, only the pool's
free mask is read).

A node's state is the recurrent state after the node's LAST token: ``end[slot]`` is that
position, counted from the start of the sequence (the node's depth in tokens). It never
changes: a split keeps the state on the lower half (same end), so a state can never be
restored at a position other than the one it was taken at.

Pins: ``pins[node]`` counts the ``inc_lock_ref(node)`` calls not yet undone *on that very
node* (the base tree's ``lock_ref`` counts locks through a node). A state is *protected*
while its node is pinned and *evictable* otherwise; a node that gains a state while pinned
is protected at once. Hence, for every node, ``lock_ref == sum of pins over its subtree``.

The LRU order of the states is kept incrementally in ``lru``, a
:class:`~radixkv.cache.state_order.StateHeap` that :meth:`StateTable.attach` /
:meth:`StateTable.detach` keep up to date (O(log S) amortized per attach, O(1) per detach);
for the ``flop`` order, ``anc`` (a :class:`~radixkv.cache.state_order.StateAncestors`) keeps
each state's nearest state ancestor position (O(tombstones around the node) per attach /
detach).

All methods are O(1) except :meth:`attach` (O(log S) amortized), :meth:`unpinned`
(O(states)), :meth:`check_slots` (O(slots) plus one pool lookup) and the audits (O(tree)).
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence

import numpy as np
import torch

from radixkv.cache import tree_audit
from radixkv.cache.state_order import StateAncestors, StateHeap
from radixkv.errors import InvalidArgumentError, InvalidIndexError, InvariantError, describe_ids

__all__ = ["StateTable", "EventStateTable", "StateConservation", "audit_slots", "check_invariants", "check_state_conservation",
           "pretty_print"]


class StateConservation(NamedTuple):
    """Where the Mamba pool's slots are. ``available + evictable + protected + held ==
    capacity`` when nothing leaks (``held``: slots of running requests)."""

    capacity: int
    available: int
    evictable: int
    protected: int
    held: int

    @property
    def accounted(self) -> int:
        return self.available + self.evictable + self.protected + self.held

    @property
    def ok(self) -> bool:
        return self.accounted == self.capacity


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

    __slots__ = ("num_slots", "slot_of", "node_of", "end", "pins", "protected", "lru", "anc")

    #: The event recorder (:class:`EventStateTable` only); ``None`` here: no event work.
    events: Optional[Any] = None

    def __init__(self, num_slots: int, track_ancestors: bool = False):
        self.num_slots = int(num_slots)
        self.end = np.zeros(self.num_slots + 1, dtype=np.int64)
        self.slot_of: Dict[Any, int] = {}
        self.node_of: List[Optional[Any]] = [None] * (self.num_slots + 1)
        self.pins: Dict[Any, int] = {}
        self.protected = 0
        self.lru = StateHeap(self.num_slots)
        self.anc = StateAncestors(self.num_slots) if track_ancestors else None

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
    def attach(self, node: Any, slot: int, end: int) -> None:
        """``node`` now holds ``slot``, the state after ``end`` tokens (the caller checked
        that neither is taken). O(log S) amortized (the LRU heap), plus with ``anc`` the
        tombstones between ``node`` and the states above and below it."""
        self.slot_of[node] = slot
        self.node_of[slot] = node
        self.end[slot] = end
        if self.anc is not None:
            self.anc.attach(node, slot, end, self.slot_of, self.end)
        if node in self.pins:
            self.protected += 1
        self.lru.push(node, slot, self.slot_of)

    def detach(self, node: Any) -> int:
        """Drop ``node``'s state; returns its slot (now the caller's to free)."""
        slot = self.slot_of.pop(node)
        self.node_of[slot] = None
        self.lru.drop(slot)
        if self.anc is not None:
            self.anc.detach(node, slot, self.slot_of)
        if node in self.pins:
            self.protected -= 1
        return slot

    def unpinned(self) -> List[Any]:
        """Nodes holding an evictable state. O(states)."""
        pins = self.pins
        return [n for n in self.slot_of if n not in pins]

    def check_slots(self, pool: Any, slots: Iterable[Any], what: str, checks: bool = True) -> List[int]:
        """``slots`` as ints, each in ``1..pool.size``, distinct, not held by the tree and,
        with ``checks``, allocated in ``pool`` (``FreeSlots.free_among``: a host read of the
        free mask on CPU). Raises ``InvalidArgumentError`` / ``InvalidIndexError`` naming
        the bad slots. O(len)."""
        size, node_of = pool.size, self.node_of
        out: List[int] = []
        for s in slots:
            if isinstance(s, torch.Tensor) and s.numel() == 1 and not s.dtype.is_floating_point:
                s = s.item()
            if s is None or isinstance(s, bool) or not isinstance(s, (int, np.integer)):
                raise InvalidArgumentError(f"{what} must be an int slot, got {s!r}")
            s = int(s)
            if not 1 <= s <= size:
                raise InvalidIndexError(f"{what} {s} out of range 1..{size}")
            if node_of[s] is not None:
                raise InvalidArgumentError(f"{what} {s} is the state of tree node {node_of[s].id}")
            out.append(s)
        if len(out) > 1 and len(set(out)) != len(out):
            raise InvalidArgumentError(f"{what} repeated: {describe_ids(out)}")
        if out and checks:
            bad = pool.free_slots.free_among(out)  # host-side mask read on CPU
            if bad:
                raise InvalidArgumentError(f"{what} not allocated in the Mamba pool: {describe_ids(bad)}")
        return out

    def check_slot(self, pool: Any, slot: Any, what: str, checks: bool = True) -> int:
        """:meth:`check_slots` for one slot (the hot path of ``insert_with_state`` and
        ``fork_state``): the same checks, errors and messages, without the list. O(1)."""
        if type(slot) is not int:
            return self.check_slots(pool, [slot], what, checks)[0]
        if not 1 <= slot <= pool.size:
            raise InvalidIndexError(f"{what} {slot} out of range 1..{pool.size}")
        node = self.node_of[slot]
        if node is not None:
            raise InvalidArgumentError(f"{what} {slot} is the state of tree node {node.id}")
        if checks and pool.free_slots.is_free_one(slot):
            raise InvalidArgumentError(f"{what} not allocated in the Mamba pool: {describe_ids([slot])}")
        return slot

    # ---------------------------------------------------------------- pins
    def pin(self, node: Any) -> None:
        c = self.pins.get(node, 0)
        self.pins[node] = c + 1
        if c == 0 and node in self.slot_of:
            self.protected += 1

    def unpin(self, node: Any) -> None:
        c = self.pins[node] - 1
        if c:
            self.pins[node] = c
        else:
            del self.pins[node]
            if node in self.slot_of:
                self.protected -= 1

    # ---------------------------------------------------------------- audit
    def check(self, heads: Iterable[Any]) -> None:
        """Raise :class:`InvariantError` naming the node ids / slots unless: every state
        and pin is on a live node (reachable from ``heads``) and never on a head; the two
        maps are inverse and no slot is held twice; every state's ``end`` is its node's
        depth; every pin count is positive and every node's ``lock_ref`` equals the sum of
        the pins in its subtree; ``protected`` counts the pinned states; the LRU heap files
        every state once, under a key ``<= last_access``, within its size bound
        (:meth:`StateHeap.check`); with ``anc``, every state's nearest state ancestor
        position is current. O(tree)."""
        depth: Dict[Any, int] = {}
        order: List[Any] = []
        stack = [(h, 0) for h in heads]
        while stack:
            node, d = stack.pop()
            for child in node.children.values():
                cd = d + (len(child.kbuf) >> 2)
                depth[child] = cd
                order.append(child)
                stack.append((child, cd))
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
        mine = {n.block_hashes[-1]: int(self.end[s]) for n, s in self.slot_of.items()}
        theirs = self.events.live_states()
        bad = sorted(h for h in mine.keys() | theirs.keys() if mine.get(h) != theirs.get(h))
        if bad:
            nodes = [n.id for n in self.slot_of if n.block_hashes[-1] in set(bad)]
            raise InvariantError(f"MambaRadixCache: the event recorder's live states differ from the "
                                 f"tree's at blocks {describe_ids(bad)} (tree nodes {describe_ids(nodes)})")
        self.events.check_invariants()


class EventStateTable(StateTable):
    """A :class:`StateTable` that reports every state gained or lost to ``events`` (a
    :class:`~radixkv.events.state_events.HybridEventRecorder`): :meth:`attach` records
    ``StateStored(node.block_hashes[-1], end)``, :meth:`detach` ``StateRemoved([node.block_hashes[-1]])``
    (before the ``BlockRemoved`` of a node that goes too), each before the table changes (the
    recorder validates before it records, so a refusal leaves both as they were). The cache
    uses it only when it records events. O(1) more per attach / detach."""

    __slots__ = ("events",)

    def __init__(self, num_slots: int, track_ancestors: bool = False, events: Any = None):
        super().__init__(num_slots, track_ancestors)
        self.events = events  # the cache sets it once its recorder exists

    def attach(self, node: Any, slot: int, end: int) -> None:
        self.events.on_state_stored(node.block_hashes[-1], end)
        StateTable.attach(self, node, slot, end)

    def detach(self, node: Any) -> int:
        self.events.on_state_removed((node.block_hashes[-1],))
        return StateTable.detach(self, node)


def audit_slots(pool: Any, tree_slots: Dict[int, Any], held_slots: Dict[int, Any],
                evictable: int, protected: int) -> StateConservation:
    """The Mamba slot conservation law, exact: every slot ``1..size`` is exactly one of free
    in ``pool``, held by the tree (``tree_slots``: slot -> node) or held by a running
    request (``held_slots``: slot -> request id). Raises :class:`InvariantError` naming the
    leaked, doubly-owned and freed-but-referenced slots. O(size), vectorized."""
    size = int(pool.size)
    free = pool.free_slots.is_free(torch.arange(1, size + 1, device=pool.device)).cpu().numpy()
    count = np.zeros(size + 1, dtype=np.int64)
    tree = np.fromiter(tree_slots, dtype=np.int64, count=len(tree_slots))
    held = np.fromiter(held_slots, dtype=np.int64, count=len(held_slots))
    for arr in (tree, held):
        oob = arr[(arr < 1) | (arr > size)]
        if oob.size:
            raise InvariantError(f"Mamba slots outside 1..{size} referenced: {describe_ids(oob.tolist())}")
        np.add.at(count, arr, 1)
    count = count[1:]
    slots = np.arange(1, size + 1)
    for what, mask in (
        ("owned twice among tree / running requests (duplicated)", count > 1),
        ("allocated but owned by neither the tree nor a request (leaked)", ~free & (count == 0)),
        ("free in the pool but still referenced (double-freed)", free & (count > 0)),
    ):
        if mask.any():
            bad = slots[mask].tolist()
            who = [f"node {tree_slots[s].id}" for s in bad[:4] if s in tree_slots] + \
                  [f"request {held_slots[s]!r}" for s in bad[:4] if s in held_slots]
            raise InvariantError(f"Mamba slots {what}: {describe_ids(bad)}"
                                 + (f" ({', '.join(who)})" if who else ""))
    c = StateConservation(size, int(free.sum()), evictable, protected, len(held_slots))
    if not c.ok:
        raise InvariantError(f"Mamba slots not conserved: available {c.available} + evictable {c.evictable} "
                             f"+ protected {c.protected} + held {c.held} = {c.accounted} != {size}")
    return c


# ----------------------------------------------------------------------------- audit
# Bound as MambaRadixCache methods (check_invariants, check_state_conservation, pretty_print).
def check_invariants(cache, running_reqs: Optional[Sequence[Any]] = None) -> None:
    """RadixCache's audit (no KV row held twice or free in the allocator), the state
    table's (states on live nodes at their nodes' ends, maps inverse, pins consistent with
    every ``lock_ref``), and both conservation laws: Mamba slots
    (:meth:`check_state_conservation`) and, given ``running_reqs`` (every request holding
    a row) and a request pool and allocator, KV slots (allocator available + tree evictable
    + tree protected + held by the requests == pool size, audited page by page:
    ``radixkv.scheduler.flow.check_conservation``). Raises ``InvariantError`` naming ids."""
    tree_audit.check_invariants(cache)
    cache._states.check(cache._heads.values())
    if running_reqs is not None and cache.token_to_kv_pool_allocator is not None \
            and cache.req_to_token_pool is not None:
        from radixkv.scheduler.flow import check_conservation  # the flow owns the KV audit

        check_conservation(cache.token_to_kv_pool_allocator, cache, list(running_reqs))  # + slots
    else:
        cache.check_state_conservation(running_reqs)


def check_state_conservation(cache, running_reqs: Optional[Sequence[Any]] = None) -> StateConservation:
    """Mamba pool available + tree evictable + tree protected + held by running requests
    == capacity, exactly (no slot leaked, owned twice, or free while referenced).
    ``running_reqs``: every request holding a slot; default: the slots the request pool
    maps to rows in use. O(pool size). Raises ``InvariantError``."""
    tree = {s: n for n, s in cache._states.slot_of.items()}
    if running_reqs is not None:
        held = {}
        for r in running_reqs:
            if r.mamba_pool_idx is not None:
                s = int(r.mamba_pool_idx)
                if s in held:
                    raise InvariantError(f"Mamba slot {s} held by two running requests "
                                         f"(duplicated): {held[s]!r} and {r.rid!r}")
                held[s] = r.rid
    else:
        held = _mapped_slots(cache)
    return audit_slots(cache.mamba_pool, tree, held, cache._states.evictable, cache._states.protected)


def _mapped_slots(cache) -> dict:
    pool = cache.req_to_token_pool
    mapping = getattr(pool, "req_index_to_mamba_index_mapping", None)
    if mapping is None:
        return {}
    rows = torch.arange(1, pool.size + 1)
    used = ~pool.free_slots.is_free(rows).cpu()
    slots = mapping.cpu()[1:][used].tolist()
    return {int(s): f"row {int(r)}" for s, r in zip(slots, rows[used].tolist())}


def pretty_print(cache, max_tokens: int = 8) -> str:
    """RadixCache's print, each node's state slot (``-`` for a tombstone), the counts."""
    lines = tree_audit.pretty_print(cache, max_tokens).split("\n")
    by_id = {n.id: s for n, s in cache._states.slot_of.items()}
    for i, line in enumerate(lines):
        head = line.lstrip()
        if head.startswith("#") and " len=" in head:
            nid = int(head[1:head.index(" ")])
            lines[i] = f"{line} state={by_id.get(nid, '-')}"
    lines.append(f"#states: {len(cache._states)} (evictable {cache.mamba_evictable_size()}, "
                 f"protected {cache.mamba_protected_size()})")
    return "\n".join(lines)
