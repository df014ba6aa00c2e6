"""The write path of the RadixCache: :class:`InsertMixin`, a base class of
:class:`~radixkv.cache.radix_cache.RadixCache` holding its methods ``insert`` (the cache's
own callers use ``_insert`` for the path) and ``_split`` (also used by ``match_prefix``).

``insert`` runs in two phases so that a rejected call leaves the tree exactly as it
was: first every check and a *read-only* walk (the node where the cached prefix ends, the
node to split if it ends inside one, the new rows as int32 bytes, the KV-event hashes),
then the mutation, which raises on no caller input.

Cost (n = key tokens, d = nodes on the cached path, L = evictable leaves): O(d) dict probes
and ``memcmp`` over the cached prefix, one range check and one int32 copy of the new rows
(:func:`radixkv.cache.rows.rows_bytes`), one copy of the new key tail, O(log L) to file the
new leaf (and to unfile its parent), O(node) for a split.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.cache.radix_key import RadixKey, as_radix_key, common_prefix_tokens
from radixkv.cache.rows import check_value, rows_bytes
from radixkv.cache.tree_node import NamespaceHead, TreeNode
from radixkv.errors import AlignmentError, InvalidArgumentError, InvalidIndexError, LengthMismatchError

if TYPE_CHECKING:
    from radixkv.cache.kv_events import KVEventRecorder
    from radixkv.cache.leaf_index import LeafIndex
    from radixkv.cache.metrics import CacheMetrics

__all__ = ["InsertMixin"]

_I32 = np.dtype(np.int32)
_U64 = np.dtype(np.uint64)
_I64T = torch.int64
_Tensor = torch.Tensor
_ROW_LIMIT = 1 << 31


class InsertMixin:
    """``RadixCache``'s write path (a base class of it, so the methods run as its own).

    The attributes it uses (``_heads``, ``_page_bytes``, ``_leaves``, ``_clock``, the policy hooks,
    the compiled walks ``_native_find`` / ``_native_narrow`` / ``_new_node``, ...) are set by
    ``RadixCache.__init__``.
    """

    # set by RadixCache.__init__ (declared here for the type checker; no class attributes)
    page_size: int
    disable: bool
    kv_events: KVEventRecorder | None
    _page_bytes: int
    _heads: dict[Hashable, NamespaceHead]
    _leaves: LeafIndex[TreeNode]  # the evictable leaves
    _clock: int
    _next_id: int
    _evictable: int
    _lazy: bool
    _metrics: CacheMetrics
    _sort_key: Callable[[TreeNode], Any]
    _on_insert: Callable[[TreeNode], None] | None
    _on_split: Callable[[TreeNode, TreeNode], None] | None
    _native_find: Callable[[TreeNode, bytes, int, int], tuple[int, TreeNode, list[TreeNode], TreeNode | None]] | None
    _native_narrow: Callable[[int, int, int], bytes | None] | None
    _new_node: Callable[..., TreeNode]
    _insert_entry: Callable[..., Any]  # the compiled insert entry, or InsertMixin.insert

    if TYPE_CHECKING:
        def _new_id(self) -> int: ...
        def _refile(self, node: TreeNode) -> None: ...

    # ``value: Any``: an integer tensor or array, read as a tensor on the fast path (``check_value``
    # validates the others); the result: an int, or ``(prefix, node, path)`` with ``_path``
    def insert(self, key: RadixKey | object, value: Any, priority: int = 0, extra_key: Hashable = None,
               _path: bool = False) -> Any:
        """Insert ``key`` (whole pages; ``extra_key`` names the namespace of token ids) with its
        KV rows ``value`` (integer tensor or array; the rows after the cached prefix in
        ``[0, 2**31)``); every node on the path keeps the max ``priority``. Returns the tokens
        already cached (the caller frees its duplicates ``value[:returned]``); with ``_path``
        ``(prefix, node, path)``: the node where the key ends (the head for an empty key) and
        the nodes on the cached prefix (the split-off upper half last). Raises (tree unchanged)
        AlignmentError, LengthMismatchError, InvalidArgumentError, InvalidIndexError. Read-only
        steps (check, find, rows, hashes), then the mutation, which raises on no input.
        """
        key, value, plain = self._insert_args(key, value, priority, extra_key)
        buf = key._buf
        n = len(buf)
        head = self._heads.get(key.extra_key)
        if self.disable or n == 0:
            return (0, head if head is not None else self._heads[None], []) if _path else 0
        pos, node, path, split_child, split_at = self._find_insert_point(head, buf, n)
        tail = self._new_rows(value, plain, pos, n)
        hashes = None
        if self.kv_events is not None and pos < n:
            hashes = self._stored_hashes(self.kv_events, node if node is not head else None,
                                         split_child, split_at, buf, pos, key.extra_key)
        # ---- mutation (nothing below raises on caller input) ----
        if head is None:
            head = node = self._heads[key.extra_key] = NamespaceHead(self._new_id(), key.extra_key)
        if split_child is not None:
            node = self._split(split_child, split_at)
            path.append(node)
        tick = self._touch_path(path, priority) if path else self._clock
        if pos < n:
            tick += 1
            node = self._add_leaf(node, buf, pos, tail, tick, int(priority), hashes)
        self._clock = tick
        met = self._metrics  # record_insert inlined
        met.inserts += 1
        met.inserted_tokens += (n - pos) >> 2
        return (pos >> 2, node, path) if _path else pos >> 2

    def _insert_args(self, key: RadixKey | object, value: Any, priority: object,
                     extra_key: Hashable) -> tuple[RadixKey, Any, bool]:
        """``insert``'s checks: ``(key as a RadixKey, value, plain)``; ``plain``: ``value`` is a
        1-D CPU int64 tensor of the key's length (checked here; others go through
        ``check_value``). O(1) for a plain tensor, else O(n)."""
        if type(key) is not RadixKey or extra_key is not None:
            key = as_radix_key(key, extra_key)
        n = len(key._buf)
        if n % self._page_bytes:
            raise AlignmentError(f"key of {n >> 2} tokens is not a multiple of page_size {self.page_size}")
        plain = type(value) is _Tensor and value.dtype is _I64T and value.ndim == 1 and value.is_cpu
        if plain:
            if value.shape[0] != n >> 2:
                raise LengthMismatchError(f"key has {n >> 2} tokens but value has {value.shape[0]} rows")
        else:
            value = check_value(value, n >> 2)
        if type(priority) is not int and (isinstance(priority, bool)
                                          or not isinstance(priority, (int, np.integer))):
            raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
        return key, value, plain

    def _find_insert_point(self, head: NamespaceHead | None, buf: bytes,
                           n: int) -> tuple[int, Any, list[TreeNode], TreeNode | None, int]:
        """Read-only walk of ``buf`` from ``head`` (None: a new namespace):
        ``(pos, node, path, split_child, split_at)``, the cached prefix's end in bytes, the
        node it ends at or below, the nodes covering it and, when it ends inside a node, that
        node and the page-aligned bytes of it that match. O(d) probes and memcmp."""
        if head is None:
            return 0, None, [], None, 0
        pb = self._page_bytes
        cfind = self._native_find
        if cfind is not None:  # the compiled walk (radixkv.cache.native): the loop below, in C
            pos, node, path, split_child = cfind(head, buf, n, pb)
            if split_child is None:
                return pos, node, path, None, 0
            m = common_prefix_tokens(split_child.kbuf, buf, pos, n)  # it ends inside split_child
            split_at = (m - m % self.page_size) * 4
            return pos + split_at, node, path, split_child, split_at
        node_: Any = head
        pos = 0
        path = []
        while pos < n:
            child = node_.only  # a lone child needs no dict lookup (see TreeNode.only)
            if child is None:
                child = node_.children.get(buf[pos:pos + pb])
                if child is None:
                    break
            kb = child.kbuf
            if buf.startswith(kb, pos):  # a memcmp; False when kb runs past the key
                path.append(child)
                node_ = child
                pos += len(kb)
                continue
            if not buf.startswith(kb[:pb], pos):
                break  # a lone child that differs in its first page
            m = common_prefix_tokens(kb, buf, pos, n)
            split_at = (m - m % self.page_size) * 4
            return pos + split_at, node_, path, child, split_at
        return pos, node_, path, None, 0

    def _new_rows(self, value: Any, plain: bool, pos: int, n: int) -> bytes:
        """The rows of tokens ``pos >> 2 ..`` as int32 bytes, after one range check
        (``rows_bytes``, inlined for a plain tensor; compiled when the cache is). O(new rows)."""
        if pos >= n:
            return b""
        if not plain:
            return rows_bytes(value, pos >> 2)
        cnarrow = self._native_narrow
        if cnarrow is not None:  # compiled: one pass over the tensor's own memory
            tail = None
            if value.is_contiguous() and not value.is_neg():
                tail = cnarrow(value.data_ptr(), n >> 2, pos >> 2)  # None: a row out of range
            return tail if tail is not None else rows_bytes(value, pos >> 2)  # strided, or raises
        t = value.numpy()[pos >> 2:]
        u = t.view(_U64)  # one max over the uint view checks both bounds (rows.row_max)
        if u[u.argmax()] >= _ROW_LIMIT:
            raise InvalidIndexError("KV rows must lie in [0, 2**31)")
        tail_bytes: bytes = t.astype(_I32).tobytes()
        return tail_bytes

    def _stored_hashes(self, recorder: KVEventRecorder, node: TreeNode | None, split_child: TreeNode | None,
                       split_at: int, buf: bytes, pos: int, extra_key: Hashable) -> Any:
        """``recorder``'s block hashes of the new pages ``buf[pos:]``, chained to the page
        before them: in ``split_child`` at ``split_at``, else ``node``'s last (None: the head)."""
        if split_child is not None:
            parent_hash = split_child.block_hashes[split_at // self._page_bytes - 1]  # type: ignore[index]  # events on: hashes kept
        else:
            parent_hash = node.block_hashes[-1] if node is not None else None  # type: ignore[index]
        return recorder.on_stored(parent_hash, np.frombuffer(buf, _I32, offset=pos), extra_key)

    def _touch_path(self, path: list[TreeNode], priority: int) -> int:
        """Give each node of ``path`` the next tick and at least ``priority``, re-filing the
        evictable ones unless the policy files lazily; return the last tick. O(len(path))."""
        tick = self._clock
        priority = int(priority)
        eager = not self._lazy
        for x in path:
            tick += 1
            x.last_access = tick
            if x.priority < priority:
                x.priority = priority
            if eager and x.skey is not None:
                self._refile(x)
        return tick

    def _add_leaf(self, parent: Any, buf: bytes, pos: int, tail: bytes, tick: int, priority: int,
                  hashes: Any) -> TreeNode:
        """Hang the key's uncached tail ``buf[pos:]`` with its rows ``tail`` under ``parent`` as
        a new evictable leaf (the parent stops being one). O(log L)."""
        self._next_id += 1
        leaf = self._new_node(self._next_id, parent, buf[pos:], tail, tick, priority)
        if hashes is not None:
            leaf.block_hashes = hashes
        leaves = self._leaves
        if parent.skey is not None:  # the parent stops being a leaf
            leaves.remove(parent)
            parent.skey = None
        ch = parent.children
        ch[buf[pos:pos + self._page_bytes]] = leaf
        parent.only = leaf if len(ch) == 1 else None
        self._evictable += (len(buf) - pos) >> 2
        if self._on_insert is not None:
            self._on_insert(leaf)
        leaf.skey = self._sort_key(leaf)
        leaves.add(leaf)
        return leaf

    def _insert(self, key: RadixKey, value: Any, priority: int) -> Any:
        """``insert`` returning ``(prefix, node, path)`` (the cache's own callers, and
        MambaRadixCache's insert): the compiled entry when the cache uses the compiled paths
        (``_insert_entry``, set by ``RadixCache.__init__``; it hands what it does not take to the
        Python ``insert``), else the Python ``insert``."""
        return self._insert_entry(self, key, value, priority, None, True)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut the first ``m`` bytes (whole pages, 0 < m < len) of ``child`` into a new parent
        and return it. The new node copies child's bookkeeping (lock count, recency, hits,
        priority); sizes and leaf status do not change. O(len(child))."""
        pb = self._page_bytes
        kb, vb = child.kbuf, child.vbuf
        parent: Any = child.parent  # a TreeNode or a NamespaceHead: a head is never split
        new = self._new_node(self._new_id(), parent, kb[:m], vb[:m], child.created, child.priority)
        new.last_access = child.last_access
        new.hits = child.hits
        new.lock_ref = child.lock_ref
        child.kbuf = kb[m:]
        child.vbuf = vb[m:]
        child.parent = new
        new.children[child.kbuf[:pb]] = child
        new.only = child
        parent.children[kb[:pb]] = new
        if parent.only is child:
            parent.only = new
        if child.block_hashes is not None:
            pages = m // pb
            new.block_hashes = child.block_hashes[:pages]
            child.block_hashes = child.block_hashes[pages:]
        if self._on_split is not None:
            self._on_split(new, child)
        return new
