"""What a :class:`~radixkv.engine.embedded.CacheEngine` reports about itself: its counters
(``stats``) and its audit (``check_invariants``), bound as its methods.

Split out of :mod:`radixkv.engine.embedded` (the protocol calls); both read the engine's
pools, tree, sessions and running requests and change nothing (``stats`` sweeps expired
leases first, as every call does).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, cast

from radixkv.cache.mamba_audit import StateConservation
from radixkv.cache.tiered_cache import TieredRadixCache
from radixkv.engine.protocol import EngineStats, Session
from radixkv.errors import InvariantError
from radixkv.scheduler.flow import check_conservation, conservation

if TYPE_CHECKING:
    from radixkv.cache.mamba_radix_cache import MambaRadixCache
    from radixkv.engine.embedded import CacheEngine

__all__ = ["stats", "check_invariants", "state_counts", "tier_counts", "query_counters", "discount_since"]


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
    tiers = tier_counts(engine)
    return EngineStats(
        kv_capacity=c.pool_size, kv_available=c.available, kv_evictable=c.evictable,
        kv_protected=c.protected, kv_held=c.held_by_requests,
        state_capacity=s.capacity, state_available=s.available, state_evictable=s.evictable,
        state_protected=s.protected, state_held=s.held,
        rows_capacity=pool.size, rows_available=pool.available_size(),
        sessions=len(engine.sessions), requests=len(engine._reqs),
        queries=m.queries - d[0], queried_tokens=m.queried_tokens - d[1],
        hit_tokens=m.hit_tokens - d[2], inserted_tokens=m.inserted_tokens,
        evicted_tokens=m.evicted_tokens, **tiers,
    )


def tier_counts(engine: CacheEngine) -> dict[str, int]:
    """The tier fields of :class:`EngineStats` (empty with the host tier off; the tier hits
    less those of calls that raised). O(1)."""
    tree = engine.tree
    if not isinstance(tree, TieredRadixCache):
        return {}
    ps, page_bytes = engine.config.page_size, tree.host_pool.page_bytes
    h, t, d = tree.tier_hits, tree.tier_stats, engine._discount
    free = tree.host_alloc.available_size() * ps
    out = dict(host_capacity=tree.host_capacity(), host_available=free, host_used=tree.host_capacity() - free,
               tier_hit_device=h["device"] - d[3], tier_hit_host=h["host"] - d[4],
               tier_hit_storage=h["storage"] - d[5], host_loaded_pages=t["loaded_pages"],
               host_loaded_bytes=t["loaded_pages"] * page_bytes, host_load_us=t["load_ns"] // 1000,
               host_demoted_pages=t["demoted_pages"], host_dropped_pages=t["host_dropped_pages"])
    if tree.storage is not None:
        st = tree.storage.stats
        out.update(storage_loaded_pages=st.fetched, storage_loaded_bytes=st.fetched * page_bytes,
                   storage_load_us=st.wait_us, storage_written_pages=st.written,
                   storage_write_failed=st.write_failed, storage_backup_dropped=st.backup_dropped,
                   storage_fetch_timeouts=st.fetch_timeouts, storage_errors=st.errors, storage_pending=st.pending)
    return out


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


def query_counters(engine: CacheEngine) -> tuple[int, ...]:
    """The tree's query counters: queries, queried and hit tokens, and the hits per tier
    (device, host, storage; zeros without tiers). O(1)."""
    m = engine.tree.metrics.snapshot()
    h = getattr(engine.tree, "tier_hits", None) or {"device": 0, "host": 0, "storage": 0}
    return (m.queries, m.queried_tokens, m.hit_tokens, h["device"], h["host"], h["storage"])


def discount_since(engine: CacheEngine, before: tuple[int, ...]) -> None:
    """Discount the query counters gained since ``before`` (:func:`query_counters`; a call
    that raised must not count in ``stats``)."""
    for i, (now, then) in enumerate(zip(query_counters(engine), before)):
        engine._discount[i] += now - then
