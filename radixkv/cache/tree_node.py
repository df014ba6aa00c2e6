"""``TreeNode``: one edge of the radix tree (a run of tokens and their KV rows).

Memory (what the cache costs): ``kbuf`` / ``vbuf`` hold the token ids and KV rows as int32
``bytes`` (4 bytes per token each; ``key`` / ``value`` are read-only numpy views);
``children`` is a dict keyed by the child's first page; ``only`` is the lone child (else
``None``), kept in step by :func:`sync_only` so a walk skips the dict; ``__slots__`` only.
Fields the cache keeps for every policy: ``lock_ref``, ``last_access`` / ``created``
(logical ticks, unique among leaves), ``hits``, ``priority``, ``skey`` (key filed under in
the leaf index, ``None`` when not filed), ``pstate`` (the policy's), ``block_hashes`` (with
events on). Why bytes and ``only``: ``docs/internals.md``, "Tree nodes and their memory".
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

__all__ = ["TreeNode", "NamespaceHead", "sync_only"]


class TreeNode:
    """A node of the radix tree; see the module docstring for the fields.

    Nodes are created and mutated by :class:`~radixkv.cache.radix_cache.RadixCache` only;
    callers treat them as opaque handles (``MatchResult.last_node``, ``Req.last_node``)
    to pass back to ``inc_lock_ref`` / ``dec_lock_ref``.
    """

    # Slot order is memory order: the fields a match walk reads and writes come first, so
    # that they share as few cache lines as possible (the walk is memory-bound).
    __slots__ = ("kbuf", "only", "children", "vbuf", "last_access", "hits", "skey", "lock_ref", "parent",
                 "priority", "created", "id", "block_hashes", "pstate")

    def __init__(self, node_id: int, parent: TreeNode | None, kbuf: bytes, vbuf: bytes,
                 tick: int = 0, priority: int = 0):
        self.children: dict[bytes, TreeNode] = {}
        self.only: TreeNode | None = None
        self.parent = parent
        self.kbuf = kbuf
        self.vbuf = vbuf
        self.lock_ref = 0
        self.last_access = tick
        self.created = tick
        self.hits = 0
        self.priority = priority
        self.skey: Any = None  # the policy's sort key: any comparable value
        self.id = node_id
        self.block_hashes: list[int] | None = None
        self.pstate: Any = None  # the policy's own per-node state

    @property
    def key(self) -> np.ndarray:
        """The node's token ids (read-only int32 view)."""
        return np.frombuffer(self.kbuf, dtype=np.int32)

    @property
    def value(self) -> np.ndarray:
        """The node's KV row indices (read-only int32 view)."""
        return np.frombuffer(self.vbuf, dtype=np.int32)

    @property
    def num_tokens(self) -> int:
        return len(self.kbuf) >> 2

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_head(self) -> bool:
        """True for the empty head of a namespace (it holds no tokens, is never evicted)."""
        return self.parent is None

    def __repr__(self) -> str:
        head = self.key[:6].tolist()
        more = ", ..." if self.num_tokens > 6 else ""
        return (f"TreeNode(id={self.id}, tokens={self.num_tokens} {head}{more}, "
                f"lock_ref={self.lock_ref}, children={len(self.children)})")


def sync_only(node: TreeNode) -> None:
    """Set ``node.only`` from ``node.children`` (after adding or removing a child). O(1)."""
    ch = node.children
    node.only = next(iter(ch.values())) if len(ch) == 1 else None


class NamespaceHead(TreeNode):
    """The empty head of one namespace (``extra_key``). It has no parent, no tokens, and a
    lock count the cache never changes; the tree's real nodes hang below it."""

    __slots__ = ("extra_key",)

    def __init__(self, node_id: int, extra_key: Hashable):
        super().__init__(node_id, None, b"", b"", tick=0, priority=-(1 << 62))
        self.extra_key = extra_key
        self.lock_ref = 1

    def __repr__(self) -> str:
        return f"NamespaceHead(id={self.id}, extra_key={self.extra_key!r}, children={len(self.children)})"
