"""The write path of the RadixCache: :func:`insert_path` (bound as ``RadixCache._insert``)
and :func:`split_node` (``RadixCache._split``, also used by ``match_prefix``).

``insert_path`` runs in two phases so that a rejected call leaves the tree exactly as it
was: first every check and a *read-only* walk (the node where the cached prefix ends, the
node to split if it ends inside one, the new rows as int32 bytes, the KV-event hashes),
then the mutation, which raises on no caller input.

Cost (n = key tokens, d = nodes on the cached path, L = evictable leaves): O(d) dict probes
and ``memcmp`` over the cached prefix, one range check and one int32 copy of the new rows
(:func:`radixkv.cache.rows.rows_bytes`), one copy of the new key tail, O(log L) to file the
new leaf (and to unfile its parent), O(node) for a split.
"""
from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np

from radixkv.cache.radix_key import RadixKey, common_prefix_tokens
from radixkv.cache.rows import check_value, rows_bytes
from radixkv.cache.tree_node import NamespaceHead, TreeNode
from radixkv.errors import AlignmentError, InvalidArgumentError

__all__ = ["insert_path", "split_node"]

_I32 = np.dtype(np.int32)


def insert_path(cache, key: RadixKey, value: Any, priority: int) -> Tuple[int, TreeNode, List[TreeNode]]:
    """Insert ``key`` (a whole number of pages) with its KV rows ``value``.

    Returns ``(prefix, node, path)``: the tokens already cached, the node where the key
    ends (the namespace head for an empty key), and the nodes covering the cached prefix
    (the split-off upper half last when the prefix ends inside a node). Raises as
    ``RadixCache.insert``, the tree unchanged. The caller has made ``key`` a RadixKey.
    """
    buf = key._buf
    n = len(buf)
    pb = cache._pb
    if n % pb:
        raise AlignmentError(f"key of {n >> 2} tokens is not a multiple of page_size {cache.page_size}")
    value = check_value(value, n >> 2)
    if type(priority) is not int and (isinstance(priority, bool)
                                      or not isinstance(priority, (int, np.integer))):
        raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
    head = cache._heads.get(key.extra_key)
    if cache.disable or n == 0:
        return 0, head if head is not None else cache._heads[None], []
    node = head
    pos = 0
    path: List[TreeNode] = []
    split_child, split_at = None, 0
    if head is not None:  # read-only walk: nothing changes before validation ends
        children = head.children
        while pos < n:
            child = children.get(buf[pos:pos + pb])
            if child is None:
                break
            kb = child.kbuf
            if buf.startswith(kb, pos):  # a memcmp; False when kb runs past the key
                path.append(child)
                node = child
                pos += len(kb)
                children = child.children
                continue
            m = common_prefix_tokens(kb, buf, pos, n)
            split_child, split_at = child, (m - m % cache.page_size) * 4
            pos += split_at
            break
    tail = rows_bytes(value, pos >> 2) if pos < n else b""
    hashes = None
    if cache.kv_events is not None and pos < n:
        if split_child is not None:
            parent_hash = split_child.block_hashes[split_at // pb - 1]
        else:
            parent_hash = node.block_hashes[-1] if node is not head else None
        hashes = cache.kv_events.on_stored(parent_hash, np.frombuffer(buf, _I32, offset=pos),
                                           key.extra_key)
    # ---- mutation (nothing below raises on caller input) ----
    if head is None:
        head = node = cache._heads[key.extra_key] = NamespaceHead(cache._new_id(), key.extra_key)
    if split_child is not None:
        node = split_node(cache, split_child, split_at)
        path.append(node)
    tick = cache._clock
    if path:
        priority = int(priority)
        eager = not cache._lazy
        for x in path:
            tick += 1
            x.last_access = tick
            if x.priority < priority:
                x.priority = priority
            if eager and x.skey is not None:
                cache._refile(x)
    if pos < n:
        tick += 1
        cache._next_id += 1
        leaf = TreeNode(cache._next_id, node, buf[pos:], tail, tick, int(priority))
        if hashes is not None:
            leaf.block_hashes = hashes
        leaves = cache._leaves
        if node.skey is not None:  # the parent stops being a leaf
            leaves.remove(node)
            node.skey = None
        node.children[buf[pos:pos + pb]] = leaf
        cache._evictable += (n - pos) >> 2
        if cache._on_insert is not None:
            cache._on_insert(leaf)
        leaf.skey = cache._sort_key(leaf)
        leaves.add(leaf)
        node = leaf
    cache._clock = tick
    cache._record_insert((n - pos) >> 2)
    return pos >> 2, node, path


def split_node(cache, child: TreeNode, m: int) -> TreeNode:
    """Cut the first ``m`` bytes (whole pages, 0 < m < len) of ``child`` into a new parent
    and return it. The new node copies child's bookkeeping (lock count, recency, hits,
    priority); sizes and leaf status do not change. O(len(child))."""
    pb = cache._pb
    kb, vb = child.kbuf, child.vbuf
    parent = child.parent
    new = TreeNode(cache._new_id(), parent, kb[:m], vb[:m], child.created, child.priority)
    new.last_access = child.last_access
    new.hits = child.hits
    new.lock_ref = child.lock_ref
    child.kbuf = kb[m:]
    child.vbuf = vb[m:]
    child.parent = new
    new.children[child.kbuf[:pb]] = child
    parent.children[kb[:pb]] = new
    if child.block_hashes is not None:
        pages = m // pb
        new.block_hashes = child.block_hashes[:pages]
        child.block_hashes = child.block_hashes[pages:]
    if cache._on_split is not None:
        cache._on_split(new, child)
    return new
