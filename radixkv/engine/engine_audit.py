"""What a :class:`~radixkv.engine.embedded.CacheEngine` reports about itself: its counters
(``stats``) and its audit (``check_invariants``), bound as its methods.

Split out of :mod:`radixkv.engine.embedded` (the protocol calls); both read the engine's
pools, tree, sessions and running requests and change nothing (``stats`` sweeps expired
leases first, as every call does).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

from radixkv.cache.hybrid.mamba_audit import StateConservation
from radixkv.cache.kv_conservation import check_conservation, conservation
from radixkv.engine.protocol import EngineStats, Session
from radixkv.errors import InvariantError

if TYPE_CHECKING:
    from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
    from radixkv.cache.metrics import MetricsSnapshot
    from radixkv.engine.embedded import CacheEngine

__all__ = ["stats", "check_invariants", "state_counts", "discount_since"]


def stats(engine: CacheEngine, session: Session | None = None) -> EngineStats:
    """Counters of the whole engine (``session`` optional; checked and renewed when
    given). O(running requests)."""
    if session is not None:
        engine._enter(session)
    else:
        engine.sweep()
    c = conservation(engine.pools.allocator, engine.tree, engine._reqs.values())
    m = engine.tree.metrics.snapshot()
    pool = engine.pools.req_to_token_pool
    s = state_counts(engine)
    d = engine._discount
    return EngineStats(
        kv_capacity=c.pool_size, kv_available=c.available, kv_evictable=c.evictable,
        kv_protected=c.protected, kv_held=c.held_by_requests,
        state_capacity=s.capacity, state_available=s.available, state_evictable=s.evictable,
        state_protected=s.protected, state_held=s.held,
        rows_capacity=pool.size, rows_available=pool.available_size(),
        sessions=len(engine.sessions), requests=len(engine._reqs),
        queries=m.queries - d[0], queried_tokens=m.queried_tokens - d[1],
        hit_tokens=m.hit_tokens - d[2], inserted_tokens=m.inserted_tokens,
        evicted_tokens=m.evicted_tokens,
    )


def check_invariants(engine: CacheEngine) -> None:
    """Every pool, the tree, the KV conservation law (page-exact, with the running
    requests), the session table, and the engine's own request map agree; for hybrid
    models also the state law, slot-exact: every Mamba slot is exactly one of free, a
    tree state (evictable or protected) or a running request's own slot
    (``state_available + state_evictable + state_protected + state_held ==
    state_capacity``), and every running request holds one; with events on, the tree's
    event recorder agrees with the tree (live blocks, and live states for hybrid models).
    Raises ``InvariantError`` naming the offending ids. O(pool + tree + tokens)."""
    reqs = list(engine._reqs.values())
    engine.pools.check_invariants(reqs)
    if engine.config.is_hybrid:
        cast("MambaRadixCache", engine.tree).check_invariants(reqs)  # includes the exact slot audit against reqs
        slotless = sorted(r.rid for r in reqs if r.mamba_pool_idx is None)
        if slotless:
            raise InvariantError(f"running requests of a hybrid model without a Mamba slot: {slotless}")
        s = state_counts(engine)
        if not s.ok:
            raise InvariantError(f"Mamba slots not conserved: available {s.available} + evictable "
                                 f"{s.evictable} + protected {s.protected} + held {s.held} != {s.capacity}")
    else:
        engine.tree.check_invariants()
    engine.sessions.check_invariants()
    owned = {(sid, rid) for sid in engine.sessions.session_ids() for rid in engine.sessions.rids(sid)}
    if owned != set(engine._reqs):
        raise InvariantError(f"requests without a session (leaked): {sorted(set(engine._reqs) - owned)}; "
                             f"session rids without a request: {sorted(owned - set(engine._reqs))}")
    bad = [key for key, r in engine._reqs.items()
           if r.rid != key[1] or r.req_pool_idx is None or r.kv_committed_len != r.seq_len]
    if bad:
        raise InvariantError(f"running requests without a row or with uncommitted tokens: {bad}")
    engine._batch(reqs).check_invariants()
    check_conservation(engine.pools.allocator, engine.tree, reqs)


def state_counts(engine: CacheEngine) -> StateConservation:
    """Where the Mamba slots are (all zeros for KV-only models). O(running requests)."""
    mp = engine.pools.mamba_pool
    if mp is None:
        return StateConservation(0, 0, 0, 0, 0)
    held = sum((r.mamba_pool_idx is not None) + len(r.mamba_ping_pong_track_buffer or ())
               for r in engine._reqs.values())  # its own slot and its track buffer's
    tree = cast("MambaRadixCache", engine.tree)  # a hybrid config builds the Mamba tree
    return StateConservation(int(mp.size), int(mp.available_size()), int(tree.mamba_evictable_size()),
                             int(tree.mamba_protected_size()), held)


def discount_since(engine: CacheEngine, before: MetricsSnapshot) -> None:
    """Discount the tree's query counters gained since the snapshot ``before`` (a call that
    raised must not count in ``stats``)."""
    m = engine.tree.metrics.snapshot()
    engine._discount[0] += m.queries - before.queries
    engine._discount[1] += m.queried_tokens - before.queried_tokens
    engine._discount[2] += m.hit_tokens - before.hit_tokens
