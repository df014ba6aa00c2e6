"""Audit of a RadixCache: ``check_invariants`` and ``pretty_print`` (the bodies of those methods).

Both walk the whole tree (O(nodes + tokens)); they are for tests and debugging, never on a
hot path.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.cache.tree_node import NamespaceHead, TreeNode
from radixkv.errors import InvariantError, describe_ids

if TYPE_CHECKING:
    from radixkv.cache.leaf_index import LeafIndex
    from radixkv.cache.radix_cache import RadixCache

__all__ = ["check_invariants", "pretty_print"]


def _fail(msg: str, ids: Iterable[int]) -> None:
    raise InvariantError(f"RadixCache: {msg}: nodes {describe_ids(ids)}")


def check_invariants(cache: RadixCache, heads: Mapping[Hashable, NamespaceHead], leaves: LeafIndex[TreeNode],
                     sort_key: Callable[[TreeNode], Any], lazy: bool) -> None:
    """Raise :class:`InvariantError` naming the offending node ids / rows unless the tree holds,
    over the cache's ``heads``, leaf index ``leaves``, policy key ``sort_key``, filing mode ``lazy``.

    Checked: namespace heads; parent links, child keys and ``only``; whole pages, as many rows
    as tokens; lock counts (a parent locked at least as often as its child); the size split
    ``evictable + protected == total``; the filed evictable leaves are exactly the unlocked
    leaves under keys not above their current ones, in order; no row in two nodes or free in
    the allocator; with events, one hash per page and the recorder's blocks equal to the tree's;
    the policy's own state. The list in full: ``docs/internals.md``, "What the tree audit checks".
    """
    pb = cache.page_size * 4  # bytes of a page of int32 tokens
    if None not in heads:
        raise InvariantError("RadixCache: the None namespace has no head")
    for extra, head in heads.items():
        if not isinstance(head, NamespaceHead) or head.extra_key != extra or head.parent is not None \
                or head.kbuf or head.lock_ref != 1:
            _fail(f"bad namespace head for {extra!r}", [head.id])
        if extra is not None and not head.children:
            _fail(f"empty namespace head {extra!r} kept", [head.id])
    nodes: list[TreeNode] = []
    seen = set()
    evictable = protected = 0
    stack: list[TreeNode] = list(heads.values())
    while stack:
        node = stack.pop()
        is_head = node.parent is None
        lone = next(iter(node.children.values())) if len(node.children) == 1 else None
        if node.only is not lone:
            _fail(f"'only' is {getattr(node.only, 'id', None)}, expected {getattr(lone, 'id', None)}",
                  [node.id])
        for ck, child in node.children.items():
            if id(child) in seen:
                _fail("node reachable twice (duplicated)", [child.id])
            seen.add(id(child))
            nodes.append(child)
            stack.append(child)
            if child.parent is not node:
                _fail("child whose parent pointer is wrong", [child.id, node.id])
            n = len(child.kbuf)
            if n == 0 or n % pb or len(child.vbuf) != n:
                _fail(f"node of {n >> 2} tokens / {len(child.vbuf) >> 2} rows "
                      f"(page size {cache.page_size})", [child.id])
            if ck != child.kbuf[:pb]:
                _fail("child filed under a key that is not its first page", [child.id])
            if child.lock_ref < 0:
                _fail(f"negative lock_ref {child.lock_ref}", [child.id])
            if not is_head and node.lock_ref < child.lock_ref:
                _fail("node locked more often than its parent (ancestor not locked)", [child.id, node.id])
            if child.lock_ref:
                protected += n >> 2
            else:
                evictable += n >> 2
    sizes = (cache.evictable_size(), cache.protected_size())
    if (evictable, protected) != sizes:
        raise InvariantError(
            f"RadixCache: sizes evictable/protected {sizes[0]}/{sizes[1]} != tree {evictable}/{protected}")
    _check_leaves(nodes, leaves, sort_key, lazy)
    _check_rows(cache, nodes)
    if cache.kv_events is not None:
        _check_events(cache, nodes)
    elif any(n.block_hashes is not None for n in nodes):
        _fail("block hashes kept without KV events", [n.id for n in nodes if n.block_hashes is not None])
    cache.policy.check_invariants(nodes)


def _check_leaves(nodes: list[TreeNode], leaves: LeafIndex[TreeNode], sort_key: Callable[[TreeNode], Any],
                  lazy: bool) -> None:
    expected = {id(n): n for n in nodes if not n.children and n.lock_ref == 0}
    filed = {id(n): n for n in leaves}
    if len(filed) != len(leaves):
        _fail("a leaf filed twice", [n.id for n in leaves])
    missing = [n.id for k, n in expected.items() if k not in filed]
    extra = [n.id for k, n in filed.items() if k not in expected]
    if missing or extra:
        _fail(f"evictable-leaf index wrong (missing {describe_ids(missing)}, not evictable "
              f"{describe_ids(extra)})", missing + extra)
    unfiled_with_key = [n.id for n in nodes if id(n) not in filed and n.skey is not None]
    if unfiled_with_key:
        _fail("nodes carry a sort key but are not filed", unfiled_with_key)
    if lazy:
        stale = [n.id for n in filed.values() if n.skey is None or sort_key(n) < n.skey]
    else:
        stale = [n.id for n in filed.values() if n.skey is None or sort_key(n) != n.skey]
    if stale:
        _fail("leaves filed under a wrong sort key", stale)
    leaves.check_invariants()


def _check_rows(cache: RadixCache, nodes: list[TreeNode]) -> None:
    if not nodes:
        return
    rows = np.frombuffer(b"".join(n.vbuf for n in nodes), dtype=np.int32)
    owner = np.repeat(np.arange(len(nodes)), [len(n.vbuf) >> 2 for n in nodes])
    order = np.argsort(rows, kind="stable")
    srt = rows[order]
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    if dup.size:
        bad_rows = np.unique(srt[dup])
        holders = {nodes[i].id for i in owner[np.isin(rows, bad_rows)]}
        raise InvariantError(f"RadixCache: KV rows {describe_ids(bad_rows.tolist())} held by two "
                             f"nodes (duplicated): nodes {describe_ids(holders)}")
    alloc = cache.token_to_kv_pool_allocator
    is_free = getattr(alloc, "is_free", None)
    if is_free is None:
        return
    mask = is_free(torch.from_numpy(rows.astype(np.int64)).to(cache.device))
    mask = torch.as_tensor(mask).reshape(-1).cpu().numpy().astype(bool)
    if mask.any():
        holders = {nodes[i].id for i in owner[mask]}
        raise InvariantError(f"RadixCache: KV rows {describe_ids(rows[mask].tolist())} are free in "
                             f"the allocator but held by the tree (leaked into the free list): "
                             f"nodes {describe_ids(holders)}")


def _check_events(cache: RadixCache, nodes: list[TreeNode]) -> None:
    pb = cache.page_size * 4
    bad = [n.id for n in nodes if n.block_hashes is None or len(n.block_hashes) != len(n.kbuf) // pb]
    if bad:
        _fail("nodes without one block hash per page", bad)
    hashes = Counter(h for n in nodes for h in n.block_hashes or ())
    rec = cache.kv_events
    if rec is None:
        return
    if rec.live_blocks() != sum(hashes.values()) or not all(rec.is_live(h) for h in hashes):
        raise InvariantError(f"RadixCache: the event recorder has {rec.live_blocks()} live blocks, "
                             f"the tree {sum(hashes.values())}")


def pretty_print(cache: RadixCache, heads: Mapping[Hashable, NamespaceHead], max_tokens: int = 8) -> str:
    """The tree as text (namespaces ``heads``, then nodes depth-first, children in key order):
    one line per node with its id, length, lock count, first tokens and rows. Deterministic,
    so two prints compare equal exactly when the trees do (up to ``max_tokens``)."""
    lines = []
    for extra in sorted(heads, key=repr):
        head = heads[extra]
        lines.append(f"namespace {extra!r} (head #{head.id})")
        stack = [(c, 1) for _, c in sorted(head.children.items(), reverse=True)]
        while stack:
            node, depth = stack.pop()
            k, v = node.key, node.value
            more = "..." if k.size > max_tokens else ""
            lines.append(f"{'  ' * depth}#{node.id} len={k.size} lock={node.lock_ref} "
                         f"tokens={k[:max_tokens].tolist()}{more} rows={v[:max_tokens].tolist()}{more}")
            stack.extend((c, depth + 1) for _, c in sorted(node.children.items(), reverse=True))
    lines.append(f"#tokens: {cache.total_size()} (evictable {cache.evictable_size()}, "
                 f"protected {cache.protected_size()})")
    return "\n".join(lines)
