"""``HostStateTable``: which tree nodes hold their Mamba state in the host tier, in which host
slot, at which position (pure bookkeeping; the copies are
:class:`~radixkv.memory.host_state_pool.HostStatePool`'s).

A node holds its state in at most one tier: a demoted state leaves its device slot, a loaded one
gives up its host slot (the tiers hold their sum). Host slots come from a
:class:`~radixkv.allocator.host_pages.HostPageAllocator` (ids ``1..num_slots``). A full table
drops its oldest demoted state to make room (insertion order of ``slot_of``; a node's KV stays).
With ``events`` (the tree's recorder) every host state gained or lost is a ``StateStored`` /
``StateRemoved`` on ``CPU``, recorded before the table changes.
All methods O(1) but :meth:`clear` (O(states)) and :meth:`check` (O(tree)).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radixkv.allocator.host_pages import HostPageAllocator
from radixkv.cache.kv_events import MEDIUM_CPU
from radixkv.errors import InvariantError, describe_ids

if TYPE_CHECKING:
    from radixkv.cache.hybrid.state_events import HybridEventRecorder
    from radixkv.cache.tree_node import TreeNode

__all__ = ["HostStateTable"]


class HostStateTable:
    """Node -> host slot map (oldest demotion first), each slot's ``end`` position, the free
    slots, and counters (``demoted``, ``loaded``, ``dropped`` states; ``hits``: matches whose
    hit ended at a host state, ``hit_tokens``: their tokens past the device state hit).
    ``events``: the tree's recorder or ``None``."""

    def __init__(self, num_slots: int, events: HybridEventRecorder | None = None) -> None:
        self.alloc = HostPageAllocator(num_slots)
        self.num_slots = num_slots
        self.events = events
        self.slot_of: dict[TreeNode, int] = {}
        self.end = np.zeros(num_slots + 1, dtype=np.int64)
        self.stats = {"demoted": 0, "loaded": 0, "dropped": 0, "hits": 0, "hit_tokens": 0}

    def __len__(self) -> int:
        return len(self.slot_of)

    def has_room(self) -> bool:
        """Whether :meth:`demote` can place a state: a slot is free or a state can be dropped
        (not so while a load holds the only slots, :meth:`take`)."""
        return bool(self.slot_of) or self.alloc.available_size() > 0

    def demote(self, node: TreeNode, end: int) -> tuple[int, TreeNode | None]:
        """A host slot for ``node``'s state at ``end`` (the caller copies it in), dropping
        the oldest host state when none is free; returns the slot and the node whose host
        state was dropped (or ``None``)."""
        if self.events is not None:  # validated before anything changes
            self.events.on_state_stored(_last_hash(node), end, MEDIUM_CPU)
        got = self.alloc.alloc(1)
        gone = None
        if got is None:
            gone = next(iter(self.slot_of))
            self.drop(gone)
            got = self.alloc.alloc(1)
        if got is None:  # unreachable: one was just freed (num_slots >= 1)
            raise InvariantError("host state slots: none free after dropping the oldest state")
        slot = int(got[0])
        self.slot_of[node] = slot
        self.end[slot] = end
        self.stats["demoted"] += 1
        return slot, gone

    def take(self, node: TreeNode) -> tuple[int, int]:
        """Remove ``node`` from the table, keeping its slot allocated (a load in progress:
        nothing can drop or reuse it); returns ``(slot, end)`` for :meth:`put` or :meth:`release`."""
        slot = self.slot_of.pop(node)
        return slot, int(self.end[slot])

    def put(self, node: TreeNode, slot: int, end: int) -> None:
        """Undo :meth:`take` (a load that found no device slot)."""
        self.slot_of[node] = slot
        self.end[slot] = end

    def release(self, node: TreeNode, slot: int) -> None:
        """Free the slot :meth:`take` took for ``node`` (its state now on the device)."""
        if self.events is not None:
            self.events.on_state_removed((_last_hash(node),), MEDIUM_CPU)
        self.alloc.free(np.array([slot], dtype=np.int32))
        self.stats["loaded"] += 1

    def drop(self, node: TreeNode) -> None:
        """Forget ``node``'s host state and free its slot."""
        if self.events is not None:
            self.events.on_state_removed((_last_hash(node),), MEDIUM_CPU)
        slot = self.slot_of.pop(node)
        self.alloc.free(np.array([slot], dtype=np.int32))
        self.stats["dropped"] += 1

    def clear(self) -> None:
        """Forget every host state, freeing the slots (no events: the caller's ``reset``
        records them)."""
        if self.slot_of:
            self.alloc.free(np.fromiter(self.slot_of.values(), dtype=np.int32, count=len(self.slot_of)))
        self.slot_of.clear()

    def check(self, depth: dict[TreeNode, int], device_slot_of: dict[TreeNode, int]) -> None:
        """Raise :class:`InvariantError` naming node ids / host slots unless every host state
        is on a live node (a key of ``depth``: node -> its end position) at that node's end,
        on no node that also holds a device state, and the allocator's in-use slots are
        exactly the table's, each owned once (leaked / double-owned slots named)."""
        dead = [n.id for n in self.slot_of if n not in depth]
        if dead:
            raise InvariantError(f"MambaRadixCache: host states held by nodes not in the tree (leaked): "
                                 f"nodes {describe_ids(dead)}")
        both = [n.id for n in self.slot_of if n in device_slot_of]
        if both:
            raise InvariantError(f"MambaRadixCache: nodes {describe_ids(both)} hold a state on the device "
                                 "and on the host")
        wrong = [n.id for n, s in self.slot_of.items() if int(self.end[s]) != depth[n]]
        if wrong:
            raise InvariantError(f"MambaRadixCache: host states recorded at a position other than their "
                                 f"node's end: nodes {describe_ids(wrong)}")
        owned = np.fromiter(self.slot_of.values(), dtype=np.int64, count=len(self.slot_of))
        try:
            self.alloc.check_invariants(owned)
        except InvariantError as e:
            raise InvariantError(f"MambaRadixCache: {str(e).replace('host pages', 'host state slots')}") from None
        if self.events is not None:
            mine = {_last_hash(n): int(self.end[s]) for n, s in self.slot_of.items()}
            theirs = self.events.live_states(MEDIUM_CPU)
            bad = sorted(h for h in mine.keys() | theirs.keys() if mine.get(h) != theirs.get(h))
            if bad:
                raise InvariantError(f"MambaRadixCache: the event recorder's host states differ from the "
                                     f"table's at blocks {describe_ids(bad)}")


def _last_hash(node: TreeNode) -> int:
    """The block hash of ``node``'s last page (set on every node when events are on)."""
    hashes = node.block_hashes
    if not hashes:
        raise InvariantError(f"MambaRadixCache: node {node.id} has no block hashes (events are on)")
    return hashes[-1]
