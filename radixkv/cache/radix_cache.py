"""``RadixCache``: token prefix -> KV rows, a radix tree over int32 token ids (SGLang's
RadixCache, rebuilt for speed and memory). One empty :class:`NamespaceHead` per
``extra_key``; below it :class:`TreeNode` edges of whole pages (tokens and KV rows as int32
bytes), children keyed by their first page's bytes.

Costs (n = key tokens, d = nodes on the path, L = evictable leaves): ``match_prefix`` O(d)
probes + O(n) ``memcmp`` + one concatenation of the rows (a match ending inside a node
splits it, O(node)); ``insert`` the same walk + one copy of the new tail + O(log L);
``evict`` O(evicted nodes x log L), ONE allocator call; locks O(depth).

A call that rejects its input raises a :mod:`radixkv.errors` type and leaves the tree as it
was (validation and a read-only walk come before the first mutation). The write path is the
base class :class:`~radixkv.cache.radix_insert.InsertMixin`, the audit
:mod:`radixkv.cache.tree_audit`; with the compiled paths ``RadixCache(...)`` is a
:class:`NativeRadixCache` (same results). In full: ``docs/internals.md``, "The radix tree".
"""
from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from radixkv.cache import native as native_mod
from radixkv.cache import tree_audit
from radixkv.cache.eviction import EvictionPolicy, make_policy
from radixkv.cache.leaf_eviction import pop_victim
from radixkv.cache.leaf_index import LeafIndex
from radixkv.cache.metrics import CacheMetrics
from radixkv.cache.radix_insert import InsertMixin
from radixkv.cache.radix_key import RadixKey, as_radix_key, common_prefix_tokens
from radixkv.cache.rows import rows_tensor
from radixkv.cache.tree_node import NamespaceHead, TreeNode, sync_only
from radixkv.contracts import CacheRequest, KVAllocator, ReqToTokenTable
from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError
from radixkv.validation import check_count

if TYPE_CHECKING:
    from radixkv.cache.block_hash import Seed

__all__ = ["RadixCache", "NativeRadixCache", "MatchResult"]

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)


class MatchResult(NamedTuple):
    """Result of :meth:`RadixCache.match_prefix`.

    Attributes:
        device_indices: int64 tensor (on the cache's device) of the KV rows of the longest
            cached page-aligned prefix of the key; length ``prefix_len``.
        last_node: the node where that prefix ends (the one to lock); a namespace head
            when nothing matched.
        prefix_len: number of tokens matched.
    """

    device_indices: torch.Tensor
    last_node: TreeNode
    prefix_len: int

    @property
    def last_device_node(self) -> TreeNode:
        """SGLang's name for ``last_node``."""
        return self.last_node


_tuple_new = tuple.__new__  # MatchResult(...) without its Python-level __new__ (hot path)


class RadixCache(InsertMixin):
    """A radix tree mapping token prefixes (per namespace) to KV rows of a token pool.

    ``req_to_token_pool`` (``ReqToTokenPool``, for ``cache_*_req``; ``None``: driven
    directly); ``token_to_kv_pool_allocator`` (evicted rows go back to it; ``None``: dropped;
    its device is the matches' device, else CPU); ``page_size`` (nodes hold whole pages);
    ``eviction_policy`` (a registered name or an :class:`EvictionPolicy`); ``disable`` (every
    match empty, every insert a no-op); ``enable_kv_events`` / ``kv_event_seed`` (KV events,
    ``take_events()``); ``metrics_window`` (queries of the rolling hit rate); ``native``
    (the compiled paths: ``None`` when built, ``False`` never, ``True`` or raise
    ``InvalidArgumentError``; with them ``RadixCache(...)`` is a :class:`NativeRadixCache`).
    Each argument in full: ``docs/internals.md``, "The radix tree".
    """

    def __init__(self, req_to_token_pool: ReqToTokenTable | None = None,
                 token_to_kv_pool_allocator: KVAllocator | None = None,
                 page_size: int = 1, eviction_policy: str | EvictionPolicy = "lru",
                 disable: bool = False, enable_kv_events: bool = False,
                 kv_event_seed: Seed | None = None, metrics_window: int = 1000,
                 native: bool | None = None) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise InvalidArgumentError(f"page_size must be an int >= 1, got {page_size!r}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self._page_bytes = 4 * page_size  # bytes per page
        self.disable = bool(disable)
        self.device = torch.device(getattr(token_to_kv_pool_allocator, "device", "cpu"))
        self._on_device = self.device.type != "cpu"
        self.policy = make_policy(eviction_policy)
        self.policy.bind(self._refile, page_size)
        self._sort_key = self.policy.sort_key
        self._lazy = bool(self.policy.monotonic)
        base = EvictionPolicy
        kind = type(self.policy)
        self._on_hit = self.policy.on_hit if kind.on_hit is not base.on_hit else None
        self._on_insert = self.policy.on_insert if kind.on_insert is not base.on_insert else None
        self._on_split = self.policy.on_split if kind.on_split is not base.on_split else None
        self._on_evict = self.policy.on_evict if kind.on_evict is not base.on_evict else None
        self.kv_events = None
        if enable_kv_events:
            from radixkv.cache.block_hash import DEFAULT_SEED
            from radixkv.cache.kv_events import KVEventRecorder

            self.kv_events = KVEventRecorder(page_size, seed=DEFAULT_SEED if kv_event_seed is None
                                             else kv_event_seed)
        self._metrics = CacheMetrics(metrics_window)
        # match_prefix appends (queried, hit) to the metrics' log itself: a method call
        # there cost ~0.8 µs in the bench's cycle (cold frame); None: the subclass records
        self._query_log: list[tuple[int, int]] | None = self._metrics.query_log
        self._query_log_limit = 2 * metrics_window
        self._leaves: LeafIndex[TreeNode] = LeafIndex()
        if native and not native_mod.available():
            raise InvalidArgumentError(f"native=True but {native_mod.unavailable_reason}")
        use = native_mod.available() if native is None else bool(native)
        self.native = use
        # the compiled match walk touches nodes itself (last_access, hits): only for
        # policies with no on_hit hook whose order needs no re-filing on a touch
        self._native_walk = native_mod.walk if use and self._on_hit is None and self._lazy else None
        self._native_find = native_mod.find if use else None
        self._native_narrow = native_mod.narrow if use else None
        self._new_node = native_mod.new_node if use else TreeNode
        # _insert's entry (cache_*_req, MambaRadixCache.insert): the compiled insert, which
        # takes the common case whole and hands the others to the Python insert
        self._insert_entry = native_mod.insert if use else InsertMixin.insert
        if use and type(self) is RadixCache:
            # the one place the class is chosen: match_prefix and insert become the compiled
            # entries (NativeRadixCache, below); subclasses (MambaRadixCache) keep their own
            self.__class__ = NativeRadixCache
        self._next_id = 0
        self._clock = 0
        self._clear_tree()

    # ------------------------------------------------------------------ sizes, handles
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes. O(1)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in locked nodes. O(1)."""
        return self._protected

    def total_size(self) -> int:
        """Tokens in the tree. O(1)."""
        return self._evictable + self._protected

    def evictable_leaf_count(self) -> int:
        """Number of evictable (unlocked, childless) nodes. O(1)."""
        return len(self._leaves)

    @property
    def metrics(self) -> CacheMetrics:
        """The cache's counters (``metrics.snapshot()``)."""
        return self._metrics

    @property
    def root_node(self) -> NamespaceHead:
        """Head of the ``None`` namespace."""
        return self._heads[None]

    def namespaces(self) -> list[Hashable]:
        """The extra keys that currently have a head."""
        return list(self._heads)

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every real node (not the heads), parents before children. O(nodes)."""
        stack: list[TreeNode] = list(self._heads.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                yield child
                stack.append(child)

    def all_values(self) -> torch.Tensor:
        """Every KV row in the tree (int64, on the device). O(total)."""
        joined = b"".join(n.vbuf for n in self.iter_nodes())
        return rows_tensor(joined, self.device)

    # ------------------------------------------------------------------ match
    def match_prefix(self, key: RadixKey | object, extra_key: Hashable = None) -> MatchResult:
        """The longest cached page-aligned prefix of ``key`` and its KV rows.

        ``key`` is a :class:`RadixKey` (preferred: no conversion) or token ids (then
        ``extra_key`` names the namespace). A key longer than a whole number of pages is
        matched on its page-aligned part. A match ending inside a node splits it at the
        (page-aligned) boundary. Every node on the matched path is touched (recency) and
        counted as a hit. With ``disable`` the match is always empty.

        Raises:
            InvalidArgumentError: tokens that are not integers / not 1-D / not int32-sized.
        """
        if type(key) is not RadixKey or extra_key is not None:
            key = as_radix_key(key, extra_key)
        buf = key._buf
        nbytes = len(buf)
        pb = self._page_bytes
        n = nbytes - nbytes % pb if pb != 4 else nbytes
        head = self._heads.get(key.extra_key)
        if n == 0 or head is None or self.disable:
            if self._query_log is not None:
                self._metrics.record_query(nbytes >> 2, 0)
            return _tuple_new(MatchResult, (torch.empty(0, dtype=torch.int64, device=self.device),
                               head if head is not None else self._heads[None], 0))
        cwalk = self._native_walk
        if cwalk is not None:  # the compiled walk (radixkv.cache.native): the loop below, in C
            pos, node, tick, rows, split = cwalk(head, buf, n, pb, self._clock)
            if split is not None:
                pos, node, tick, rows = self._split_end(split, buf, pos, n, tick, rows)
            elif self._on_device:
                rows = rows.to(self.device)
        else:
            hit = self._on_hit
            eager = not self._lazy
            tick = self._clock
            node = head
            only = head.only
            pos = 0
            vals = []
            while pos < n:
                child = only  # a lone child needs no dict lookup: its kbuf is compared anyway
                if child is None:
                    child = node.children.get(buf[pos:pos + pb])
                    if child is None:
                        break
                kb = child.kbuf
                if buf.startswith(kb, pos, n):  # a memcmp; False when kb runs past the key
                    pos += len(kb)
                else:  # the key ends or diverges inside child: keep its whole matching pages
                    if not buf.startswith(kb[:pb], pos, n):
                        break  # a lone child that differs in its first page
                    m = common_prefix_tokens(kb, buf, pos, n)
                    m = (m - m % self.page_size) * 4
                    child = self._split(child, m)
                    pos += m
                    n = pos  # the walk stops after this node
                tick += 1
                child.last_access = tick
                child.hits += 1
                if hit is not None:
                    hit(child)
                if eager and child.skey is not None:
                    self._refile(child)
                vals.append(child.vbuf)
                node = child
                only = child.only
            if not pos:
                rows = torch.empty(0, dtype=torch.int64, device=self.device)
            else:  # rows_tensor inlined (a cold frame costs ~0.5-1 µs in a scheduler loop)
                rows = torch.from_numpy(np.frombuffer(vals[0] if len(vals) == 1 else b"".join(vals),
                                                      _I32).astype(_I64))
                if self._on_device:
                    rows = rows.to(self.device)
        self._clock = tick
        log = self._query_log
        if log is not None:
            log.append((nbytes >> 2, pos >> 2))
            if len(log) >= self._query_log_limit:
                self._metrics.compact()
        return _tuple_new(MatchResult, (rows, node, pos >> 2))

    def _split_end(self, child: TreeNode, buf: bytes, pos: int, n: int, tick: int,
                   vals: list[bytes]) -> tuple[int, TreeNode, int, torch.Tensor]:
        """The end of a match inside ``child`` (its first page matches ``buf[pos:]``): split
        off its matching whole pages, touch that new node, append its rows to ``vals`` (the
        path's int32 row bytes). Returns ``(pos, node, tick, rows tensor)``."""
        m = common_prefix_tokens(child.kbuf, buf, pos, n)
        node = self._split(child, (m - m % self.page_size) * 4)
        tick += 1
        node.last_access = tick
        node.hits += 1
        if self._on_hit is not None:
            self._on_hit(node)
        if not self._lazy and node.skey is not None:
            self._refile(node)
        vals.append(node.vbuf)
        return pos + len(node.kbuf), node, tick, rows_tensor(b"".join(vals), self.device)

    # ------------------------------------------------------------------ insert
    # insert(key, value, priority=0, extra_key=None) -> int, _insert and _split: inherited
    # from InsertMixin (radixkv.cache.radix_insert), where their contract is

    # ------------------------------------------------------------------ evict
    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves in the policy's order until ``num_tokens`` tokens are freed
        (or nothing evictable is left); a parent whose last child goes becomes a candidate.
        All evicted rows go back to the allocator in ONE ``free`` call.

        Returns the number of tokens freed (whole nodes, so possibly more than asked).
        Raises InvalidArgumentError (nothing evicted) for a negative / non-int count.
        O(evicted nodes x log L) (the victims: :func:`radixkv.cache.leaf_eviction.pop_victim`).
        """
        num_tokens = check_count(num_tokens, "num_tokens")
        leaves = self._leaves
        if self.disable or num_tokens == 0 or not leaves:
            return 0
        sort_key = self._sort_key
        on_evict = self._on_evict
        events = self.kv_events
        pb = self._page_bytes
        freed: list[bytes] = []
        evicted = 0
        stale_key = sort_key if self._lazy else None
        while evicted < num_tokens:
            node = pop_victim(leaves, stale_key)
            if node is None:
                break
            kb = node.kbuf
            parent: Any = node.parent  # a TreeNode or a NamespaceHead: a victim is never a head
            del parent.children[kb[:pb]]
            sync_only(parent)
            evicted += len(kb) >> 2
            freed.append(node.vbuf)
            if on_evict is not None:
                on_evict(node)
            if events is not None:
                events.on_removed(node.block_hashes)  # type: ignore[arg-type]  # events on: kept
            if not parent.children:
                if parent.parent is not None:
                    if parent.lock_ref == 0:
                        parent.skey = sort_key(parent)
                        leaves.add(parent)
                elif parent.extra_key is not None:  # an empty namespace goes away
                    del self._heads[parent.extra_key]
        self._evictable -= evicted
        self._free_rows(freed)
        self._metrics.record_evict(evicted)
        return evicted

    def _refile(self, node: TreeNode) -> None:
        """Re-file a filed leaf under its current sort key (policies' ``rekey``)."""
        if node.skey is not None:
            self._leaves.remove(node)
            node.skey = self._sort_key(node)
            self._leaves.add(node)

    # ------------------------------------------------------------------ locks
    def _check_node(self, node: object) -> None:
        """Raise unless ``node`` is a live node of this tree (or a namespace head)."""
        if not isinstance(node, TreeNode):
            raise InvalidArgumentError(f"expected a TreeNode, got {type(node).__name__}")
        parent: Any = node.parent  # None for a head; the top of the path is a NamespaceHead
        if parent is None:
            return
        if parent.children.get(node.kbuf[:self._page_bytes]) is not node:
            raise InvalidArgumentError(f"node {node.id} is not in the tree (evicted?)")
        while parent.parent is not None:
            parent = parent.parent
        if self._heads.get(parent.extra_key) is not parent:
            raise InvalidArgumentError(f"node {node.id} belongs to another tree (or one reset since)")

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and every ancestor (protects the whole path from eviction).

        Returns the change of ``evictable_size()`` (<= 0). O(depth).
        Raises InvalidArgumentError for a node not in this tree.
        """
        if self.disable:
            return 0
        self._check_node(node)
        delta = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                delta -= len(node.kbuf) >> 2
                if node.skey is not None:
                    self._leaves.remove(node)
                    node.skey = None
            node.lock_ref += 1
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one :meth:`inc_lock_ref` of ``node``.

        Returns the change of ``evictable_size()`` (>= 0). O(depth).
        Raises InvalidArgumentError for a node not in this tree or not locked.
        """
        if self.disable:
            return 0
        self._check_node(node)
        if node.parent is not None and node.lock_ref < 1:
            raise InvalidArgumentError(f"dec_lock_ref on node {node.id}, which is not locked")
        delta = 0
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.kbuf) >> 2
                if not node.children:
                    node.skey = self._sort_key(node)
                    self._leaves.add(node)
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        return delta

    # ------------------------------------------------------------------ whole tree
    def reset(self) -> None:
        """Drop every node, freeing all their rows to the allocator (one call), and record
        ``AllBlocksCleared``. Nodes handed out before become invalid handles."""
        if self._heads:
            joined = b"".join(n.vbuf for n in self.iter_nodes())
            if joined:
                self._free_rows([joined])
        self._clear_tree()
        self.policy.reset()
        if self.kv_events is not None:
            self.kv_events.on_cleared()

    def _clear_tree(self) -> None:
        self._heads = {None: NamespaceHead(self._new_id(), None)}
        self._leaves.clear()
        self._evictable = 0
        self._protected = 0

    def take_events(self) -> list[Any]:
        """Drain the pending KV events (``[]`` when events are disabled)."""
        return self.kv_events.take_events() if self.kv_events is not None else []

    # ------------------------------------------------------------------ requests
    # Row ownership, the contract of both entry points: ``docs/internals.md``, "Row ownership
    # at the request entry points".
    def cache_finished_req(self, req: CacheRequest) -> None:
        """Cache a finished request: insert its page-aligned tokens with its rows, free its
        duplicate rows and its unaligned tail's rows (one allocator call), and release the
        lock on ``req.last_node``. With ``disable`` every row of the request is freed.

        Raises (nothing changes): InvalidArgumentError / InvalidIndexError /
        LengthMismatchError for a request without a valid row, with a bad
        ``cache_protected_len`` or a ``last_node`` not locked in this tree.
        """
        row, tokens, kv = self._request_rows(req)
        if self.disable:
            self._free_req_rows(kv)
            return
        aligned, _, _, dup = self._insert_request(req, tokens, kv)
        self._free_req_rows(np.concatenate([dup, kv[aligned:]]))
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: CacheRequest, chunked: bool = False) -> None:
        """Cache an unfinished request (chunked prefill): insert its page-aligned tokens, free
        its duplicate rows, point its ``req_to_token`` row at the tree's rows, move its lock to
        the node where the inserted key ends, and update ``req.prefix_indices`` (tree rows plus
        the request's unaligned tail), ``req.last_node`` and ``req.cache_protected_len``.
        No-op with ``disable``. Raises as :meth:`cache_finished_req`.
        """
        if self.disable:
            return
        row, tokens, kv = self._request_rows(req)
        aligned, node, tree_rows, dup = self._insert_request(req, tokens, kv)
        self._free_req_rows(dup)
        lo = req.cache_protected_len
        if aligned > lo:
            pool: Any = self.req_to_token_pool  # checked by _request_rows; SGLang's may lack write()
            new = torch.from_numpy(tree_rows[lo:aligned].copy()).to(pool.req_to_token.device)
            if hasattr(pool, "write"):
                pool.write((row, slice(lo, aligned)), new)
            else:
                pool.req_to_token[row, lo:aligned] = new
        self.inc_lock_ref(node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        prefix = np.concatenate([tree_rows, kv[aligned:]]).astype(np.int64)
        t = torch.from_numpy(prefix)
        req.prefix_indices = t if self.device.type == "cpu" else t.to(self.device)
        req.last_node = node
        req.cache_protected_len = aligned

    def _request_rows(self, req: CacheRequest) -> tuple[int, np.ndarray, np.ndarray]:
        """Validate ``req`` against the pool; return (row, tokens with rows, their KV rows).
        Tokens with rows: ``min(len(fill_ids), kv_committed_len)``."""
        pool = self.req_to_token_pool
        if pool is None:
            raise InvalidArgumentError("this RadixCache has no req_to_token_pool")
        row = req.req_pool_idx
        if row is None or isinstance(row, bool) or not isinstance(row, (int, np.integer)):
            raise InvalidArgumentError(f"request {req.rid!r} holds no req_to_token row")
        table = pool.req_to_token
        if not 0 <= int(row) < table.shape[0]:
            raise InvalidIndexError(f"req_pool_idx {row} out of range [0, {table.shape[0]})")
        tokens = req.fill_ids
        n = tokens.size
        committed = int(getattr(req, "kv_committed_len", 0) or 0)
        if 0 < committed < n:
            n = committed
        if n > table.shape[1]:
            raise LengthMismatchError(f"request {req.rid!r} has {n} tokens, its row holds {table.shape[1]}")
        protected = req.cache_protected_len
        if not 0 <= protected <= n:
            raise InvalidArgumentError(f"cache_protected_len {protected} outside [0, {n}]")
        if req.last_node is not None:
            self._check_node(req.last_node)
            if req.last_node.parent is not None and req.last_node.lock_ref < 1:
                raise InvalidArgumentError(f"request {req.rid!r} holds an unlocked last_node")
        kv = table[int(row), :n].to("cpu", copy=True).numpy()
        return int(row), tokens[:n], kv

    def _free_req_rows(self, rows: np.ndarray) -> None:
        """Free a request's KV rows (an int array) to the allocator, in one call."""
        alloc = self.token_to_kv_pool_allocator
        if rows.size and alloc is not None:
            t = torch.from_numpy(rows.astype(np.int64))
            alloc.free(t if self.device.type == "cpu" else t.to(self.device))

    def _insert_request(self, req: CacheRequest, tokens: np.ndarray,
                        kv: np.ndarray) -> tuple[int, TreeNode, np.ndarray, np.ndarray]:
        """Insert the aligned part; return (aligned, node, tree rows of [0, aligned),
        request rows to free: duplicates differing from the tree's)."""
        n = tokens.size
        aligned = n - n % self.page_size
        key = RadixKey(tokens[:aligned], req.extra_key)
        prefix, node, path = self._insert(key, kv[:aligned], req.priority or 0)
        tree_prefix = np.frombuffer(b"".join(x.vbuf for x in path), dtype=_I32)
        lo = req.cache_protected_len
        own = kv[lo:prefix]
        dup = own[own != tree_prefix[lo:prefix]] if prefix > lo else own[:0]
        tree_rows = np.concatenate([tree_prefix, kv[prefix:aligned]])
        return aligned, node, tree_rows, dup

    # ------------------------------------------------------------------ audit
    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the node ids / rows unless the tree, its sizes,
        its leaf index, its rows and its events agree (:func:`radixkv.cache.tree_audit.check_invariants`)."""
        tree_audit.check_invariants(self, self._heads, self._leaves, self._sort_key, self._lazy)

    def pretty_print(self, max_tokens: int = 8) -> str:
        """The tree as text, one node a line (:func:`radixkv.cache.tree_audit.pretty_print`)."""
        return tree_audit.pretty_print(self, self._heads, max_tokens)

    # ------------------------------------------------------------------ helpers
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _free_rows(self, bufs: list[bytes]) -> None:
        alloc = self.token_to_kv_pool_allocator
        if alloc is None or not bufs:
            return
        joined = bufs[0] if len(bufs) == 1 else b"".join(bufs)
        if joined:
            alloc.free(rows_tensor(joined, self.device))


# ---------------------------------------------------------------------- compiled paths
if native_mod.available():  # every call the compiled entries do not take goes to these
    native_mod.bind_match(RadixCache.match_prefix, RadixKey, MatchResult)
    native_mod.bind_insert(InsertMixin.insert, torch.Tensor, torch.int64)
    # a match ending inside a node: split in C while a cache's class has these very methods
    native_mod.bind_split(RadixCache._split_end, InsertMixin._split, RadixCache._new_id)


class NativeRadixCache(RadixCache):
    """A :class:`RadixCache` whose ``match_prefix`` and ``insert`` are compiled entries
    (``radixkv.cache.native``); ``RadixCache.__init__`` makes a cache one when it uses the
    compiled paths (never when they are not built). Everything else, and every call those entries do not take whole
    (``native=False`` caches, hooks, events, devices, other key or value types, splits,
    errors), is RadixCache's Python, the contract and the reference.

    Why: one call with no Python frame; about a third of a match's time in the benchmark's
    cycle was the frame around the compiled walk (``docs/bench_radix.md``).
    """

    if native_mod.available():
        match_prefix = native_mod.method(native_mod.match)
        insert = native_mod.method(native_mod.insert)
