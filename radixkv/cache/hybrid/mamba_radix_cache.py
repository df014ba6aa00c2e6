"""``MambaRadixCache``: the prefix tree of hybrid models (KDA / Mamba layers mixed with full
attention): a :class:`~radixkv.cache.RadixCache` whose nodes may also hold a Mamba state slot,
the recurrent state after the node's LAST token. A node without one is a *tombstone*. A
match returns KV only up to the deepest node with a state.

Positions: a request's own slot holds the state after all tokens whose forward has run
(``req.kv_committed_len`` once the prepared step ran). Slots: a request never writes a tree
slot; a hit is forked into the request's slot, an unfinished request's state into a new tree
slot, and a finished request hands its slot over when it ends at a stateless node. Locks pin
the node's own state. :meth:`evict` takes KV leaves (with their states), then states
(tombstoning, KV kept). Policies live in :mod:`~radixkv.cache.hybrid.mamba_policies`,
the audit in :mod:`~radixkv.cache.hybrid.mamba_audit`, the state table in
:mod:`~radixkv.cache.hybrid.state_table`, the host state tier's bookkeeping in
:mod:`~radixkv.cache.hybrid.host_states`. The rules in full: ``docs/internals.md``, "The hybrid tree".
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple, cast

import numpy as np
import torch

from radixkv.cache.block_hash import Seed
from radixkv.cache.eviction import EvictionPolicy
from radixkv.cache.hybrid import mamba_audit
from radixkv.cache.hybrid.host_states import HostStateTable
from radixkv.cache.hybrid.mamba_audit import HybridRunningRequest, StateConservation
from radixkv.cache.hybrid.mamba_policies import (
    FlopModel,
    StateAdmission,
    StateEvictionOrder,
    make_admission,
    make_state_order,
)
from radixkv.cache.hybrid.state_events import HybridEventRecorder
from radixkv.cache.hybrid.state_table import EventStateTable, StateTable, node_depths
from radixkv.cache.kv_events import MEDIUM_CPU
from radixkv.cache.leaf_eviction import pop_victim
from radixkv.cache.radix_cache import NativeRadixCache, RadixCache
from radixkv.cache.radix_key import RadixKey, as_radix_key
from radixkv.cache.rows import rows_tensor
from radixkv.cache.tree_node import TreeNode, sync_only
from radixkv.contracts import CacheRequest, KVAllocator, PoolRequest, ReqToTokenTable, StatePool
from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.kernels.state_copy import copy_states
from radixkv.memory.host_state_pool import HostStatePool
from radixkv.memory.mamba_pool import SlotViews
from radixkv.validation import check_count

__all__ = ["MambaRadixCache", "MambaMatchResult", "MambaInsertResult", "MambaEvictResult"]

_tuple_new = tuple.__new__


class MambaMatchResult(NamedTuple):
    """Result of :meth:`MambaRadixCache.match_prefix` (``MatchResult``'s fields first).

    Attributes:
        device_indices: int64 KV rows of the longest match ending at a state (``prefix_len``).
        last_node: that node (the one to lock and fork from); a namespace head when none.
        prefix_len: tokens of that prefix -- what a request may skip.
        kv_prefix_len: tokens of the full (page-aligned) KV match, ``>= prefix_len``; more is
            a branch point where a scheduler may end a chunk to checkpoint the state.
        host_len: tokens past ``prefix_len`` up to ``host_node``, whose state is in the host
            tier (:meth:`MambaRadixCache.load_back` loads it).
        storage_len: of ``host_len``, the tokens whose KV this match read from storage (a
            state read for KV the tree held adds none).
    """

    device_indices: torch.Tensor
    last_node: TreeNode
    prefix_len: int
    kv_prefix_len: int
    host_len: int = 0
    host_node: TreeNode | None = None
    storage_len: int = 0

    @property
    def last_device_node(self) -> TreeNode:
        """SGLang's name for ``last_node``."""
        return self.last_node


class MambaInsertResult(NamedTuple):
    """``prefix_len``: tokens already cached; ``node``: where the key ends; ``state_kept``:
    whether the tree kept the slot handed in (else it freed it)."""

    prefix_len: int
    node: TreeNode
    state_kept: bool


class MambaEvictResult(NamedTuple):
    """What one ``MambaRadixCache.evict`` freed: KV tokens and Mamba state slots."""

    num_tokens: int
    num_states: int


class MambaRadixCache(RadixCache):
    """The radix tree of a hybrid model: KV rows per token, Mamba states at node ends.

    Args as :class:`RadixCache`, plus: ``req_to_token_pool`` (a ``HybridReqToTokenPool``, or
    ``None`` with ``mamba_pool``); ``admission_policy`` (``every`` / ``branch`` / ``none`` / a
    :class:`StateAdmission`); ``state_eviction_policy`` (``lru`` / ``flop`` / a
    :class:`StateEvictionOrder`); ``flop_model``; ``checks`` (free-mask lookups, ~10 us);
    ``host_state_pool`` (a :class:`HostStatePool`: evicted states are demoted there). With events
    on, the recorder also records ``StateStored`` / ``StateRemoved`` of device states.

    Costs on top of RadixCache's: match O(d) more probes; attaching a state O(log S) amortized;
    a fork one vectorized copy per batch; evicting states O(log S) each with ``lru``, O(S log S)
    with ``flop``. Metrics count a hit as ``prefix_len`` (state hit), not the KV match.
    """

    def __init__(self, req_to_token_pool: ReqToTokenTable | None = None,
                 token_to_kv_pool_allocator: KVAllocator | None = None,
                 page_size: int = 1, eviction_policy: str | EvictionPolicy = "lru",
                 admission_policy: str | StateAdmission = "every",
                 enable_kv_events: bool = False, *, mamba_pool: StatePool | None = None,
                 state_eviction_policy: str | StateEvictionOrder = "lru",
                 flop_model: FlopModel | None = None, disable: bool = False,
                 kv_event_seed: Seed | None = None, metrics_window: int = 1000, checks: bool = True,
                 host_state_pool: HostStatePool | None = None, native: bool | None = None) -> None:
        own = getattr(req_to_token_pool, "mamba_pool", None)
        pool = mamba_pool if mamba_pool is not None else own
        if not isinstance(pool, StatePool):
            raise InvalidArgumentError("MambaRadixCache needs a MambaPool: pass a HybridReqToTokenPool "
                                       "or mamba_pool=")
        if own is not None and own is not pool:
            raise InvalidArgumentError("mamba_pool is not the MambaPool of req_to_token_pool")
        if isinstance(admission_policy, str) and admission_policy.strip().lower() == "none":
            disable, admission_policy = True, "every"
        if flop_model is not None and not isinstance(flop_model, FlopModel):
            raise InvalidArgumentError(f"flop_model must be a FlopModel, got {type(flop_model).__name__}")
        self.admission = make_admission(admission_policy)
        self.state_order = make_state_order(state_eviction_policy)
        self.flop_model = flop_model if flop_model is not None else FlopModel.from_pool(pool)
        self.mamba_pool = pool
        if host_state_pool is not None and (not isinstance(host_state_pool, HostStatePool)
                                            or host_state_pool.mamba_pool is not pool):
            raise InvalidArgumentError("host_state_pool must be a HostStatePool over the cache's MambaPool")
        self.host_state_pool = host_state_pool
        self._host = None if host_state_pool is None else HostStateTable(host_state_pool.num_slots)
        views = getattr(pool, "slot_views", None)  # a MambaPool's own; else kept here
        if not (isinstance(views, SlotViews) and views.conv is pool.conv_state
                and views.temporal is pool.temporal_state):
            views = SlotViews(pool.conv_state, pool.temporal_state)
        self._views = views  # per-slot state views: one fork or zero fill without indexing
        self.checks = bool(checks)
        table = EventStateTable if enable_kv_events else StateTable  # no event work without events
        self._states = table(pool.size, bool(getattr(self.state_order, "needs_ancestors", False)))
        self._states.bind_pool(pool)
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, eviction_policy,
                         disable, enable_kv_events, kv_event_seed, metrics_window, native)
        if self.kv_events is not None:  # one queue for KV and state events, in their order
            rec = HybridEventRecorder(page_size, seed=self.kv_events.seed)
            self.kv_events = rec
            cast(EventStateTable, self._states).events = rec  # the table type chosen above
            if self._host is not None:
                self._host.events = rec
        has_state, base_key = self._states.slot_of.__contains__, self._sort_key
        if self._host is not None:  # a state in either tier counts: demotion keeps a leaf's rank
            dev, hosted = self._states.slot_of, self._host.slot_of
            has_state = lambda node: node in dev or node in hosted  # noqa: E731
        # tombstone leaves (False) before leaves with a state: they can never yield a hit
        self._sort_key = self._key_any = lambda node: (has_state(node), base_key(node))
        # insert_with_state's leaf key: a new leaf made by that insert is the node that gets
        # the state right after, so it is filed under its key with the state at once (filed
        # as a tombstone, it would climb the leaf heap past every leaf with a state, and be
        # re-filed by the next eviction). Only where _sort_key is asked for that leaf alone
        # (a lazily ordered policy without insert / split hooks) and the attach cannot fail
        # (no event recorder).
        self._key_stated = lambda node: (True, base_key(node))
        self._presort = (self._lazy and self._on_insert is None and self._on_split is None
                         and type(self._states) is StateTable)
        self._query_log = None  # the hybrid match records its state hit itself
        # RadixCache's match, which match_prefix extends: the compiled entry of
        # NativeRadixCache when this cache uses the compiled paths (a plain function: called
        # with self)
        self._kv_match = NativeRadixCache.match_prefix if self.native else RadixCache.match_prefix

    # ------------------------------------------------------------------ sizes, lookups
    @property
    def state_table(self) -> StateTable:
        """The tree's state table (slot of each node, positions, pins, the orders' indexes):
        read by the state policies (:mod:`~radixkv.cache.hybrid.mamba_policies`); only the
        tree changes it."""
        return self._states

    def full_evictable_size(self) -> int:
        """KV tokens in unlocked nodes (= ``evictable_size()``). O(1)."""
        return self._evictable

    def full_protected_size(self) -> int:
        """KV tokens in locked nodes (= ``protected_size()``). O(1)."""
        return self._protected

    def mamba_evictable_size(self) -> int:
        """States on unpinned nodes. O(1)."""
        return self._states.evictable

    def mamba_protected_size(self) -> int:
        """States on pinned nodes (a request locked exactly that node). O(1)."""
        return self._states.protected

    def mamba_total_size(self) -> int:
        """States in the tree. O(1)."""
        return len(self._states)

    def state_slot(self, node: TreeNode) -> int | None:
        """The slot of ``node``'s state, ``None`` for a tombstone (or a head). O(1)."""
        return self._states.slot_of.get(node)

    def host_state_slot(self, node: TreeNode) -> int | None:
        """The host slot of ``node``'s state, ``None`` when the host tier holds none for it. O(1)."""
        return None if self._host is None else self._host.slot_of.get(node)

    def state_positions(self, nodes: Sequence[TreeNode]) -> np.ndarray:
        """int64 token position of each node's state (nodes must hold one). O(len)."""
        slot_of = self._states.slot_of
        return self._states.end[[slot_of[n] for n in nodes]]

    def nearest_state_ancestor_end(self, node: TreeNode) -> int:
        """Position of the nearest state strictly above ``node`` (0: none). O(depth)."""
        slot_of, p = self._states.slot_of, node.parent
        while p is not None and p.parent is not None and p not in slot_of:
            p = p.parent
        return 0 if p is None or p.parent is None else int(self._states.end[slot_of[p]])

    def all_state_slots(self) -> list[int]:
        """Every slot the tree holds. O(states)."""
        return list(self._states.slot_of.values())

    # ------------------------------------------------------------------ match, fork
    # MambaMatchResult is MatchResult's fields and more, not a subclass (NamedTuples cannot be)
    def match_prefix(  # type: ignore[override]
            self, key: RadixKey | object, extra_key: Hashable = None) -> MambaMatchResult:
        """The longest cached prefix of ``key`` that ends at a node holding a state, its KV
        rows, that node, and ``kv_prefix_len`` (see :class:`MambaMatchResult`). Matching
        splits and touches nodes exactly like :meth:`RadixCache.match_prefix`; nothing is
        copied here (:meth:`fork_states` does). Raises as RadixCache's."""
        if type(key) is not RadixKey or extra_key is not None:
            key = as_radix_key(key, extra_key)
        idx, node, n = self._kv_match(self, key)
        slot_of, s = self._states.slot_of, n
        if self._host is not None:
            return self._match_tiers(key, idx, node, n)
        while node.parent is not None and node not in slot_of:
            s -= len(node.kbuf) >> 2
            node = node.parent
        self._metrics.record_query(len(key._buf) >> 2, s)
        return _tuple_new(MambaMatchResult, (idx if s == n else idx[:s], node, s, n, 0, None, 0))

    def _match_tiers(self, key: RadixKey, idx: torch.Tensor, node: TreeNode, n: int) -> MambaMatchResult:
        """match_prefix's walk up with the host state tier: the deepest node with a state in
        either tier is the hit; the deepest with a device state is ``last_node``."""
        slot_of, hosted = self._states.slot_of, cast(HostStateTable, self._host).slot_of
        s, hs, hnode = n, 0, None
        while node.parent is not None and node not in slot_of:
            if hnode is None and node in hosted:
                hnode, hs = node, s
            s -= len(node.kbuf) >> 2
            node = node.parent
        self._metrics.record_query(len(key._buf) >> 2, s if hnode is None else hs)
        if hnode is not None:
            stats = cast(HostStateTable, self._host).stats
            stats["hits"] += 1
            stats["hit_tokens"] += hs - s
        return _tuple_new(MambaMatchResult, (idx if s == n else idx[:s], node, s, n,
                                             0 if hnode is None else hs - s, hnode, 0))

    def load_back(self, m: MambaMatchResult) -> MambaMatchResult:
        """Load the host state of ``m.host_node`` into a device slot (evicting one unpinned
        device state, i.e. demoting it, when the pool is out); returns the match grown to that
        node (rows and ``prefix_len``), or ``m`` unchanged when no device slot can be had or
        the tree changed since the match. The host slot is freed. O(path) + one state copy."""
        host, node = self._host, m.host_node
        if host is None or node is None or not m.host_len or node not in host.slot_of:
            return m
        vals: list[bytes] = []
        x: Any = node
        while x is not m.last_node:
            if x.parent is None:
                return m
            vals.append(x.vbuf)
            x = x.parent
        hslot, end = host.take(node)  # out of the table: a demotion below cannot drop it
        got = self.mamba_pool.alloc(1)
        if got is None:
            self.evict(0, 1)
            got = self.mamba_pool.alloc(1)
        if got is None:
            host.put(node, hslot, end)
            return m
        slot = int(got[0])
        cast(HostStatePool, self.host_state_pool).load([hslot], [slot])
        self._attach(node, slot, end)
        host.release(node, hslot)  # after the attach: an event consumer sees the state on a tier throughout
        idx = torch.cat([m.device_indices.to(self.device, torch.int64),
                         rows_tensor(b"".join(reversed(vals)), self.device)])
        return _tuple_new(MambaMatchResult, (idx, node, m.prefix_len + m.host_len, m.kv_prefix_len, 0, None, 0))

    def host_state_counters(self) -> dict[str, int]:
        """The host state tier's figures (empty when off): slots, used, states demoted,
        loaded back and dropped so far, and the matches (and their tokens past the device
        state hit) whose hit ended at a host state. O(1)."""
        host = self._host
        if host is None:
            return {}
        return {"host_state_slots": host.num_slots, "host_state_used": len(host), **{
            f"host_states_{k}": v for k, v in host.stats.items()}}

    def fork_states(self, nodes: Sequence[TreeNode], reqs: Sequence[PoolRequest]) -> int:
        """Copy-on-fork: request ``reqs[i]``'s own slot (``mamba_pool_idx``) gets the state of
        ``nodes[i]`` (its matched ``last_node``), or zeros when that node holds none (a
        request starting from scratch). One copy and one zero fill for the whole batch.

        Returns the number of requests that got a cached state.
        Raises (nothing written): ``LengthMismatchError``; ``InvalidArgumentError`` /
        ``InvalidIndexError`` for a node not in this tree, or a request slot that is missing,
        out of range, free, repeated, or held by the tree.
        """
        nodes, reqs = list(nodes), list(reqs)
        if len(nodes) != len(reqs):
            raise LengthMismatchError(f"fork_states: {len(nodes)} nodes for {len(reqs)} requests")
        dst = self._check_slots([r.mamba_pool_idx for r in reqs], "request mamba_pool_idx")
        for node in nodes:
            self._check_node(node)
        slot_of = self._states.slot_of
        src_hit, dst_hit, miss = [], [], []
        for node, d in zip(nodes, dst):
            s = slot_of.get(node)
            if s is None:
                miss.append(d)
            else:
                src_hit.append(s)
                dst_hit.append(d)
        if src_hit:
            self._copy(src_hit, dst_hit)
        if miss:
            pool = self.mamba_pool
            if len(miss) == 1:
                self._views.zero(miss[0])
            else:
                m = torch.tensor(miss, dtype=torch.int64, device=pool.device)
                pool.conv_state[:, m] = 0
                pool.temporal_state[:, m] = 0
        return len(src_hit)

    def fork_state(self, node: TreeNode, req: CacheRequest) -> bool:
        """:meth:`fork_states` for one request (same checks, errors and effect, without the
        batch lists); True when it got a cached state."""
        states = self._states
        dst = states.check_slot(self.mamba_pool, req.mamba_pool_idx, "request mamba_pool_idx", self.checks)
        self._check_node(node)
        src = states.slot_of.get(node)
        if src is not None:
            self._views.copy(src, dst)
            return True
        self._views.zero(dst)
        return False

    # ------------------------------------------------------------------ insert
    def insert(self, key: RadixKey | object, value: Any, priority: int = 0, extra_key: Hashable = None,
               mamba_value: object = None) -> int:
        """RadixCache's insert, plus an optional state handed over with ``mamba_value`` (a
        slot holding the state after exactly ``len(key)`` tokens): see
        :meth:`insert_with_state`. Returns the tokens already cached."""
        return self.insert_with_state(key, value, mamba_value, priority, extra_key).prefix_len

    def insert_with_state(self, key: RadixKey | object, value: Any, state_slot: object = None,
                          priority: int = 0, extra_key: Hashable = None) -> MambaInsertResult:
        """Insert ``key`` (whole pages) with its KV rows ``value``; with ``state_slot``, hand
        that slot (the state after the key's last token) to the tree: kept at the node where
        the key ends when it holds no state, else freed. Ownership passes either way.

        Raises (the tree and the slot unchanged): as :meth:`RadixCache.insert`, plus
        ``InvalidArgumentError`` / ``InvalidIndexError`` for a slot out of range, free, or
        already the tree's. O(RadixCache.insert) + O(1).
        """
        if type(key) is not RadixKey or extra_key is not None:
            key = as_radix_key(key, extra_key)
        if state_slot is None:
            prefix, node, _ = self._insert_entry(self, key, value, priority, None, True)  # = self._insert
            return _tuple_new(MambaInsertResult, (prefix, node, False))
        states = self._states
        slot = states.check_slot(self.mamba_pool, state_slot, "state_slot", self.checks)
        if self._presort:
            self._sort_key = self._key_stated
            try:
                prefix, node, _ = self._insert_entry(self, key, value, priority, None, True)
            finally:
                self._sort_key = self._key_any
        else:
            prefix, node, _ = self._insert_entry(self, key, value, priority, None, True)
        if node.parent is not None and node not in states.slot_of:
            self._attach(node, slot, len(key._buf) >> 2)
            return _tuple_new(MambaInsertResult, (prefix, node, True))
        self.mamba_pool.free(slot)
        return _tuple_new(MambaInsertResult, (prefix, node, False))

    # ------------------------------------------------------------------ requests
    # returns whether the tree kept the state slot (RadixCache's returns None): SGLang's API.
    # The rules (slots handed over, forks, tracked states): ``docs/internals.md``, "Request
    # entry points of the hybrid tree".
    def cache_finished_req(  # type: ignore[override]
            self, req: CacheRequest, state_len: int | None = None) -> bool:
        """RadixCache's ``cache_finished_req``, and the state: when the request's state
        position (``state_len``, default ``kv_committed_len``) is the inserted key's end and
        that node holds no state, the tree takes ``req.mamba_pool_idx`` as it is (no copy).

        Returns True when the tree took the slot: the caller must then free the row with
        ``free(req, free_mamba_cache=False)`` and drop ``req.mamba_pool_idx`` (as
        ``release_kv_cache`` does); on False the slot is still the request's to free.
        Raises (nothing changes) as RadixCache's, plus for a bad slot or ``state_len``.
        """
        row, tokens, kv = self._request_rows(req)
        slot, pos = self._check_request(req, state_len)
        tracked = self._tracked_state(req)
        if self.disable:
            self._free_req_rows(kv)
            return False
        aligned, node, _, dup = self._insert_request(req, tokens, kv)
        self._free_req_rows(np.concatenate([dup, kv[aligned:]]))
        took = (slot is not None and pos == aligned and node.parent is not None
                and node not in self._states.slot_of and self.admission.admit(self, node, True))
        if took and slot is not None:  # (took implies a slot; the test narrows its type)
            self._attach(node, slot, aligned)
        elif pos != aligned and tracked is not None and 0 < tracked[1] <= aligned:
            self._fork_tracked(req, tokens, node, aligned, tracked, True)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        return took

    def cache_unfinished_req(self, req: CacheRequest, chunked: bool = False, state_len: int | None = None) -> None:
        """RadixCache's ``cache_unfinished_req``, and the state: at the end of the page-aligned
        inserted key (``state_len``, default ``kv_committed_len``), a node holding no state
        gets a fork of the request's state when the admission policy agrees (evicting one
        unpinned state if the pool is out; else it stays a tombstone); otherwise the KV goes
        in without a state. Raises (nothing changes) as :meth:`cache_finished_req`."""
        if self.disable:
            return
        _, tokens, _ = self._request_rows(req)
        slot, pos = self._check_request(req, state_len)
        tracked = self._tracked_state(req)
        RadixCache.cache_unfinished_req(self, req, chunked)
        node, aligned = req.last_node, req.cache_protected_len
        if slot is not None and pos == aligned:
            self._fork_into(node, slot, aligned, False)
        elif tracked is not None and 0 < tracked[1] <= aligned:
            self._fork_tracked(req, tokens, node, aligned, tracked, False)

    def _tracked_state(self, req: CacheRequest) -> tuple[int, int] | None:
        """(slot, position) of the state the request's last tracked step wrote into its
        ``mamba_ping_pong_track_buffer`` (the slot before ``mamba_next_track_idx``), or ``None``.
        Raises InvalidArgumentError for a position that is not a multiple of the page size."""
        pair = getattr(req, "mamba_ping_pong_track_buffer", None)
        pos = getattr(req, "mamba_last_track_seqlen", None)
        if not pair or pos is None:
            return None
        if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or pos < 0 or pos % self.page_size:
            raise InvalidArgumentError(f"request {req.rid!r}: mamba_last_track_seqlen {pos!r} is not a "
                                       f"page-aligned position (page size {self.page_size})")
        slot = pair[int(getattr(req, "mamba_next_track_idx", 0)) ^ 1]
        return self._states.check_slot(self.mamba_pool, slot, f"request {req.rid!r} track slot",
                                       self.checks), int(pos)

    def _fork_tracked(self, req: CacheRequest, tokens: np.ndarray, node: TreeNode,
                      aligned: int, tracked: tuple[int, int], finished: bool) -> None:
        """Fork the tracked state into the node ending at its position (``node`` when that is
        ``aligned``, else the ancestor split out there: the path is in the tree and locked)."""
        src, pos = tracked
        if pos != aligned:
            _, node, n = self._kv_match(self, RadixKey(tokens[:pos], req.extra_key))
            if n != pos:  # pragma: no cover - the path up to aligned was just inserted
                return
        self._fork_into(node, src, pos, finished)

    def _fork_into(self, node: TreeNode, slot: int, pos: int, finished: bool) -> None:
        """Copy the state in ``slot`` (at ``pos``) into a new tree slot at ``node`` when the node
        holds none and the admission policy agrees -- evicting one unpinned state if the pool is
        out; if none can be had the node stays a tombstone."""
        if node.parent is None or node in self._states.slot_of or not self.admission.admit(self, node, finished):
            return
        got = self.mamba_pool.alloc(1)
        if got is None:
            self.evict(0, 1)  # states only: node's KV stays, and it has no state to lose
            got = self.mamba_pool.alloc(1)
            if got is None:
                return
        new = int(got[0])
        self._copy([slot], [new])
        self._attach(node, new, pos)

    def _check_request(self, req: CacheRequest, state_len: int | None) -> tuple[int | None, int]:
        """Validate the request's slot, state position and lock; returns (slot, position)."""
        slot = req.mamba_pool_idx
        if slot is not None:
            slot = self._states.check_slot(self.mamba_pool, slot, f"request {req.rid!r} mamba_pool_idx",
                                           self.checks)
        pos = req.kv_committed_len if state_len is None else state_len
        if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or pos < 0:
            raise InvalidArgumentError(f"state_len must be an int >= 0, got {pos!r}")
        node = req.last_node
        if node is not None and node.parent is not None and self._states.pins.get(node, 0) < 1 \
                and not self.disable:
            raise InvalidArgumentError(f"request {req.rid!r}: its last_node {node.id} is not locked on itself")
        return slot, int(pos)

    # ------------------------------------------------------------------ evict
    # returns the KV tokens and the states freed (RadixCache's: the tokens), SGLang's API
    def evict(  # type: ignore[override]
            self, num_tokens: int, num_states: int = 0) -> MambaEvictResult:
        """Free at least ``num_tokens`` KV tokens (full order: unlocked leaves, tombstones
        first, each with its state, childless tombstone ancestors after them) and then at
        least ``num_states`` states (state order: each node becomes a tombstone, its KV
        stays, its state demoted to the host tier when on; states freed by the first part
        count, and go with their nodes), or all that can go. Rows go back in
        ONE allocator call, slots in ONE pool call. Raises InvalidArgumentError (nothing
        evicted) for a negative / non-int count. O(evicted nodes x log L) + the state
        order's victims (``lru``: O(log S) amortized per state; ``flop``: O(S log S)).
        """
        num_tokens = check_count(num_tokens, "num_tokens")
        num_states = check_count(num_states, "num_states")
        if self.disable:
            return MambaEvictResult(0, 0)
        rows: list[bytes] = []
        slots: list[int] = []
        tokens = self._evict_leaves(num_tokens, rows, slots) if num_tokens else 0
        states = self._states
        if len(slots) < num_states and states.evictable:
            self._evict_states(num_states - len(slots), slots)
        if slots:
            states.lru.maybe_compact(states.slot_of)  # dead entries of the states gone
        self._free_rows(rows)
        if slots:
            self.mamba_pool.free(slots)
        if tokens or slots:
            self._metrics.record_evict(tokens)
        return MambaEvictResult(tokens, len(slots))

    def _evict_leaves(self, num_tokens: int, rows: list[bytes], slots: list[int]) -> int:
        evicted = 0
        leaves, stale_key = self._leaves, self._sort_key if self._lazy else None
        while evicted < num_tokens:
            node = pop_victim(leaves, stale_key)
            if node is None:
                break
            evicted += self._remove_leaf(node, rows, slots)
        return evicted

    def _evict_states(self, k: int, slots: list[int]) -> None:
        """Tombstone the first ``k`` unpinned state nodes of the state order (their KV stays: a
        tombstone leaf is re-filed at the front of the full order); with the host tier each
        state is demoted there first (one batched copy), unless a load holds its only slots."""
        host, states = self._host, self._states
        demoted: list[tuple[TreeNode, int, int]] = []
        for node in self.state_order.victims(self, k):
            tier = host if host is not None and host.has_room() else None  # no room (a load holds it): dropped
            if tier is not None:  # the host slot first: events store it on CPU, then remove it from GPU
                hslot, gone = tier.demote(node, int(states.end[states.slot_of[node]]))
                if gone is not None:
                    self._host_state_dropped(gone)
            slot = states.detach(node)
            slots.append(slot)
            if tier is not None:
                demoted.append((node, hslot, slot))
            if node.skey is not None:  # a filed leaf: its full-order key dropped
                self._refile(node)
        if demoted:  # a slot the table took back (full) and gave out again goes to its last owner
            held = cast(HostStateTable, host).slot_of
            pairs = [(h, d) for node, h, d in demoted if held.get(node) == h]
            cast(HostStatePool, self.host_state_pool).store([h for h, _ in pairs], [d for _, d in pairs])

    def _host_state_dropped(self, node: TreeNode) -> None:
        """``node`` lost its host state to make room for another: a filed leaf is re-filed
        (its full-order key changed)."""
        if node.skey is not None:
            self._refile(node)

    # ``node: Any``: a TreeNode, then its ancestors up to a NamespaceHead (read as such: parent, extra_key)
    def _remove_leaf(self, node: Any, rows: list[bytes], slots: list[int]) -> int:
        """Unlink an unlocked, unfiled leaf (and its state), then every tombstone ancestor it
        leaves childless and unlocked; file a childless parent with a state. Returns tokens."""
        pb, events, on_evict, states = self._page_bytes, self.kv_events, self._on_evict, self._states
        host = self._host
        tokens = 0
        while True:
            parent = node.parent
            del parent.children[node.kbuf[:pb]]
            sync_only(parent)
            tokens += len(node.kbuf) >> 2
            rows.append(node.vbuf)
            if node in states.slot_of:
                slots.append(states.detach(node))
            elif host is not None and node in host.slot_of:
                host.drop(node)
            if on_evict is not None:
                on_evict(node)
            if events is not None:
                events.on_removed(node.block_hashes)
            if parent.children:
                break
            if parent.parent is None:
                if parent.extra_key is not None:  # an empty namespace goes away
                    del self._heads[parent.extra_key]
                break
            if parent.lock_ref:
                break
            if parent in states.slot_of or (host is not None and parent in host.slot_of):
                parent.skey = self._sort_key(parent)
                self._leaves.add(parent)
                break
            node = parent  # a childless, unlocked tombstone: useless, remove it too
        self._evictable -= tokens
        return tokens

    # ------------------------------------------------------------------ locks
    def inc_lock_ref(self, node: TreeNode) -> int:
        """RadixCache's lock of the path, plus a pin on ``node`` (its state is protected).
        Returns the change of ``evictable_size()``. O(depth)."""
        delta = RadixCache.inc_lock_ref(self, node)
        if not self.disable and node.parent is not None:
            self._states.pin(node)
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one :meth:`inc_lock_ref` of ``node``. Raises InvalidArgumentError (nothing
        changes) for a node not in this tree or not locked on itself. O(depth)."""
        if self.disable:
            return 0
        self._check_node(node)
        if node.parent is not None and self._states.pins.get(node, 0) < 1:
            raise InvalidArgumentError(f"dec_lock_ref on node {node.id}, which no inc_lock_ref locked")
        delta = RadixCache.dec_lock_ref(self, node)
        if node.parent is not None:
            self._states.unpin(node)
        return delta

    # ------------------------------------------------------------------ whole tree
    def reset(self) -> None:
        """Drop every node: rows to the allocator, state slots to the pool (one call each).
        With events: one ``StateRemoved`` naming every state, then ``AllBlocksCleared``."""
        slots = self.all_state_slots()
        events = self._states.events
        if events is not None and slots:
            slot_of: dict[Any, int] = self._states.slot_of  # TreeNodes whose block_hashes are set (events on)
            events.on_state_removed([n.block_hashes[-1] for n in slot_of])
        if events is not None and self._host is not None and len(self._host):
            hosted: dict[Any, int] = self._host.slot_of
            events.on_state_removed([n.block_hashes[-1] for n in hosted], MEDIUM_CPU)
        if slots:
            self.mamba_pool.free(slots)
        RadixCache.reset(self)

    def _clear_tree(self) -> None:
        RadixCache._clear_tree(self)
        self._states.clear()
        if self._host is not None:
            self._host.clear()

    # ------------------------------------------------------------------ audit
    def check_invariants(self, running_reqs: Sequence[HybridRunningRequest] | None = None) -> None:
        """RadixCache's audit, the state table's, and both conservation laws (KV slots given
        ``running_reqs``, Mamba slots); raises ``InvariantError`` naming ids (contract:
        :func:`radixkv.cache.hybrid.mamba_audit.check_slot_laws`)."""
        super().check_invariants()
        self._states.check(self._heads.values())
        if self._host is not None:
            self._host.check(node_depths(self._heads.values())[0], self._states.slot_of)
        mamba_audit.check_slot_laws(self, running_reqs)

    def check_state_conservation(self, running_reqs: Sequence[HybridRunningRequest] | None = None) -> StateConservation:
        """The Mamba slot law, exact (contract: :func:`radixkv.cache.hybrid.mamba_audit.check_state_conservation`)."""
        return mamba_audit.check_state_conservation(self, self._states, running_reqs)

    def pretty_print(self, max_tokens: int = 8) -> str:
        """RadixCache's print, each node's state slot, the counts (:func:`.mamba_audit.pretty_print`)."""
        return mamba_audit.pretty_print(self, self._states, RadixCache.pretty_print(self, max_tokens))

    # ------------------------------------------------------------------ helpers
    def _attach(self, node: TreeNode, slot: int, end: int) -> None:
        self._states.attach(node, slot, end)
        if self._host is not None and node in self._host.slot_of:  # a fresh device state replaces it
            self._host.drop(node)
        if not self._lazy and node.skey is not None:
            self._refile(node)  # its full-eviction key changed (tombstone -> state)

    def _copy(self, src: list[int], dst: list[int]) -> None:
        """Copy states ``src[i] -> dst[i]`` (validated disjoint by the callers): one pair
        with two slice copies, more with the state-copy kernel (Triton on CUDA)."""
        if len(src) == 1:
            self._views.copy(src[0], dst[0])
            return
        pool = self.mamba_pool
        s = torch.tensor(src, dtype=torch.int64, device=pool.device)
        d = torch.tensor(dst, dtype=torch.int64, device=pool.device)
        copy_states(pool.conv_state, pool.temporal_state, s, d, backend=pool.copy_backend, checks=False)

    def _check_slots(self, slots: Sequence[object], what: str) -> list[int]:
        """See :meth:`StateTable.check_slots` (with this cache's ``checks``)."""
        return self._states.check_slots(self.mamba_pool, slots, what, self.checks)
