"""``TieredMambaRadixCache``: a hybrid model's tree (:class:`MambaRadixCache`) whose
full-attention KV also lives in the host tier (a :class:`~radixkv.memory.host_kv_pool.HostKVPool`),
beside the host state tier. Nodes are :class:`~radixkv.cache.tiered_cache.TierNode`.

Rules (the story: docs/tiers.md, "Hybrid models: their KV in the host tier"): a device leaf
evicted with a state (either tier) or with host-only children is demoted, KV and state
together; a stateless leaf without host-only children is dropped (KV without a state is never
kept in the host); every host-only leaf holds a host state and no host-only node a device
state. A match walks host-only nodes and ends at the deepest state in any tier; ``load_back``
loads the path's host KV (all or nothing), then the state. Inserts adopt the request's rows
into the host-only nodes they reach. Host drops take whole LRU leaves with their state and the
stateless host-only ancestors they leave childless. ``write_through`` copies every new leaf to
the host at insert (a victim with a copy just frees its rows). KV events carry the tier, as
the KV-only tier's (docs/events.md, section 6). Storage (L3): :mod:`.state_storage` (backed up;
read past the tree as a host-only leaf, or within it as a host state; announced on ``CPU``).
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from radixkv.allocator.host_pages import HostPageAllocator
from radixkv.cache import tier_audit
from radixkv.cache.block_hash import Seed
from radixkv.cache.eviction import EvictionPolicy
from radixkv.cache.host_tier import HostTierMixin, check_write_policy
from radixkv.cache.hybrid.host_states import HostStateTable
from radixkv.cache.hybrid.mamba_audit import HybridRunningRequest
from radixkv.cache.hybrid.mamba_policies import FlopModel, StateAdmission, StateEvictionOrder
from radixkv.cache.hybrid.mamba_radix_cache import MambaMatchResult, MambaRadixCache
from radixkv.cache.hybrid.state_storage import StateStorageMixin
from radixkv.cache.hybrid.state_table import node_depths
from radixkv.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU
from radixkv.cache.leaf_eviction import pop_victim
from radixkv.cache.radix_insert import InsertMixin
from radixkv.cache.radix_key import RadixKey, as_radix_key
from radixkv.cache.rows import rows_tensor
from radixkv.cache.tiered_cache import TierNode
from radixkv.cache.tree_node import TreeNode, sync_only
from radixkv.contracts import KVAllocator, ReqToTokenTable, StatePool
from radixkv.errors import InvalidArgumentError, InvariantError, describe_ids
from radixkv.memory.host_kv_pool import HostKVPool
from radixkv.memory.host_state_pool import HostStatePool
from radixkv.validation import check_count

if TYPE_CHECKING:
    from radixkv.storage.tier_controller import StorageController

__all__ = ["TieredMambaRadixCache"]
_I32 = np.dtype(np.int32)
_tuple_new = tuple.__new__


class TieredMambaRadixCache(StateStorageMixin, HostTierMixin, MambaRadixCache):
    """A MambaRadixCache with a host KV tier (``host_pool``) beside its host state tier
    (``host_state_pool``, required: a host-only node needs somewhere to keep its state).

    Args as :class:`MambaRadixCache` (no compiled paths), plus ``write_policy`` (one of
    :data:`~radixkv.contracts.WRITE_POLICIES`), ``storage`` (a started StorageController or
    ``None``) and ``layout_fingerprint`` (seeds its page keys,
    :mod:`.state_storage`). Costs on top: a match O(path); a demotion one batched KV copy per
    ``evict`` call (none for nodes with a host copy) plus one state copy per state; a load back
    one batched KV copy and one state copy; ``write_through`` one KV copy per insert that makes
    a leaf; a host drop O(log H) per leaf.
    """

    def __init__(self, req_to_token_pool: ReqToTokenTable | None,
                 token_to_kv_pool_allocator: KVAllocator | None, *, host_pool: HostKVPool,
                 host_state_pool: HostStatePool, page_size: int = 1,
                 eviction_policy: str | EvictionPolicy = "lru", admission_policy: str | StateAdmission = "every",
                 mamba_pool: StatePool | None = None, state_eviction_policy: str | StateEvictionOrder = "lru",
                 flop_model: FlopModel | None = None, disable: bool = False, metrics_window: int = 1000,
                 checks: bool = True, write_policy: str = "write_back", enable_kv_events: bool = False,
                 kv_event_seed: Seed | None = None, storage: StorageController | None = None,
                 layout_fingerprint: str = "") -> None:
        write_policy = check_write_policy(write_policy)
        if not isinstance(host_pool, HostKVPool) or host_pool.kv_pool.page_size != page_size:
            raise InvalidArgumentError("host_pool must be a HostKVPool of the cache's page size")
        if not isinstance(host_state_pool, HostStatePool):
            raise InvalidArgumentError("a hybrid host KV tier needs a host state tier (host_state_pool)")
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, eviction_policy,
                         admission_policy, enable_kv_events, mamba_pool=mamba_pool,
                         state_eviction_policy=state_eviction_policy, flop_model=flop_model, disable=disable,
                         metrics_window=metrics_window, checks=checks, host_state_pool=host_state_pool,
                         native=False, kv_event_seed=kv_event_seed)
        self._new_node = TierNode
        self._insert_entry = _insert_tiered
        self.host_pool = host_pool
        self.host_alloc = HostPageAllocator(host_pool.num_pages)
        self.write_policy = write_policy
        self._hstates = cast(HostStateTable, self._host)
        self._host_tokens = 0
        self._dups: dict[int, TierNode] = {}  # (write_back gives a loaded node's host copy up at once)
        self._pinned: set[int] = set()  # node ids host drops must not take (loads, demotions in flight)
        self._host_heap: list[tuple[int, int, TierNode]] = []  # (last_access, id, host-only leaf)
        #: tokens hit per tier (device: up to the device state; host: past it) and traffic in pages
        self.tier_hits = {"device": 0, "host": 0, "storage": 0}
        self.tier_stats = {"loaded_pages": 0, "demoted_pages": 0, "host_dropped_pages": 0,
                           "written_through_pages": 0, "load_ns": 0}
        self._init_storage(storage, layout_fingerprint)

    def tier_counters(self) -> dict[str, int]:
        """The host KV tier's figures (usage and hits in tokens, traffic in pages). O(1)."""
        out = {"host_capacity_tokens": self.host_capacity(), "host_used_tokens": self._host_tokens,
               "page_bytes": self.host_pool.page_bytes}
        out.update({f"hit_tokens_{k}": v for k, v in self.tier_hits.items()})
        out.update(self.tier_stats)
        if self.storage is not None:
            out.update({f"storage_{k}": v for k, v in self.storage.stats.snapshot().items()})
            out.update(self.storage_stats)
        return out

    # ------------------------------------------------------------------ match, load back
    def match_prefix(  # type: ignore[override]
            self, key: RadixKey | object, extra_key: Hashable = None) -> MambaMatchResult:
        """MambaRadixCache's match over both tiers: ``last_node`` / ``prefix_len`` / rows up
        to the deepest device state; ``host_node`` / ``host_len`` to the deepest state in any
        tier when deeper (its KV may be on the host); ``kv_prefix_len`` the KV match over
        both tiers. Touches and splits as RadixCache's; with storage, what it holds past the
        tree continues the path, a state it holds for the path's stateless tail ends the hit
        there (:meth:`_storage_fetch`). O(path + tokens)."""
        if type(key) is not RadixKey or extra_key is not None:
            key = as_radix_key(key, extra_key)
        buf = key._buf
        n = len(buf) - len(buf) % self._page_bytes
        head = self._heads.get(key.extra_key)
        if n == 0 or self.disable or (head is None and self.storage is None):
            self._metrics.record_query(len(buf) >> 2, 0)
            return _tuple_new(MambaMatchResult, (torch.empty(0, dtype=torch.int64, device=self.device),
                                                 head if head is not None else self._heads[None], 0, 0, 0, None,
                                                 0))
        path, pos = self._walk(head, buf, n) if head is not None else ([], 0)
        got = None
        if self.storage is not None:
            path, pos, got = self._storage_fetch(key, head, path, pos, n)
            head = self._heads.get(key.extra_key)
        if head is None:
            head = self._heads[None]
        dev, hosted = self._states.slot_of, self._hstates.slot_of
        last: TreeNode = head
        s = depth = best = 0
        deepest: TreeNode | None = None
        vals: list[bytes] = []
        for x in path:
            depth += len(x.kbuf) >> 2
            if x.vbuf:  # device nodes lead the path (the device part is prefix-closed)
                vals.append(x.vbuf)
            if x in dev:  # a device state sits on a device node
                last, s = x, depth
            if x in dev or x in hosted:
                deepest, best = x, depth
        hnode = deepest if best > s else None
        rows = rows_tensor(b"".join(vals)[:s * 4], self.device) if s else torch.empty(
            0, dtype=torch.int64, device=self.device)
        hit = best if hnode is not None else s
        stored = len(got.kbuf) >> 2 if got is not None and hnode is got else 0
        if self.storage is not None and self.storage.admit == "reused" and last.hits >= 2:
            self._storage_backup(last)
        self._metrics.record_query(len(buf) >> 2, hit)
        self.tier_hits["device"] += s
        self.tier_hits["host"] += hit - s - stored
        self.tier_hits["storage"] += stored
        if hnode is not None:
            self._hstates.stats["hits"] += 1
            self._hstates.stats["hit_tokens"] += hit - s
        return _tuple_new(MambaMatchResult, (rows, last, s, pos >> 2, hit - s, hnode, stored))

    def load_back(self, m: MambaMatchResult) -> MambaMatchResult:
        """Load ``m.host_node``'s path: its host-only nodes' KV into fresh device rows (all or
        none; evicting outside the path), then its state into a device slot; returns the
        match grown to that node, or ``m`` when rows or a slot cannot be had (KV loaded
        stays) or the tree changed since the match. O(path) + one KV and one state copy."""
        node = m.host_node
        hosted = self._hstates.slot_of
        if node is None or not m.host_len or self.disable or node not in hosted:
            return m
        path: list[Any] = []
        x: Any = node
        while x is not m.last_node:
            if x.parent is None or not self._in_tree(x):
                return m
            path.append(x)
            x = x.parent
        path.reverse()
        cold = [y for y in path if not y.vbuf]  # a suffix of the path (the device part is prefix-closed)
        anchor = path[len(path) - len(cold) - 1] if len(cold) < len(path) else m.last_node
        locked = anchor.parent is not None
        if locked:
            self.inc_lock_ref(anchor)  # the device part of the path stays while rows are found
        ids = [y.id for y in cold]
        self._pinned.update(ids)
        t0 = time.perf_counter_ns()
        hslot, end = self._hstates.take(node)  # out of the table: no drop can take it
        try:
            if not self._load_kv(cold):
                self._hstates.put(node, hslot, end)
                return m
            got = self.mamba_pool.alloc(1)
            if got is None:
                self.evict(0, 1)
                got = self.mamba_pool.alloc(1)
            if got is None:
                self._hstates.put(node, hslot, end)
                return m
            slot = int(got[0])
            cast(HostStatePool, self.host_state_pool).load([hslot], [slot])
            self._attach(node, slot, end)
            self._hstates.release(node, hslot)
        finally:
            self._pinned.difference_update(ids)
            if locked:
                self.dec_lock_ref(anchor)
            self.tier_stats["load_ns"] += time.perf_counter_ns() - t0
        idx = torch.cat([m.device_indices.to(self.device, torch.int64),
                         rows_tensor(b"".join(y.vbuf for y in path), self.device)])
        return _tuple_new(MambaMatchResult, (idx, node, m.prefix_len + m.host_len, m.kv_prefix_len, 0, None, 0))

    def _load_kv(self, cold: list[Any]) -> bool:
        """Give the host-only nodes ``cold`` (a chain, pinned) device rows with one batched
        copy from their host pages, which are then freed (``write_back``) or kept as a clean
        copy (``write_through``); False (nothing loaded) when the rows cannot be had."""
        if not cold:
            return True
        alloc = self.token_to_kv_pool_allocator
        if alloc is None:
            return False
        tot = sum(len(y.kbuf) >> 2 for y in cold)
        while alloc.available_size() < tot and self._evictable:
            if not self.evict(tot - alloc.available_size()).num_tokens:
                break
        rows = alloc.alloc(tot)
        if rows is None:
            return False
        pages = np.frombuffer(b"".join(y.hbuf for y in cold), _I32)
        ev = self.host_pool.load(torch.from_numpy(pages.astype(np.int64)), rows.to(self.device, torch.int64))
        if ev is not None:
            ev.synchronize()
        rb = rows.to("cpu").numpy().astype(_I32).tobytes()
        off = 0
        for y in cold:
            t = len(y.kbuf)
            y.vbuf = rb[off:off + t]
            off += t
            self._moved(y, MEDIUM_GPU)
            if self.write_policy == "write_back":
                self._drop_host_copy(y)
            self._evictable += t >> 2
            if self._on_insert is not None:
                self._on_insert(y)
            parent = y.parent
            if parent.skey is not None:  # it has a device child now
                self._leaves.remove(parent)
                parent.skey = None
        self._file_if_leaf(cold[-1])
        self.tier_stats["loaded_pages"] += int(pages.size)
        return True

    def _attach(self, node: TreeNode, slot: int, end: int) -> None:
        """MambaRadixCache's; with storage (admit ``all``) the state and its path's pages are
        backed up."""
        super()._attach(node, slot, end)
        if self.storage is not None and self.storage.admit == "all":
            self._storage_backup(node)

    # ------------------------------------------------------------------ evict
    def _evict_leaves(self, num_tokens: int, rows: list[bytes], slots: list[int]) -> int:
        """MambaRadixCache's KV eviction with demotion: a victim with a state (either tier)
        or host-only children goes to the host, KV and state (one batched KV copy for the
        call; none for a victim with a host copy); else, or with no host room, it is dropped
        with its host-only subtree (and its host copy)."""
        evicted = 0
        leaves, stale_key = self._leaves, self._sort_key if self._lazy else None
        demoted: list[tuple[Any, np.ndarray, bytes]] = []
        moved: list[Any] = []
        while evicted < num_tokens:
            node = pop_victim(leaves, stale_key)
            if node is None:
                break
            if self._demote(node, rows, slots, demoted):
                moved.append(node)
                evicted += len(node.kbuf) >> 2
            else:
                evicted += self._drop_device(node, rows, slots)
        self._copy_demoted(demoted)
        self._pinned.difference_update(y.id for y in moved)
        for y in moved:  # one whose host state a later demotion took is a tombstone leaf now
            self._prune(y)
        return evicted

    def _demote(self, node: Any, rows: list[bytes], slots: list[int],
                demoted: list[tuple[Any, np.ndarray, bytes]]) -> bool:
        dev, hosted = self._states.slot_of, self._hstates.slot_of
        if node not in dev and node not in hosted and not node.children:
            return False
        if node in dev and not self._hstates.has_room():  # a load holds the host slots: dropped
            return False
        t = len(node.kbuf) >> 2
        self._pinned.add(node.id)
        if node.hbuf is None:  # else a clean copy (write_through): its rows are just freed
            pages = self._host_alloc(t // self.page_size)  # may drop node's own host-only children
            if pages is not None and node not in dev and node not in hosted and not node.children:
                self.host_alloc.free(pages)
                pages = None
            if pages is None:
                self._pinned.discard(node.id)
                return False
            node.hbuf = pages.tobytes()
            self._host_tokens += t
            demoted.append((node, pages, node.vbuf))
        self._moved(node, MEDIUM_CPU)
        if node in dev:  # the state goes with the KV (host slot first, then the device slot freed)
            hslot, gone = self._hstates.demote(node, int(self._states.end[dev[node]]))
            slot = self._states.detach(node)
            cast(HostStatePool, self.host_state_pool).store([hslot], [slot])
            slots.append(slot)
            if gone is not None:
                self._host_state_dropped(gone)
        rows.append(node.vbuf)
        node.vbuf = b""
        if self._on_evict is not None:
            self._on_evict(node)
        self._evictable -= t
        if not node.children:
            heapq.heappush(self._host_heap, (node.last_access, node.id, node))
        self._file_if_leaf(node.parent)
        return True

    def _drop_device(self, node: Any, rows: list[bytes], slots: list[int]) -> int:
        """Drop a device leaf, its host-only subtree first, and the host copies of the nodes
        that leave with it; file the ancestor left standing if it is a device leaf now.
        Returns the device tokens freed."""
        for c in list(node.children.values()):
            self._drop_subtree(c)
        tokens = self._remove_leaf(node, rows, slots)
        self._drop_host_copy(node)
        x = node.parent
        while x.parent is not None and not self._in_tree(x):
            self._drop_host_copy(x)
            x = x.parent
        self._file_if_leaf(x)
        return tokens

    def _drop_subtree(self, top: Any) -> int:
        """Unlink the host-only node ``top`` and its subtree, freeing their host pages and
        host states (KV events: their states, then their pages). Returns the host pages freed."""
        stack, freed, order = [top], 0, []
        while stack:
            y = stack.pop()
            stack.extend(y.children.values())
            if y.children:  # unlinked from its dropped parent too: ``_in_tree`` is False for it
                y.children, y.only = {}, None
            order.append(y)
            if y.hbuf is not None:
                freed += len(y.hbuf) >> 2
                self._drop_host_copy(y)
            if y in self._hstates.slot_of:
                self._hstates.drop(y)
        self._record_removed(order)
        parent = top.parent
        del parent.children[top.kbuf[:self._page_bytes]]
        sync_only(parent)
        self.tier_stats["host_dropped_pages"] += freed
        return freed

    def evict_host(self, num_pages: int) -> int:
        """Drop host-only leaves (least recently used first, pinned ones kept), each with its
        host state and the stateless host-only ancestors it leaves childless, until
        ``num_pages`` host pages are freed or none is left. Returns the pages freed."""
        return self._drop_lru_host_leaves(check_count(num_pages, "num_pages"), 0, self._drop_host_leaf)

    def _drop_host_leaf(self, node: Any, _want: int = 0) -> int:
        """Drop the host-only leaf ``node`` whole (its state is at its end), then prune.
        Returns the host pages freed."""
        parent = node.parent
        freed = self._drop_subtree(node)
        return freed + self._prune(parent)

    def _prune(self, node: Any) -> int:
        """Drop ``node`` if it is a host-only leaf without a host state (useless), and so up
        its host-only ancestors; a host-only leaf with a state is queued for host drops; an
        emptied namespace goes. Returns the host pages freed."""
        freed = 0
        while node.parent is not None and self._in_tree(node) and not node.vbuf and not node.children:
            if node in self._hstates.slot_of:
                heapq.heappush(self._host_heap, (node.last_access, node.id, node))
                return freed
            if node.id in self._pinned:
                return freed
            parent = node.parent
            freed += self._drop_subtree(node)
            node = parent
        ns = node.extra_key if node.parent is None else None
        if ns is not None and not node.children and self._heads.get(ns) is node:
            del self._heads[ns]
        return freed

    def _host_state_dropped(self, node: TreeNode) -> None:
        """MambaRadixCache's; a host-only leaf left without a state is dropped."""
        super()._host_state_dropped(node)
        self._prune(node)

    # ------------------------------------------------------------------ whole tree
    def reset(self) -> None:
        """MambaRadixCache's reset; every host page goes back too."""
        owned = [x.hbuf for x in self.iter_nodes() if isinstance(x, TierNode) and x.hbuf]
        if owned:
            self.host_alloc.free(np.frombuffer(b"".join(owned), _I32))
        self._host_heap.clear()
        self._host_tokens = 0
        super().reset()

    def check_invariants(self, running_reqs: Sequence[HybridRunningRequest] | None = None) -> None:
        """Both tiers' KV audit (:func:`radixkv.cache.tier_audit.check`: host pages owned once,
        none leaked), the state tables against both tiers (device states on device nodes
        only, every host-only leaf holding a host state, host slots owned once) and the slot
        laws; raises ``InvariantError`` naming nodes, pages or slots."""
        from radixkv.cache.hybrid import mamba_audit

        tier_audit.check(self, self._heads, self._leaves, self._pinned)
        self._states.check(self._heads.values())
        self._hstates.check(node_depths(self._heads.values())[0], self._states.slot_of)
        cold = [n.id for n in self._states.slot_of if not n.vbuf]
        if cold:
            raise InvariantError(f"TieredMambaRadixCache: nodes {describe_ids(cold)} hold a device state "
                                 "but no device KV")
        bare = [x.id for x in self.iter_nodes() if x.parent is not None and not x.vbuf and not x.children
                and x not in self._hstates.slot_of]
        if bare:
            raise InvariantError(f"TieredMambaRadixCache: host-only leaves without a state kept (tombstones "
                                 f"not removed): nodes {describe_ids(bare)}")
        mamba_audit.check_slot_laws(self, running_reqs)
        if self.storage is not None:
            self.storage.check_invariants()


def _insert_tiered(cache: TieredMambaRadixCache, key: RadixKey | object, value: Any, priority: int = 0,
                   extra_key: Hashable = None, _path: bool = False) -> Any:
    """The tree's insert entry (its ``_insert_entry``): the host-only nodes on the key's path
    take the caller's rows first (``_revive``), then InsertMixin's insert; a new leaf is
    copied to the host (``write_through``)."""
    if type(key) is not RadixKey or extra_key is not None:
        key = as_radix_key(key, extra_key)
    if not cache.disable:
        cache._revive(key, value)
    res = InsertMixin.insert(cache, key, value, priority, None, True)
    prefix, node, _ = res
    if prefix < (len(key._buf) >> 2) and isinstance(node, TierNode):
        cache._write_through(node)
    return res if _path else prefix
