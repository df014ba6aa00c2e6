"""The audit of the :class:`~radixkv.cache.hybrid.mamba_radix_cache.MambaRadixCache` (its methods
``check_invariants``, ``check_state_conservation`` and ``pretty_print`` call the functions
here) and the Mamba slot conservation law (:class:`StateConservation`, :func:`audit_slots`):
every slot of the pool is exactly one of free, a tree state, or a running request's own.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch

from radixkv.cache.kv_conservation import RunningRequest, check_conservation
from radixkv.errors import InvariantError, describe_ids

if TYPE_CHECKING:
    from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
    from radixkv.cache.hybrid.state_table import StateTable
    from radixkv.cache.tree_node import TreeNode
    from radixkv.contracts import StatePool

__all__ = ["StateConservation", "HybridRunningRequest", "audit_slots", "check_slot_laws", "check_state_conservation",
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


class HybridRunningRequest(RunningRequest, Protocol):
    """What the audits read of a running request of a hybrid tree: a
    :class:`~radixkv.cache.kv_conservation.RunningRequest` with its own Mamba slot (and,
    when it has one, its ``mamba_ping_pong_track_buffer``, read with ``getattr``)."""

    @property
    def mamba_pool_idx(self) -> int | None: ...


def audit_slots(pool: StatePool, tree_slots: dict[int, TreeNode], held_slots: dict[int, str],
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


# ----------------------------------------------------------------------------- the tree's audit
# Called by the MambaRadixCache methods of the same names.
def check_slot_laws(cache: MambaRadixCache, running_reqs: Sequence[HybridRunningRequest] | None = None) -> None:
    """Both conservation laws (the end of ``MambaRadixCache.check_invariants``): Mamba slots
    (:meth:`check_state_conservation`) and, given ``running_reqs`` (every request holding a
    row) and a request pool and allocator, KV slots (allocator available + tree evictable +
    tree protected + held by the requests == pool size, audited page by page:
    :func:`radixkv.cache.kv_conservation.check_conservation`). Raises ``InvariantError``
    naming ids."""
    if running_reqs is not None and cache.token_to_kv_pool_allocator is not None \
            and cache.req_to_token_pool is not None:
        check_conservation(cache.token_to_kv_pool_allocator, cache, list(running_reqs))  # + slots
    else:
        cache.check_state_conservation(running_reqs)


def check_state_conservation(cache: MambaRadixCache, states: StateTable,
                             running_reqs: Sequence[HybridRunningRequest] | None = None) -> StateConservation:
    """Mamba pool available + tree evictable + tree protected (``states``, the cache's state
    table) + held by running requests == capacity, exactly (no slot leaked, owned twice, or
    free while referenced). ``running_reqs``: every request holding a slot; default: the
    slots the request pool maps to rows in use. O(pool size). Raises ``InvariantError``."""
    tree = {s: n for n, s in states.slot_of.items()}
    if running_reqs is not None:
        held: dict[int, str] = {}
        for r in running_reqs:
            own = [] if r.mamba_pool_idx is None else [int(r.mamba_pool_idx)]
            for s in own + [int(t) for t in getattr(r, "mamba_ping_pong_track_buffer", None) or ()]:
                if s in held:
                    raise InvariantError(f"Mamba slot {s} held by two running requests "
                                         f"(duplicated): {held[s]!r} and {r.rid!r}")
                held[s] = r.rid
    else:
        held = _mapped_slots(cache)
    return audit_slots(cache.mamba_pool, tree, held, states.evictable, states.protected)


def _mapped_slots(cache: MambaRadixCache) -> dict[int, str]:
    pool: Any = cache.req_to_token_pool  # a HybridReqToTokenPool (its rows' free list) when mapped
    mapping = getattr(pool, "req_index_to_mamba_index_mapping", None)
    if mapping is None:
        return {}
    rows = torch.arange(1, pool.size + 1)
    used = ~pool.free_slots.is_free(rows).cpu()
    slots = mapping.cpu()[1:][used].tolist()
    held = {int(s): f"row {int(r)}" for s, r in zip(slots, rows[used].tolist())}
    owners = getattr(pool, "track_slot_owners", None)
    held.update({s: f"row {r} (track)" for s, r in (owners() if owners is not None else {}).items()})
    return held


def pretty_print(cache: MambaRadixCache, states: StateTable, tree_text: str) -> str:
    """RadixCache's print ``tree_text`` with each node's state slot in ``states`` (``-`` for a
    tombstone), and the state counts."""
    lines = tree_text.split("\n")
    by_id = {n.id: s for n, s in states.slot_of.items()}
    for i, line in enumerate(lines):
        head = line.lstrip()
        if head.startswith("#") and " len=" in head:
            nid = int(head[1:head.index(" ")])
            lines[i] = f"{line} state={by_id.get(nid, '-')}"
    lines.append(f"#states: {len(states)} (evictable {cache.mamba_evictable_size()}, "
                 f"protected {cache.mamba_protected_size()})")
    return "\n".join(lines)
