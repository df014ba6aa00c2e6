"""Eviction policies of the RadixCache: the interface and the classic policies (the
registry that names them is :mod:`radixkv.cache.eviction`).

Only evictable leaves (unlocked, childless) are evicted, from one index ordered by the
policy's ``sort_key(node)`` (smallest first, ties in filing order), updated incrementally:
``evict()`` costs O(evicted x log n). Nodes carry ``last_access``, ``created``, ``hits``,
``priority`` and ``pstate`` (the policy's own). A policy defines ``name``, ``monotonic`` and
``sort_key``, and optionally the hooks ``on_insert`` / ``on_hit`` / ``on_split`` /
``on_evict``. ``monotonic`` (keys never decrease between filings) lets the cache re-key
lazily; otherwise touched leaves are re-filed at once, and a hook that lowers a key calls
``self.rekey(node)``. O(1) per hook for every policy here. How to write one:
``docs/internals.md``, "How the cache uses an eviction policy".
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import Any

#: What the hooks get: a ``radixkv.cache.tree_node.TreeNode``, or the block simulator's
#: ``BlockNode`` (``radixkv.bench.block_policy``) for the policies it runs. Every policy reads
#: ``last_access``, ``created``, ``hits``, ``priority``; SLRU and APLRU (tree only) also
#: ``kbuf``, ``pstate``, ``id`` and ``parent``.
PolicyNode = Any


__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "LFUPolicy",
    "FIFOPolicy",
    "FILOPolicy",
    "MRUPolicy",
    "PriorityPolicy",
]


class EvictionPolicy:
    """Base class of eviction policies (see the module docstring for the contract)."""

    #: Registry name (informative; the registry key is what ``make_policy`` looks up).
    name = "base"
    #: True when ``sort_key`` never decreases between filings (allows lazy re-keying).
    monotonic = True

    def __init__(self) -> None:
        self.rekey: Callable[[PolicyNode], None] = _unbound_rekey

    def bind(self, rekey: Callable[[PolicyNode], None], page_size: int = 1) -> None:
        """Called once by the cache: ``rekey(node)`` re-files a node whose key a hook
        lowered; ``page_size`` is the cache's page size."""
        self.rekey = rekey

    def reset(self) -> None:
        """The cache was reset (every node dropped)."""

    def sort_key(self, node: PolicyNode) -> Any:
        """The key the node is ordered by among evictable leaves; smallest goes first."""
        raise NotImplementedError

    def on_insert(self, node: PolicyNode) -> None:
        """A node with new tokens was created (its fields are set; it is not filed yet)."""

    def on_hit(self, node: PolicyNode) -> None:
        """``match_prefix`` matched through ``node`` (``hits`` / ``last_access`` updated)."""

    def on_split(self, parent: PolicyNode, child: PolicyNode) -> None:
        """``parent`` was cut from the head of ``child``; it copied child's common fields."""

    def on_evict(self, node: PolicyNode) -> None:
        """``node`` was evicted (already unlinked from the tree)."""

    def check_invariants(self, nodes: Iterable[PolicyNode]) -> None:
        """Raise ``InvariantError`` unless the policy's own state matches ``nodes`` (every
        live node of the tree). Default: nothing to check."""


def _unbound_rekey(node: PolicyNode) -> None:  # pragma: no cover - replaced by bind()
    raise RuntimeError("policy not bound to a cache")


class LRUPolicy(EvictionPolicy):
    """Least recently used first (the default)."""

    name = "lru"
    # a C attrgetter, not a method: no Python frame per filing (the insert hot path)
    sort_key = attrgetter("last_access")  # type: ignore[assignment]  # called with the node


class LFUPolicy(EvictionPolicy):
    """Fewest ``match_prefix`` hits first; ties by least recent use."""

    name = "lfu"

    def sort_key(self, node: PolicyNode) -> Any:
        return (node.hits, node.last_access)


class FIFOPolicy(EvictionPolicy):
    """Oldest inserted first, whatever its use."""

    name = "fifo"
    sort_key = attrgetter("created")  # type: ignore[assignment]


class FILOPolicy(EvictionPolicy):
    """Newest inserted first (constant key, so still lazily filed)."""

    name = "filo"

    def sort_key(self, node: PolicyNode) -> Any:
        return -node.created


class MRUPolicy(EvictionPolicy):
    """Most recently used first (keys drop on every touch, so it files eagerly)."""

    name = "mru"
    monotonic = False

    def sort_key(self, node: PolicyNode) -> Any:
        return -node.last_access


class PriorityPolicy(EvictionPolicy):
    """Lowest priority first (a node's priority is the max over the requests that inserted
    through it); ties by least recent use."""

    name = "priority"

    def sort_key(self, node: PolicyNode) -> Any:
        return (node.priority, node.last_access)
