"""``RadixCache.evict``: walking the evictable-leaf index (the mechanics; the order comes
from the policy, see :mod:`radixkv.cache.eviction`).

The index (:class:`radixkv.cache.leaf_index.LeafIndex`, a heap) holds the unlocked leaves
keyed by the sort key each was filed under (``node.skey``), ties in filing order. Popping
its front is O(log L); a leaf whose key went stale since it was filed (lazy policies) is
re-filed instead of evicted, and a parent whose last child goes is filed in turn, so an
eviction costs O(evicted nodes x log L).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixkv.cache.tree_node import TreeNode, sync_only
from radixkv.validation import check_count

if TYPE_CHECKING:
    from radixkv.cache.leaf_index import LeafIndex
    from radixkv.cache.radix_cache import RadixCache

__all__ = ["evict", "pop_victim"]


def pop_victim(leaves: LeafIndex[TreeNode], sort_key: Callable[[TreeNode], Any] | None) -> TreeNode | None:
    """Remove and return the front of the evictable-leaf index ``leaves`` (the policy's next
    victim), or ``None`` when it is empty. With ``sort_key`` (lazy policies) a leaf whose key
    went stale since it was filed is re-filed first. The one place both trees take a victim.
    O(log L) amortized."""
    while (node := leaves.pop()) is not None:  # one O(log L) step; put back below when stale
        if sort_key is not None:
            try:
                k = sort_key(node)
            except BaseException:  # a policy's sort_key failed: the index stays as it was
                leaves.add(node)
                raise
            if k != node.skey:  # touched since it was filed: re-file, look again
                node.skey = k
                leaves.add(node)
                continue
        node.skey = None
        return node
    return None


def evict(cache: RadixCache, num_tokens: int) -> int:
    """Evict unlocked leaves in the policy's order until ``num_tokens`` tokens are freed
    (or nothing evictable is left); a parent whose last child goes becomes a candidate.
    All evicted rows go back to the allocator in ONE ``free`` call.

    Returns the number of tokens freed (whole nodes, so possibly more than asked).
    Raises InvalidArgumentError (nothing evicted) for a negative / non-int count.
    O(evicted nodes x log L).
    """
    num_tokens = check_count(num_tokens, "num_tokens")
    if cache.disable or num_tokens == 0 or not cache._leaves:
        return 0
    leaves = cache._leaves
    sort_key = cache._sort_key
    on_evict = cache._on_evict
    events = cache.kv_events
    pb = cache._pb
    freed: list[bytes] = []
    evicted = 0
    stale_key = sort_key if cache._lazy else None
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
                del cache._heads[parent.extra_key]
    cache._evictable -= evicted
    cache._free_rows(freed)
    cache._metrics.record_evict(evicted)
    return evicted
