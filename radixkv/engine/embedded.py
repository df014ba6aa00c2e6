"""``CacheEngine``: the cache-engine protocol run in-process (embedded mode).

A thin, typed, validating layer over the scheduler flow (``radixkv.scheduler.flow``) and the
tree: it keeps the sessions and, per session, their requests by rid, and turns protocol calls
into ``alloc_for_extend`` / ``alloc_for_decode`` / ``cache_unfinished_req`` /
``release_kv_cache`` on the pools built by :mod:`radixkv.engine.pools`.

Every call reclaims expired leases (O(1) when none is due), checks the session
(``StaleSessionError``) and renews its lease, validates the whole input (``NotFoundError`` for
a rid the session does not own, ``InvalidArgumentError``, ``CapacityError``), and only then
changes anything. A call that raises leaves pools, tree, requests, sessions and the reported
counters as they were. Hybrid state slots, tracking, events and audits: ``docs/internals.md``
("The embedded engine"). Thread-safety: none, by design: the service runs it in one event
loop, and in-process users call it from one thread (or hold their own lock).
"""
from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from radixkv.cache.radix_key import RadixKey
from radixkv.contracts import Event, StorageBackend
from radixkv.engine import decode_replay, engine_audit
from radixkv.engine.config import EngineConfig
from radixkv.engine.engine_events import EventQueue
from radixkv.engine.pools import EnginePools, build_tree
from radixkv.engine.protocol import (
    AttachInfo,
    CacheResult,
    DecodeItem,
    DecodeResult,
    EngineStats,
    EvictResult,
    ExtendItem,
    ExtendResult,
    MatchInfo,
    MatchQuery,
    Session,
)
from radixkv.engine.requests import EngineReq
from radixkv.engine.sessions import SessionTable
from radixkv.errors import CapacityError, InvalidArgumentError, InvariantError, RadixKVError
from radixkv.scheduler.batch import Batch
from radixkv.scheduler.decode_reserve import free_reserves, reserved_slots, top_up
from radixkv.scheduler.flow import alloc_for_decode, alloc_for_extend, release_kv_cache
from radixkv.validation import (
    as_items,
    check_count,
    check_extra_key,
    check_priority,
    check_rids,
    check_token_id,
    check_tokens,
)

if TYPE_CHECKING:
    from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
    from radixkv.engine.buffers import WorkerBuffers

__all__ = ["CacheEngine"]

_EMPTY = np.empty(0, dtype=np.int64)
#: DEBUG: the engine's decisions (sessions opened and reclaimed, prefix reuse per extend, evictions).
log = logging.getLogger(__name__)


def _filled(t: torch.Tensor | None) -> torch.Tensor:
    """A batch tensor the scheduler flow call just set."""
    if t is None:
        raise InvariantError("the scheduler flow left a batch tensor unset")
    return t


def _row(r: EngineReq) -> int:
    """The row of a request the scheduler flow call just gave one."""
    if r.req_pool_idx is None:
        raise InvariantError(f"request {r.rid!r} holds no row after the flow call")
    return int(r.req_pool_idx)


def _as_config(config: EngineConfig | dict[str, Any] | None) -> EngineConfig:
    if config is None:
        return EngineConfig()
    if isinstance(config, dict):
        return EngineConfig.from_dict(config)
    if not isinstance(config, EngineConfig):
        raise InvalidArgumentError(f"config must be an EngineConfig or a dict, got {type(config).__name__}")
    return config


class CacheEngine:
    """The embedded cache engine (implements :class:`~radixkv.engine.protocol.CacheEngineAPI`).

    Args: ``config`` (an :class:`EngineConfig`, a dict of its fields, or ``None``: defaults);
    ``clock`` (seconds, non-decreasing; default ``time.monotonic``); ``epoch`` (the session epoch,
    default random); ``buffers`` / ``mappings`` (``{pool name: tensor}`` of existing memory, and
    how workers map it, default ``"embedded"``; see :class:`~radixkv.engine.pools.EnginePools`);
    ``storage`` (a storage backend for the host tier instead of ``config.storage``'s URL).

    Attributes: ``config``, ``pools`` (:class:`EnginePools`), ``tree`` (a RadixCache, or a
    MambaRadixCache for hybrid models), ``sessions`` (:class:`SessionTable`). Raises
    ``InvalidArgumentError`` for a bad config or buffers, or a hybrid config while the Mamba-aware
    tree is missing.
    """

    def __init__(self, config: EngineConfig | dict[str, Any] | None = None, *,
                 clock: Callable[[], float] | None = None, epoch: int | None = None,
                 buffers: dict[str, torch.Tensor] | None = None,
                 mappings: dict[str, dict[str, Any]] | None = None, storage: StorageBackend | None = None):
        self.config = _as_config(config)
        self.pools = EnginePools(self.config, buffers)
        self.tree = build_tree(self.pools, storage)
        self.sessions = SessionTable(self.config.lease_ttl_s, self.config.max_sessions,
                                     self.config.max_requests_per_session, clock=clock, epoch=epoch)
        self._layout = self.pools.layout(mappings)
        self._reqs: dict[tuple[str, str], EngineReq] = {}  # (session id, rid): ids are per session
        self._events = EventQueue(self.tree)
        self._discount = [0] * 6  # _query_counters() of calls that raised

    # ------------------------------------------------------------------ sessions
    @property
    def epoch(self) -> int:
        """The session epoch (a restarted engine gets a new one)."""
        return self.sessions.epoch

    def layout(self) -> dict[str, Any]:
        """A copy of the JSON-able layout of the pools (what ``attach`` returns)."""
        return copy.deepcopy(self._layout)

    def worker_buffers(self) -> WorkerBuffers:
        """In-process :class:`~radixkv.engine.buffers.WorkerBuffers` over the pools."""
        return self.pools.worker_buffers()

    def attach(self, worker_name: str = "") -> AttachInfo:
        """Open a session. Raises ``CapacityError`` at ``max_sessions``. O(1)."""
        self.sweep()
        session = self.sessions.open(worker_name)
        log.debug("session %s attached (worker %r)", session.session_id, worker_name)
        return AttachInfo(session, self.layout())

    def heartbeat(self, session: Session) -> float:
        """Renew the lease; returns the seconds it now has left."""
        sid = self._enter(session)
        return self.sessions.time_left(sid)

    def detach(self, session: Session) -> None:
        """End the session; everything its requests hold is freed (not cached)."""
        self.reclaim(self._enter(session), "was detached")

    def reclaim(self, session_id: str, reason: str = "was reclaimed") -> int:
        """End live session ``session_id``: its requests are aborted (locks released, KV
        slots not in the tree, rows and state slots freed) and later calls under it raise
        ``StaleSessionError`` quoting ``reason``. Returns how many requests it held.
        O(tokens its requests hold privately)."""
        rids = self.sessions.rids(session_id)
        log.debug("session %s %s: %d running request(s) aborted", session_id, reason, len(rids))
        self._abort([self._reqs[(session_id, r)] for r in rids])
        self.sessions.close(session_id, reason)
        for r in rids:
            del self._reqs[(session_id, r)]
        return len(rids)

    def sweep(self, now: float | None = None) -> list[str]:
        """Reclaim every session whose lease ran out at ``now`` (default: the clock);
        returns their ids. Every call runs it first; the service also runs it periodically.
        O(1) when none is due."""
        expired = self.sessions.due(now)
        for sid in expired:
            self.reclaim(sid, "expired (its lease ran out)")
        return expired

    def close(self) -> None:
        """Reclaim every session (server shutdown); drain the storage write queue (at most
        ``storage_drain_timeout_s``) and close the storage backend."""
        for sid in self.sessions.session_ids():
            self.reclaim(sid, "was closed: the engine shut down")
        storage = getattr(self.tree, "storage", None)
        if storage is not None:
            storage.close(self.config.storage_drain_timeout_s)

    def _enter(self, session: Session) -> str:
        self.sweep()
        sid = self.sessions.lookup(session).session_id
        self.sessions.renew(sid)
        return sid

    def _own(self, sid: str, rids: object) -> list[EngineReq]:
        ids = check_rids(rids)
        self.sessions.classify(sid, ids, must_exist=True)
        return [self._reqs[(sid, r)] for r in ids]

    # ------------------------------------------------------------------ queries
    def match(self, session: Session, queries: Sequence[MatchQuery]) -> list[MatchInfo]:
        """How much of each query is cached (no lock, no allocation). O(sum of lengths)."""
        self._enter(session)
        qs = as_items(queries, MatchQuery, "queries")
        keys = [RadixKey(check_tokens(q.token_ids, f"queries[{i}]", allow_empty=True),
                         check_extra_key(q.extra_key, f"queries[{i}]")) for i, q in enumerate(qs)]
        out = []
        for key in keys:
            m = self.tree.match_prefix(key)
            host = getattr(m, "host_len", 0)  # host pages count: alloc_extend loads them
            n = m.prefix_len + host
            out.append(MatchInfo(n, getattr(m, "kv_prefix_len", n), host, getattr(m, "storage_len", 0)))
        return out

    # ------------------------------------------------------------------ extend / decode
    def alloc_extend(self, session: Session, items: Sequence[ExtendItem]) -> list[ExtendResult]:
        """All or nothing (see the protocol). New rids are matched and locked and get a
        row (and, hybrid, a state slot holding the matched state's fork, or zeros); every
        request gets KV slots for its new tokens, evicting KV and states as needed.

        Raises ``InvalidArgumentError`` (bad items, repeated rids, no tokens),
        ``CapacityError`` (over
        ``max_context_len``, ``max_requests_per_session``, rows, or KV or state slots even
        after eviction).
        Cost: the flow's, O(batch + tokens) vectorized."""
        sid = self._enter(session)
        its = as_items(items, ExtendItem, "items")
        self.sessions.check_batch(len(its))
        rids = check_rids([it.rid for it in its])
        toks = [check_tokens(it.token_ids, f"items[{i}] ({it.rid!r})") for i, it in enumerate(its)]
        for i, it in enumerate(its):
            check_extra_key(it.extra_key, f"items[{i}]")
            check_priority(it.priority, f"items[{i}]")
        known = self.sessions.classify(sid, rids, must_exist=False)
        self.sessions.check_room(sid, known.count(False))
        limit = self.config.max_context_len
        for rid, tok, k in zip(rids, toks, known):
            total = (self._reqs[(sid, rid)].seq_len if k else 0) + tok.size
            if total > limit:
                raise CapacityError(f"request {rid!r}: {total} tokens exceed max_context_len {limit}",
                                    requested=total, available=limit)
        if not its:
            return []
        reqs, marks = [], []
        for it, tok, k in zip(its, toks, known):
            if k:
                r = self._reqs[(sid, it.rid)]
                marks.append((r, r.mark()))
                r.append_tokens(tok)
            else:
                r = EngineReq.create(it.rid, tok, it.extra_key, int(it.priority))
            reqs.append(r)
        batch = self._batch(reqs)
        before = self._query_counters()
        try:
            alloc_for_extend(batch)
        except BaseException:
            for r, m in marks:
                r.rollback(m)
            self._discount_since(before)
            raise
        new = [r for r, k in zip(reqs, known) if not k]
        self.sessions.add_requests(sid, [r.rid for r in new])
        for r in new:
            self._reqs[(sid, r.rid)] = r
        self._top_up(reqs)
        out = _filled(batch.out_cache_loc).to("cpu", torch.int64).numpy()
        pre, seq = _filled(batch.prefix_lens).tolist(), _filled(batch.seq_lens_cpu).tolist()
        t_slots = [0] * len(reqs) if batch.mamba_track_indices is None else batch.mamba_track_indices.tolist()
        t_lens = [-1] * len(reqs) if batch.mamba_track_seqlens is None else batch.mamba_track_seqlens.tolist()
        tiers = batch.tier_lens or [(0, 0)] * len(reqs)
        results, pos = [], 0
        for i, r in enumerate(reqs):
            n = seq[i] - pre[i]
            results.append(ExtendResult(r.rid, _row(r), 0 if known[i] else pre[i], pre[i],
                                        seq[i], out[pos:pos + n].copy(), self._slot(r),
                                        r.decode_reserve.copy(), int(t_slots[i]), int(t_lens[i]),
                                        tiers[i][0], tiers[i][1]))
            pos += n
        if log.isEnabledFor(logging.DEBUG):
            log.debug("alloc_extend: %s", ", ".join(f"{r.rid} {p}/{q} tokens reused"
                                                    for r, p, q in zip(reqs, pre, seq)))
        return results

    def alloc_decode(self, session: Session, items: Sequence[DecodeItem]) -> DecodeResult:
        """One KV slot per request for the token fed this step (appended to its tokens).

        With ``decode_reserve`` a request takes the front slot of its reserve (no allocator
        call); afterwards every request of the call whose reserve ran out gets a new one when
        the allocator has it free (``radixkv.scheduler.decode_reserve``; ``alloc_extend``
        applies the same top-up). A call whose requests all held >= 2 reserved slots is
        therefore computable from earlier results, which remote clients rely on.

        Raises ``InvalidArgumentError`` / ``NotFoundError`` for bad items or rids,
        ``CapacityError`` (``max_context_len``, or KV even after eviction). O(batch) vectorized."""
        sid = self._enter(session)
        its = as_items(items, DecodeItem, "items")
        reqs = self._own(sid, [it.rid for it in its])
        tids = [check_token_id(it.token_id, f"items[{i}] ({it.rid!r})") for i, it in enumerate(its)]
        limit = self.config.max_context_len
        for r in reqs:
            if r.seq_len + 1 > limit:
                raise CapacityError(f"request {r.rid!r}: {r.seq_len + 1} tokens exceed max_context_len "
                                    f"{limit}", requested=r.seq_len + 1, available=limit)
        if not its:
            return DecodeResult(_EMPTY.copy(), _EMPTY.copy(), _EMPTY.copy(), _EMPTY.copy(), _EMPTY.copy(),
                                _EMPTY.copy())
        marks = [r.mark() for r in reqs]
        for r, t in zip(reqs, tids):
            r.append_output(t)
        batch = self._batch(reqs)
        try:
            alloc_for_decode(batch)
        except BaseException:
            for r, m in zip(reqs, marks):
                r.rollback(m)
            raise
        self._top_up(reqs)
        return DecodeResult(_filled(batch.out_cache_loc).to("cpu", torch.int64).numpy().copy(),
                            _filled(batch.seq_lens_cpu).to(torch.int64).numpy().copy(),
                            np.array([r.req_pool_idx for r in reqs], dtype=np.int64),
                            np.array([self._slot(r) for r in reqs], dtype=np.int64),
                            reserved_slots(reqs).copy(),
                            np.array([r.decode_reserve.size for r in reqs], dtype=np.int64),
                            _EMPTY.copy() if batch.mamba_track_indices is None
                            else batch.mamba_track_indices.to("cpu", torch.int64).numpy().copy())

    # ------------------------------------------------------------------ cache / release
    def cache_unfinished(self, session: Session, rids: Sequence[str]) -> list[CacheResult]:
        """Insert each request's committed tokens (page-aligned) into the tree and move its
        lock there; hybrid: a fork of its state goes with them when the committed length is
        page-aligned (and admitted). ``cached_len`` is 0 with admission policy ``none``.
        O(tokens)."""
        sid = self._enter(session)
        reqs = self._own(sid, rids)
        for r in reqs:
            self.tree.cache_unfinished_req(r)
        return [CacheResult(r.rid, int(r.cache_protected_len)) for r in reqs]

    def cache_finished(self, session: Session, rids: Sequence[str]) -> list[CacheResult]:
        """Cache the requests' tokens (page-aligned part), free what the tree does not keep
        and their rows; hybrid: the tree takes the request's state slot when its committed
        length is page-aligned, else the slot is freed. The rids are forgotten. O(tokens)."""
        sid = self._enter(session)
        reqs = self._own(sid, rids)
        ps, disabled = self.config.page_size, self.tree.disable
        free_reserves(reqs, self.pools.allocator)  # one allocator call for the whole batch
        results = []
        for r in reqs:
            n = r.kv_committed_len
            results.append(CacheResult(r.rid, 0 if disabled else n - n % ps))
            release_kv_cache(r, self.tree, self.pools.req_to_token_pool)
        self._forget(sid, reqs)
        return results

    def release(self, session: Session, rids: Sequence[str]) -> None:
        """Abort: drop the requests without caching; locks, private KV slots, rows (and
        state slots) are freed. O(tokens they hold privately)."""
        sid = self._enter(session)
        reqs = self._own(sid, rids)
        self._abort(reqs)
        self._forget(sid, reqs)

    def evict(self, session: Session, num_tokens: int, num_states: int = 0) -> EvictResult:
        """Evict at least ``num_tokens`` unlocked tokens (whole nodes) from the tree, or all
        it can; then, for hybrid models, at least ``num_states`` unpinned Mamba states
        (states freed with evicted leaves count; an internal or locked node keeps its KV and
        becomes a tombstone). ``states`` is 0 for KV-only models (``num_states`` is checked
        and ignored). O(evicted nodes x log leaves) + O(S log S) over the tree's S states
        when states are asked for."""
        self._enter(session)
        n = check_count(num_tokens, "num_tokens")
        k = check_count(num_states, "num_states")
        if not self.config.is_hybrid:
            got = self.tree.evict(n) if n else 0
            log.debug("evict: %d tokens asked, %d evicted", n, got)
            return EvictResult(got, 0)
        if not n and not k:
            return EvictResult(0, 0)
        res = cast("MambaRadixCache", self.tree).evict(n, k)
        return EvictResult(int(res.num_tokens), int(res.num_states))

    def flush(self, session: Session) -> bool:
        """Empty the tree (records ``AllBlocksCleared``); ``False`` while any request of
        any session is running. O(tree)."""
        self._enter(session)
        if self._reqs:
            return False
        self.tree.reset()
        return True

    def replay_decodes(self, session: Session, rids: list[str], call_lens: np.ndarray, rid_index: np.ndarray,
                       token_ids: np.ndarray) -> int:
        """Apply the leading decode calls of a replay in bulk; returns how many
        (:func:`radixkv.engine.decode_replay.replay_decodes`; raises nothing)."""
        pool = self.pools.req_to_token_pool
        if not decode_replay.can_replay(self.config, pool, len(call_lens)):
            return 0
        try:
            reqs = self._own(self._enter(session), rids)  # well formed, distinct, this session's
        except RadixKVError:
            return 0
        return decode_replay.replay_decodes(pool, self.config.max_context_len, reqs, call_lens, rid_index,
                                            token_ids)

    # ------------------------------------------------------------------ events
    def take_events(self, session: Session, max_events: int = 0) -> list[dict[str, Any]]:
        """Take up to ``max_events`` events (0: all), oldest first, as dicts (``EventQueue.take``)."""
        self._enter(session)
        return self._events.take(check_count(max_events, "max_events"))

    @property
    def events_enabled(self) -> bool:
        """Whether the tree records events (``enable_kv_events``). O(1)."""
        return self._events.enabled

    def pending_events(self) -> int:
        """Events recorded and not yet taken (0 when events are off). O(1)."""
        return self._events.pending()

    def drain_events(self) -> list[Event]:
        """Take every pending event as objects, without a session (the service's event hub)."""
        return self._events.drain()

    # ------------------------------------------------------------------ stats / audit
    def stats(self, session: Session | None = None) -> EngineStats:
        """Counters of the whole engine (``session`` checked and renewed when given; else a sweep)."""
        if session is not None:
            self._enter(session)
        else:
            self.sweep()
        return engine_audit.stats(self.pools, self.tree, self.sessions, self._reqs, self._discount)

    def tier_stats(self) -> dict[str, int]:
        """The host and storage tiers' counters (``TieredRadixCache.tier_counters``) and the
        host state tier's (``MambaRadixCache.host_state_counters``); ``{}`` with no host tier. O(1)."""
        counters = getattr(self.tree, "tier_counters", None)
        states = getattr(self.tree, "host_state_counters", None)
        return {**(counters() if counters is not None else {}), **(states() if states is not None else {})}

    def check_invariants(self) -> None:
        """Audit pools, tree, conservation laws, sessions and requests (``engine_audit.check_invariants``)."""
        engine_audit.check_invariants(self.config, self.pools, self.tree, self.sessions, self._reqs,
                                      self._batch(list(self._reqs.values())))

    def _query_counters(self) -> tuple[int, ...]:
        """The tree's query counters: queries, queried and hit tokens, and the hits per tier
        (device, host, storage; zeros without tiers). O(1)."""
        m = self.tree.metrics.snapshot()
        h = getattr(self.tree, "tier_hits", None) or {"device": 0, "host": 0, "storage": 0}
        return (m.queries, m.queried_tokens, m.hit_tokens, h["device"], h["host"], h["storage"])

    def _discount_since(self, before: tuple[int, ...]) -> None:
        """Discount the query counters gained since ``before`` (:meth:`_query_counters`): a
        call that raised must not count in ``stats``."""
        for i, (now, then) in enumerate(zip(self._query_counters(), before)):
            self._discount[i] += now - then

    # ------------------------------------------------------------------ helpers
    def _batch(self, reqs: list[EngineReq]) -> Batch:
        p = self.pools
        return Batch(list(reqs), p.req_to_token_pool, p.allocator, self.tree, kv_pool=p.kv_pool)

    @staticmethod
    def _slot(r: EngineReq) -> int:
        return -1 if r.mamba_pool_idx is None else int(r.mamba_pool_idx)

    def _abort(self, reqs: list[EngineReq]) -> None:
        """Free everything ``reqs`` hold without caching: one allocator call for their
        private KV slots (columns ``cache_protected_len .. kv_committed_len``), then their
        locks and rows."""
        pool = self.pools.req_to_token_pool
        private = [pool.req_to_token[r.req_pool_idx, r.cache_protected_len:r.kv_committed_len]
                   for r in reqs if r.req_pool_idx is not None]
        held = reserved_slots(reqs)
        if held.size:  # decode reserves go back in the same allocator call
            private.append(torch.from_numpy(held).to(pool.req_to_token.device))
            for r in reqs:
                r.decode_reserve = _EMPTY
        slots = torch.cat(private).to(torch.int64) if private else None
        if slots is not None and slots.numel():
            self.pools.allocator.free(slots)
        for r in reqs:
            if r.last_node is not None:
                self.tree.dec_lock_ref(r.last_node)
                r.last_node = None
            if r.req_pool_idx is not None:
                pool.free(r)

    def _top_up(self, reqs: list[EngineReq]) -> None:
        """Decode reserves for the call's requests that have none (no eviction)."""
        n = self.config.decode_reserve
        if n:
            width = self.pools.req_to_token_pool.req_to_token.shape[1]
            top_up(reqs, self.pools.allocator, n, min(self.config.max_context_len, width))

    def _forget(self, sid: str, reqs: list[EngineReq]) -> None:
        self.sessions.remove_requests(sid, [r.rid for r in reqs])
        for r in reqs:
            del self._reqs[(sid, r.rid)]
