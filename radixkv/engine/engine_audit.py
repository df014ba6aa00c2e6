"""What a :class:`~radixkv.engine.embedded.CacheEngine` reports about itself: its counters
(:func:`stats`) and its audit (:func:`check_invariants`), called by the engine's methods of
those names with the parts they read (pools, tree, sessions, running requests); both change
nothing.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

from radixkv.cache.hybrid.mamba_audit import StateConservation
from radixkv.cache.kv_conservation import check_conservation, conservation
from radixkv.engine.protocol import EngineStats
from radixkv.errors import InvariantError

if TYPE_CHECKING:
    from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
    from radixkv.cache.radix_cache import RadixCache
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.pools import EnginePools
    from radixkv.engine.requests import EngineReq
    from radixkv.engine.sessions import SessionTable
    from radixkv.scheduler.batch import Batch

__all__ = ["stats", "tier_fields", "check_invariants", "state_counts"]


def stats(pools: EnginePools, tree: RadixCache, sessions: SessionTable, reqs: Mapping[tuple[str, str], EngineReq],
          discount: Sequence[int]) -> EngineStats:
    """Counters of the whole engine, the tree's query counters less ``discount`` (queries,
    queried and hit tokens, hits per tier, of calls that raised). O(running requests)."""
    c = conservation(pools.allocator, tree, reqs.values())
    m = tree.metrics.snapshot()
    pool = pools.req_to_token_pool
    s = state_counts(pools, tree, reqs.values())
    d = discount
    return EngineStats(
        kv_capacity=c.pool_size, kv_available=c.available, kv_evictable=c.evictable,
        kv_protected=c.protected, kv_held=c.held_by_requests,
        state_capacity=s.capacity, state_available=s.available, state_evictable=s.evictable,
        state_protected=s.protected, state_held=s.held,
        rows_capacity=pool.size, rows_available=pool.available_size(),
        sessions=len(sessions), requests=len(reqs),
        queries=m.queries - d[0], queried_tokens=m.queried_tokens - d[1],
        hit_tokens=m.hit_tokens - d[2], inserted_tokens=m.inserted_tokens,
        evicted_tokens=m.evicted_tokens, **tier_fields(tree, discount),
    )


def tier_fields(tree: RadixCache, discount: Sequence[int]) -> dict[str, int]:
    """The tier fields of :class:`EngineStats` from the tree's ``tier_counters`` (none with
    the host tier off), the tier hits less ``discount[3:6]`` (calls that raised), and a
    hybrid tree's ``host_state_counters``. O(1)."""
    states = getattr(tree, "host_state_counters", None)
    st: dict[str, int] = states() if states is not None else {}
    out = {k.replace("host_states_", "host_state_"): v for k, v in st.items()}  # EngineStats' names
    counters = getattr(tree, "tier_counters", None)
    if counters is None:
        return out
    t, d = counters(), discount
    cap, used, pb = t["host_capacity_tokens"], t["host_used_tokens"], t["page_bytes"]
    out.update(host_capacity=cap, host_available=cap - used, host_used=used,
               tier_hit_device=t["hit_tokens_device"] - d[3], tier_hit_host=t["hit_tokens_host"] - d[4],
               tier_hit_storage=t["hit_tokens_storage"] - d[5], host_loaded_pages=t["loaded_pages"],
               host_loaded_bytes=t["loaded_pages"] * pb, host_load_us=t["load_ns"] // 1000,
               host_demoted_pages=t["demoted_pages"], host_dropped_pages=t["host_dropped_pages"])
    if "storage_written" in t:
        out.update(storage_loaded_pages=t["storage_fetched"], storage_loaded_bytes=t["storage_fetched"] * pb,
                   storage_load_us=t["storage_wait_us"], storage_written_pages=t["storage_written"],
                   storage_write_failed=t["storage_write_failed"], storage_backup_dropped=t["storage_backup_dropped"],
                   storage_fetch_timeouts=t["storage_fetch_timeouts"], storage_errors=t["storage_errors"],
                   storage_pending=t["storage_pending"])
    return out


def check_invariants(config: EngineConfig, pools: EnginePools, tree: RadixCache, sessions: SessionTable,
                     reqs: Mapping[tuple[str, str], EngineReq], batch: Batch) -> None:
    """Every pool, the tree, the KV conservation law (page-exact, with the running requests
    ``reqs``, keyed by (session id, rid); ``batch`` holds them in that order), the session
    table and ``reqs`` agree; hybrid: the state law, slot-exact (every Mamba slot free, a tree
    state or a running request's own, and every running request holds one); with events on,
    the tree's recorder agrees with the tree. Raises ``InvariantError`` naming the offending
    ids. O(pool + tree + tokens)."""
    running = list(reqs.values())
    pools.check_invariants(running)
    if config.is_hybrid:
        cast("MambaRadixCache", tree).check_invariants(running)  # includes the exact slot audit against reqs
        slotless = sorted(r.rid for r in running if r.mamba_pool_idx is None)
        if slotless:
            raise InvariantError(f"running requests of a hybrid model without a Mamba slot: {slotless}")
        s = state_counts(pools, tree, running)
        if not s.ok:
            raise InvariantError(f"Mamba slots not conserved: available {s.available} + evictable "
                                 f"{s.evictable} + protected {s.protected} + held {s.held} != {s.capacity}")
    else:
        tree.check_invariants()
    sessions.check_invariants()
    owned = {(sid, rid) for sid in sessions.session_ids() for rid in sessions.rids(sid)}
    if owned != set(reqs):
        raise InvariantError(f"requests without a session (leaked): {sorted(set(reqs) - owned)}; "
                             f"session rids without a request: {sorted(owned - set(reqs))}")
    bad = [key for key, r in reqs.items()
           if r.rid != key[1] or r.req_pool_idx is None or r.kv_committed_len != r.seq_len]
    if bad:
        raise InvariantError(f"running requests without a row or with uncommitted tokens: {bad}")
    batch.check_invariants()
    check_conservation(pools.allocator, tree, running)


def state_counts(pools: EnginePools, tree: RadixCache, reqs: Iterable[EngineReq]) -> StateConservation:
    """Where the Mamba slots are (all zeros for KV-only models). O(running requests)."""
    mp = pools.mamba_pool
    if mp is None:
        return StateConservation(0, 0, 0, 0, 0)
    held = sum((r.mamba_pool_idx is not None) + len(r.mamba_ping_pong_track_buffer or ())
               for r in reqs)  # its own slot and its track buffer's
    hybrid = cast("MambaRadixCache", tree)  # a hybrid config builds the Mamba tree
    return StateConservation(int(mp.size), int(mp.available_size()), int(hybrid.mamba_evictable_size()),
                             int(hybrid.mamba_protected_size()), held)
