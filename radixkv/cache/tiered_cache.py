"""``TieredRadixCache``: a RadixCache whose nodes live on the device (L1), in host memory
(L2, a :class:`~radixkv.memory.host_kv_pool.HostKVPool`) or both, with an optional storage
tier (L3, a :class:`~radixkv.storage.tier_controller.StorageController`) behind them: SGLang's
HiRadixCache on this tree (the story: ``docs/tiers.md``).

A :class:`TierNode` keeps ``vbuf`` (device rows, empty when not on the device) and ``hbuf``
(host page ids, ``None`` when not on the host). Invariants: every node is on a tier; the device
part of the tree is prefix-closed; sizes count device tokens; only device nodes are locked.
``match_prefix`` walks both tiers (then asks storage, bounded by its timeout); ``load_back``
copies host pages into device rows in one batch (write-back: they keep their host copy, the
first host pages given up); ``evict`` demotes device leaves to the host (or just drops their
rows when the host has them); host eviction drops LRU host-only pages, page-exact.
No compiled paths: with the host tier off a cache is a plain RadixCache (speed unchanged).
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from radixkv.allocator.host_pages import HostPageAllocator
from radixkv.cache import tier_audit
from radixkv.cache.block_hash import encode_extra_key
from radixkv.cache.eviction import EvictionPolicy
from radixkv.cache.host_tier import HostTierMixin, check_write_policy
from radixkv.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU
from radixkv.cache.leaf_eviction import pop_victim
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.radix_insert import InsertMixin
from radixkv.cache.radix_key import RadixKey, as_radix_key
from radixkv.cache.rows import rows_tensor
from radixkv.cache.tree_node import NamespaceHead, TreeNode, sync_only
from radixkv.contracts import KVAllocator, ReqToTokenTable
from radixkv.errors import InvalidArgumentError
from radixkv.memory.host_kv_pool import HostKVPool
from radixkv.storage.keys import page_keys, storage_seed
from radixkv.validation import check_count

if TYPE_CHECKING:
    from radixkv.cache.block_hash import Seed
    from radixkv.storage.tier_controller import StorageController

__all__ = ["TieredRadixCache", "TierNode", "TierMatch"]
_I32 = np.dtype(np.int32)


class TierNode(TreeNode):
    """A tree node that knows its tiers: ``hbuf`` (int32 host page ids, one per page, or
    ``None``), ``pkeys`` (storage page keys when storage is on) and ``backed`` (its pages
    were queued to storage)."""

    __slots__ = ("hbuf", "pkeys", "backed")

    def __init__(self, node_id: int, parent: TreeNode | None, kbuf: bytes, vbuf: bytes,
                 tick: int = 0, priority: int = 0):
        super().__init__(node_id, parent, kbuf, vbuf, tick, priority)
        self.hbuf: bytes | None = None
        self.pkeys: list[str] | None = None
        self.backed = False


class TierMatch(NamedTuple):
    """A match over the tiers: ``device_indices`` / ``last_node`` / ``prefix_len`` as
    :class:`~radixkv.cache.radix_cache.MatchResult` (the device part); then ``host_len``
    tokens in ``host_nodes`` (host-only nodes continuing the path), of which ``storage_len``
    were read from storage by this match."""

    device_indices: torch.Tensor
    last_node: TreeNode
    prefix_len: int
    host_len: int = 0
    storage_len: int = 0
    host_nodes: tuple[TierNode, ...] = ()

    @property
    def last_device_node(self) -> TreeNode:
        return self.last_node


class TieredRadixCache(HostTierMixin, RadixCache):
    """A RadixCache over a device pool, a host tier and optionally storage.

    Args (beyond RadixCache's): ``host_pool`` (the host buffer; its page count is the tier's
    size), ``write_policy`` (one of :data:`~radixkv.contracts.WRITE_POLICIES`), ``storage`` (a started
    StorageController or ``None``), ``layout_fingerprint`` (seeds the storage keys).
    """

    def __init__(self, req_to_token_pool: ReqToTokenTable | None,
                 token_to_kv_pool_allocator: KVAllocator | None, *, host_pool: HostKVPool,
                 page_size: int = 1, eviction_policy: str | EvictionPolicy = "lru",
                 write_policy: str = "write_back", storage: StorageController | None = None,
                 layout_fingerprint: str = "", disable: bool = False, enable_kv_events: bool = False,
                 kv_event_seed: Seed | None = None, metrics_window: int = 1000) -> None:
        write_policy = check_write_policy(write_policy)
        if not isinstance(host_pool, HostKVPool) or host_pool.kv_pool.page_size != page_size:
            raise InvalidArgumentError("host_pool must be a HostKVPool of the cache's page size")
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, eviction_policy,
                         disable, enable_kv_events, kv_event_seed, metrics_window, native=False)
        self._new_node = TierNode
        self._insert_entry = TieredRadixCache.insert
        self.host_pool = host_pool
        self.host_alloc = HostPageAllocator(host_pool.num_pages)
        self.write_policy = write_policy
        self.storage = storage
        self._fingerprint = layout_fingerprint
        self._seeds: dict[Hashable, bytes] = {}
        self._host_heap: list[tuple[int, int, TierNode]] = []  # (last_access, id, host-only leaf)
        self._pinned: set[int] = set()  # node ids host eviction must not drop (loads, stores in flight)
        self._inflight: list[Any] = []  # CUDA events of loads the worker must not read past
        self._dups: dict[int, TierNode] = {}  # write_back: loaded nodes keeping a host copy, oldest first
        self._parked: list[tuple[np.ndarray, Any]] = []  # (host pages, event): late storage reads' destinations
        self._host_tokens = 0
        #: tokens hit per tier by matches, and tier traffic in pages
        self.tier_hits = {"device": 0, "host": 0, "storage": 0}
        self.tier_stats = {"loaded_pages": 0, "demoted_pages": 0, "host_dropped_pages": 0,
                           "written_through_pages": 0, "load_ns": 0}

    # ------------------------------------------------------------------ sizes
    def tier_counters(self) -> dict[str, int]:
        """Every tier's figures (usage in tokens, hits in tokens, traffic in pages and bytes,
        load time in ns; storage counters when on), for metrics. O(1)."""
        out = {"host_capacity_tokens": self.host_capacity(), "host_used_tokens": self._host_tokens,
               "page_bytes": self.host_pool.page_bytes}
        out.update({f"hit_tokens_{k}": v for k, v in self.tier_hits.items()})
        out.update(self.tier_stats)
        if self.storage is not None:
            out.update({f"storage_{k}": v for k, v in self.storage.stats.snapshot().items()})
        return out

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: RadixKey | object, extra_key: Hashable = None) -> TierMatch:  # type: ignore[override]
        """The longest cached page-aligned prefix of ``key`` over every tier: its device
        part (rows, last device node) and the host-only nodes after it; with storage, the
        pages after those that storage holds are read (at most its timeout) into a new host
        node. Touches every node on the path; counts hits per tier. O(path + tokens)."""
        if type(key) is not RadixKey or extra_key is not None:
            key = as_radix_key(key, extra_key)
        buf = key._buf
        pb = self._page_bytes
        n = len(buf) - len(buf) % pb
        head = self._heads.get(key.extra_key)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        if n == 0 or self.disable or (head is None and self.storage is None):
            self._metrics.record_query(len(buf) >> 2, 0)
            return TierMatch(empty, head if head is not None else self._heads[None], 0)
        path, pos = self._walk(head, buf, n) if head is not None else ([], 0)
        node: TreeNode | None = path[-1] if path else head
        dev_node: TreeNode | None = head
        dev_pos = 0
        vals: list[bytes] = []
        hosts: list[TierNode] = []
        for child in path:
            if self.storage is not None and self.storage.admit == "reused" and child.hits >= 2:
                self._backup(child)
            if child.vbuf and not hosts:
                vals.append(child.vbuf)
                dev_node, dev_pos = child, dev_pos + len(child.kbuf)
            else:
                hosts.append(child)
        stored = 0
        if self.storage is not None and pos < n:
            got = self._fetch(key, node, pos, n)
            if got is not None:
                hosts.append(got)
                stored = len(got.kbuf) >> 2
                pos += len(got.kbuf)
        if dev_node is None:
            dev_node = self._heads.get(key.extra_key) or self._heads[None]
        self._metrics.record_query(len(buf) >> 2, pos >> 2)
        host_len = (pos - dev_pos) >> 2
        self.tier_hits["device"] += dev_pos >> 2
        self.tier_hits["host"] += host_len - stored
        self.tier_hits["storage"] += stored
        rows = rows_tensor(b"".join(vals), self.device) if vals else empty
        return TierMatch(rows, dev_node, dev_pos >> 2, host_len, stored, tuple(hosts))

    # ------------------------------------------------------------------ load back
    def load_back(self, m: TierMatch) -> TierMatch:
        """Load the leading host nodes of ``m`` that fit into device rows (evicting device
        leaves outside the path if needed) with one batched copy; returns the match grown
        by them. The path stays the tree's (unlocked) afterwards: lock it as usual. On CUDA
        the copy runs on a side stream: :meth:`wait_loads` before a worker reads the rows."""
        alloc = self.token_to_kv_pool_allocator
        if not m.host_len or alloc is None:
            return m
        t0 = time.perf_counter_ns()
        self._check_node(m.last_node)
        nodes: list[TierNode] = []
        prev: TreeNode = m.last_node
        for x in m.host_nodes:  # the leading ones still hanging below the device part
            if x.hbuf is None or x.vbuf or x.parent is not prev:
                break
            nodes.append(x)
            prev = x
        locked = m.last_node.parent is not None
        if locked:
            self.inc_lock_ref(m.last_node)
        self._pinned.update(x.id for x in nodes)
        t0 = time.perf_counter_ns()
        try:
            room = alloc.available_size() + self._evictable  # the path is locked: not in it
            take: list[TierNode] = []
            tot = 0
            for x in nodes:
                t = len(x.kbuf) >> 2
                if tot + t > room:
                    break
                take.append(x)
                tot += t
            if not take:
                return m
            pages = torch.from_numpy(np.frombuffer(b"".join(x.hbuf or b"" for x in take), _I32).astype(np.int64))
            src = None
            if self.write_policy == "write_back":
                demote = -(-max(tot - alloc.available_size(), 0) // self.page_size)  # host pages it needs
                short = demote - self.host_alloc.available_size()
                if short > 0 and self._drop_dup_copies(short) < short:
                    # a swap (both tiers full): their pages take the demoted ones, so copy them out first
                    src = self.host_pool.snapshot(pages)
                    for x in take:
                        self._drop_host_copy(x)
            while alloc.available_size() < tot and self._evictable:  # rows a node frees may be fewer than
                if not self.evict(tot - alloc.available_size()):   # its tokens (an allocator's virtual rows)
                    break
            rows = alloc.alloc(tot)
            if rows is None:  # evict() freed less than it could: these nodes are on no tier
                for x in take:
                    if x.hbuf is None and x.parent is not None:
                        self._drop(x)
                        break
                return m
            # one pass from the host pages, pinned meanwhile (a snapshot when the swap needed one)
            ev = self.host_pool.load(pages, rows) if src is None else self.host_pool.load_from(src, rows)
            if ev is not None:
                self._inflight.append(ev)
            rb = rows.to("cpu", torch.int64).numpy().astype(_I32).tobytes()
            off = 0
            for x in take:
                size = len(x.kbuf)
                x.vbuf = rb[off:off + size]
                off += size
                self._moved(x, MEDIUM_GPU)
                if self._on_insert is not None:  # back on the device: the policy sees it anew
                    self._on_insert(x)
                if x.hbuf is not None and self.write_policy == "write_back":  # a clean copy: given up first
                    self._dups[x.id] = x
            self._evictable += tot
            self._file_if_leaf(take[-1])
            self.tier_stats["loaded_pages"] += tot // self.page_size
        finally:
            self._pinned.difference_update(x.id for x in nodes)
            if locked:
                self.dec_lock_ref(m.last_node)
            self.tier_stats["load_ns"] += time.perf_counter_ns() - t0
        dev = torch.cat([m.device_indices, rows.to(self.device, torch.int64)])
        rest = tuple(x for x in m.host_nodes if x not in take)
        return TierMatch(dev, take[-1], m.prefix_len + tot, m.host_len - tot, m.storage_len, rest)

    def wait_loads(self) -> None:
        """Block until every load issued so far has completed (CUDA; a no-op on CPU)."""
        if self._inflight:
            t0 = time.perf_counter_ns()
            for ev in self._inflight:
                ev.synchronize()
            self._inflight.clear()
            self.tier_stats["load_ns"] += time.perf_counter_ns() - t0

    # ------------------------------------------------------------------ insert
    def insert(self, key: RadixKey | object, value: Any, priority: int = 0, extra_key: Hashable = None,
               _path: bool = False) -> Any:
        """RadixCache's ``insert``; host-only nodes on the key's path take the caller's rows
        (they are on the device again, and those rows are the tree's: not duplicates). The
        new leaf is copied to the host (``write_through``) and queued to storage (admit
        ``all``). Raises as RadixCache's insert, the tree unchanged."""
        if type(key) is not RadixKey or extra_key is not None:
            key = as_radix_key(key, extra_key)
        if type(priority) is not int and (isinstance(priority, bool)
                                          or not isinstance(priority, (int, np.integer))):
            raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
        if not self.disable:
            self._revive(key, value)
        res = InsertMixin.insert(self, key, value, priority, None, True)
        prefix, node, _ = res
        if prefix < (len(key._buf) >> 2) and isinstance(node, TierNode):
            self._on_new_leaf(node)
        return res if _path else prefix

    def _on_new_leaf(self, leaf: TierNode) -> None:
        if self.storage is not None:
            parent: Any = leaf.parent
            prior = parent.pkeys[-1] if isinstance(parent, TierNode) and parent.pkeys else None
            leaf.pkeys = page_keys(leaf.key.copy(), self.page_size, self._seed(leaf), prior)
            if self.storage.admit == "all":
                self._backup(leaf)
        self._write_through(leaf)

    # ------------------------------------------------------------------ evict
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens (whole nodes, policy order): a victim
        with a host copy just gives up its rows; else it is demoted (host pages, one batched
        copy for the call) or, when the host has no room, dropped with its host-only subtree.
        All freed rows go back in ONE allocator call. Returns the device tokens freed."""
        num_tokens = check_count(num_tokens, "num_tokens")
        if self.disable or num_tokens == 0 or not self._leaves:
            return 0
        freed: list[bytes] = []
        demoted: list[tuple[TierNode, np.ndarray, bytes]] = []  # copied once the loop is done
        pinned: list[int] = []
        evicted = 0
        stale_key = self._sort_key if self._lazy else None
        while evicted < num_tokens:
            node: Any = pop_victim(self._leaves, stale_key)
            if node is None:
                break
            t = len(node.kbuf) >> 2
            if node.hbuf is None:
                pages = self._host_alloc(t // self.page_size)
                if pages is not None:
                    node.hbuf = pages.tobytes()
                    self._host_tokens += t
                    demoted.append((node, pages, node.vbuf))
                    self._pinned.add(node.id)
                    pinned.append(node.id)
            freed.append(node.vbuf)
            node.vbuf = b""
            if self._on_evict is not None:
                self._on_evict(node)
            parent: Any = node.parent
            if node.hbuf is not None:
                self._moved(node, MEDIUM_CPU)
                if not node.children:
                    heapq.heappush(self._host_heap, (node.last_access, node.id, node))
            else:
                self._drop(node, MEDIUM_GPU)
            self._file_if_leaf(parent)
            evicted += t
        self._evictable -= evicted
        self._copy_demoted(demoted)
        self._pinned.difference_update(pinned)
        self._free_rows(freed)
        self._metrics.record_evict(evicted)
        return evicted

    def evict_host(self, num_pages: int) -> int:
        """Drop host-only leaves (least recently used first, pinned ones kept) until
        ``num_pages`` host pages are free beyond those free now, or none is left. Returns
        the pages freed. O(dropped x log H)."""
        need = check_count(num_pages, "num_pages")
        return self._drop_lru_host_leaves(need, self._drop_dup_copies(need), self._drop_tail)

    def _drop_tail(self, node: TierNode, want: int) -> int:
        """Drop the host-only leaf ``node``, or only its last ``want`` pages when it has more
        (the head stays, a host leaf). Returns the pages dropped."""
        pages = len(node.kbuf) // self._page_bytes
        if pages > want:
            self._split(node, (pages - want) * self._page_bytes)
            pages = want
        self._drop(node)
        return pages

    # ------------------------------------------------------------------ locks
    # ------------------------------------------------------------------ whole tree
    def reset(self) -> None:
        """RadixCache's reset; every host page goes back too."""
        owned = [x.hbuf for x in self.iter_nodes() if isinstance(x, TierNode) and x.hbuf]
        if owned:
            self.host_alloc.free(np.frombuffer(b"".join(owned), _I32))
        self._host_heap.clear()
        self._dups.clear()
        self._host_tokens = 0
        super().reset()

    def check_invariants(self) -> None:
        """RadixCache's checks adapted to tiers, plus the host tier's: every node on a tier,
        device part prefix-closed, host pages owned once and exactly the allocator's in-use
        ones (naming leaked / double-owned pages) (:func:`radixkv.cache.tier_audit.check`)."""
        parked = np.concatenate([p for p, _ in self._parked]) if self._parked else None
        tier_audit.check(self, self._heads, self._leaves, self._pinned, parked)
        if self.storage is not None:
            self.storage.check_invariants()

    # ------------------------------------------------------------------ helpers
    def _host_alloc(self, n: int) -> np.ndarray | None:
        self._reap_parked()
        return super()._host_alloc(n)

    def _host_alloc_upto(self, n: int) -> np.ndarray | None:
        """Up to ``n`` host pages (``n``, else halving while the host has no room)."""
        pages = self._host_alloc(n)
        while pages is None and n > 1:
            n //= 2
            pages = self._host_alloc(n)
        return pages

    def _fetch_into_host(self, keys: list[str]) -> tuple[int, np.ndarray | None]:
        """The leading pages of ``keys`` storage holds, read straight into host pages:
        ``(k, pages)``, the first ``k`` pages holding them (only these stay allocated). With
        free pages for every key they are reserved up front and read in one pass; else once
        storage counted its pages (so a miss never evicts a host page). Pages a late read still
        fills are parked until it is done."""
        assert self.storage is not None
        got: list[np.ndarray] = []

        def reserve(n: int) -> list[list[memoryview]]:
            pages = self._host_alloc_upto(n)
            if pages is None:
                return []
            got.append(pages)
            return self.host_pool.page_buffers(pages.tolist())

        self._reap_parked()
        free = self.host_alloc.alloc(len(keys))  # None (nothing taken) unless all are free
        if free is not None:
            got.append(free)
            k, pending = self.storage.fetch_into(keys, self.host_pool.page_buffers(free.tolist()))
        else:
            k, pending = self.storage.fetch_into(keys, reserve)
        if not got:
            return 0, None
        pages = got[0]
        if pending is not None:
            self._parked.append((pages[k:], pending))
        elif k < len(pages):
            self.host_alloc.free(pages[k:])
        return k, pages[:k]

    def _reap_parked(self) -> None:
        """Give back the host pages of late storage reads that are done. O(parked reads)."""
        if not self._parked:
            return
        flags = [ev.is_set() for _, ev in self._parked]  # read once: an event may be set meanwhile
        if any(flags):
            done = [p for (p, _), f in zip(self._parked, flags) if f]
            self._parked = [x for x, f in zip(self._parked, flags) if not f]
            self.host_alloc.free(np.concatenate(done))

    def _drop_dup_copies(self, need: int) -> int:
        """Give up the host copies of loaded nodes still on the device (oldest load first,
        pinned ones kept) until ``need`` pages are freed; no page leaves the tree. Returns
        the pages freed. O(dropped)."""
        freed = 0
        dups = self._dups
        for nid in list(dups):
            if freed >= need:
                break
            x = dups[nid]
            if x.id in self._pinned:
                continue
            del dups[nid]
            if x.vbuf and x.hbuf is not None and self._in_tree(x):
                freed += len(x.hbuf) >> 2
                self._drop_host_copy(x)
        return freed

    def _drop(self, node: TierNode, medium: str = MEDIUM_CPU) -> None:
        """Remove ``node`` (no device rows left) and its host-only subtree from the tree,
        freeing their host pages; KV events record their pages removed, children before their
        parent (``node``'s from ``medium``, the subtree's from the host)."""
        stack, order = [node], []
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())  # type: ignore[arg-type]
            order.append(x)
            if x.hbuf is not None:
                if self.storage is not None and self.storage.admit == "all":
                    self._backup(x)  # its backup at insert found the queue full: the last chance
                self.tier_stats["host_dropped_pages"] += len(x.hbuf) >> 2
                self._drop_host_copy(x)
        self._record_removed(order, medium)
        parent: Any = node.parent
        del parent.children[node.kbuf[:self._page_bytes]]
        sync_only(parent)
        if parent.parent is None:
            if not parent.children and parent.extra_key is not None:
                del self._heads[parent.extra_key]
        elif not parent.children and not parent.vbuf and parent.hbuf is not None:
            heapq.heappush(self._host_heap, (parent.last_access, parent.id, parent))

    def _seed(self, node: TreeNode) -> bytes:
        ns = self._namespace(node)
        seed = self._seeds.get(ns)
        if seed is None:
            seed = self._seeds[ns] = storage_seed(encode_extra_key(ns), self._fingerprint)
        return seed

    def _backup(self, node: TierNode) -> None:
        """Queue ``node``'s pages to storage from its device rows or host pages (a snapshot)."""
        if self.storage is None or node.backed or node.pkeys is None:
            return
        rows = self._page_rows(node)
        if rows is not None:
            node.backed = self.storage.backup(node.pkeys, rows)

    def _fetch(self, key: RadixKey, node: TreeNode | None, pos: int, n: int) -> TierNode | None:
        """Read the pages of ``key[pos:n]`` storage holds (from the first) into a new
        host-only node under ``node``; ``None`` when storage has none or the host no room."""
        assert self.storage is not None
        tokens = np.frombuffer(key._buf, _I32, count=(n - pos) >> 2, offset=pos).copy()
        prior = node.pkeys[-1] if isinstance(node, TierNode) and node.pkeys else None
        if node is None:
            seed = self._seeds.get(key.extra_key)
            if seed is None:
                seed = self._seeds[key.extra_key] = storage_seed(encode_extra_key(key.extra_key),
                                                                 self._fingerprint)
        else:
            seed = self._seed(node)
        keys = page_keys(tokens, self.page_size, seed, prior)
        if self.storage.scatters:
            k, pages = self._fetch_into_host(keys)
        else:
            rows = self.storage.fetch(keys)
            k = int(rows.shape[0])
            pages = self._host_alloc_upto(k) if k else None
            if pages is not None:
                k = len(pages)
                self.host_pool.write_rows(torch.from_numpy(pages.astype(np.int64)), rows[:k])
        if pages is None or not k:
            return None
        if node is None:
            node = self._heads[key.extra_key] = NamespaceHead(self._new_id(), key.extra_key)
        size = k * self._page_bytes
        kb = key._buf[pos:pos + size]
        self._next_id += 1
        self._clock += 1
        leaf = TierNode(self._next_id, node, kb, b"", self._clock)
        leaf.hbuf, leaf.pkeys, leaf.backed, leaf.hits = pages.tobytes(), keys[:k], True, 1
        if self.kv_events is not None:
            parent_hash = node.block_hashes[-1] if node.block_hashes else None
            leaf.block_hashes = self.kv_events.on_stored(parent_hash, tokens[:size >> 2], key.extra_key,
                                                         MEDIUM_CPU)
        node.children[kb[:self._page_bytes]] = leaf
        sync_only(node)
        self._host_tokens += size >> 2
        heapq.heappush(self._host_heap, (leaf.last_access, leaf.id, leaf))
        return leaf
