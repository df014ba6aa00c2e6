"""Taking eviction victims off the evictable-leaf index, for ``RadixCache.evict`` and
``MambaRadixCache.evict`` (the mechanics; the order comes from the policy, see
:mod:`radixkv.cache.eviction`).

The index (:class:`radixkv.cache.leaf_index.LeafIndex`, a heap) holds the unlocked leaves
keyed by the sort key each was filed under (``node.skey``), ties in filing order. Popping
its front is O(log L); a leaf whose key went stale since it was filed (lazy policies) is
re-filed instead of evicted, and a parent whose last child goes is filed in turn, so an
eviction costs O(evicted nodes x log L).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.cache.leaf_index import LeafIndex
    from radixkv.cache.tree_node import TreeNode

__all__ = ["pop_victim"]


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
