"""Audit of a tree with a host KV tier (:class:`~radixkv.cache.host_tier.HostTierMixin`: the
KV-only ``TieredRadixCache`` and the hybrid ``TieredMambaRadixCache``, their ``check_invariants``):
the RadixCache's structural checks read per tier, then the host tier's bookkeeping.

O(nodes + tokens + host pages); for tests and debugging, never on a hot path.
"""
from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from radixkv.cache import tree_audit
from radixkv.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU, KVEventRecorder
from radixkv.cache.tree_node import NamespaceHead, TreeNode
from radixkv.errors import InvariantError, describe_ids

if TYPE_CHECKING:
    from radixkv.cache.host_tier import HostTierMixin
    from radixkv.cache.leaf_index import LeafIndex

__all__ = ["check"]


def _fail(msg: str, ids: list[int]) -> None:
    raise InvariantError(f"TieredRadixCache: {msg}: nodes {describe_ids(ids)}")


def check(cache: HostTierMixin, heads: Mapping[Hashable, NamespaceHead], leaves: LeafIndex[TreeNode],
          pinned: Collection[int], parked: np.ndarray | None = None) -> None:
    """Raise :class:`InvariantError` naming nodes / rows / host pages unless: heads, parents,
    ``only``, keys and lock counts are right; every node is on a tier (``vbuf`` one row per
    token or empty, ``hbuf`` and ``pkeys`` one per page or ``None``), the device part is prefix-closed
    and only device nodes are locked; sizes (evictable, protected, host) match the tree; the
    evictable leaves (``leaves``) are exactly the unlocked device nodes without a device child;
    no KV row or host page is held twice, every host page in use is held (else leaked) and
    every held page in use (``parked``: host pages a late storage read still fills, held too);
    ``pinned`` is empty. Sizes are read through the public methods."""
    pb = 4 * cache.page_size
    nodes: list[Any] = []
    evictable = protected = host = 0
    stack: list[TreeNode] = list(heads.values())
    for extra, head in heads.items():
        if not isinstance(head, NamespaceHead) or head.extra_key != extra or head.lock_ref != 1 or head.kbuf:
            _fail(f"bad namespace head for {extra!r}", [head.id])
        if extra is not None and not head.children:
            _fail(f"empty namespace head {extra!r} kept", [head.id])
    while stack:
        node = stack.pop()
        lone = next(iter(node.children.values())) if len(node.children) == 1 else None
        if node.only is not lone:
            _fail("'only' is not the lone child", [node.id])
        for ck, c in node.children.items():
            x: Any = c
            nodes.append(x)
            stack.append(x)
            n = len(x.kbuf)
            if x.parent is not node or ck != x.kbuf[:pb] or n == 0 or n % pb:
                _fail("child with a wrong parent, key or length", [x.id])
            if x.vbuf and len(x.vbuf) != n:
                _fail(f"node of {n >> 2} tokens with {len(x.vbuf) >> 2} device rows", [x.id])
            if x.hbuf is not None and len(x.hbuf) != n // pb * 4:
                _fail(f"node of {n // pb} pages with {len(x.hbuf) >> 2} host pages", [x.id])
            if not x.vbuf and x.hbuf is None:
                _fail("node on no tier", [x.id])
            if x.pkeys is not None and len(x.pkeys) != n // pb:
                _fail(f"node of {n // pb} pages with {len(x.pkeys)} storage keys", [x.id])
            if x.vbuf and node.parent is not None and not node.vbuf:
                _fail("device node below a node not on the device", [x.id, node.id])
            if x.lock_ref < 0 or (node.parent is not None and node.lock_ref < x.lock_ref):
                _fail("bad lock count (negative, or above its parent's)", [x.id, node.id])
            if x.lock_ref and not x.vbuf:
                _fail("locked node not on the device", [x.id])
            if x.vbuf:
                if x.lock_ref:
                    protected += n >> 2
                else:
                    evictable += n >> 2
            if x.hbuf is not None:
                host += n >> 2
    sizes = (cache.evictable_size(), cache.protected_size(), cache.host_size())
    if (evictable, protected, host) != sizes:
        raise InvariantError(f"TieredRadixCache: sizes evictable/protected/host {sizes} != tree "
                             f"{(evictable, protected, host)}")
    expected = {id(x) for x in nodes if x.vbuf and not x.lock_ref
                and not any(c.vbuf for c in x.children.values())}
    filed = {id(x) for x in leaves}
    if expected != filed:
        wrong = [x.id for x in nodes if (id(x) in expected) != (id(x) in filed)]
        _fail("evictable-leaf index wrong", wrong)
    tree_audit._check_rows(cache, nodes)
    _check_host(cache, nodes, pinned, parked)
    cache.policy.check_invariants([x for x in nodes if x.vbuf])  # it orders device nodes only
    if cache.kv_events is not None:
        tree_audit._check_events(cache, nodes)
        _check_media(cache.kv_events, nodes)


def _check_media(rec: KVEventRecorder, nodes: list[Any]) -> None:
    """Every node's blocks were last announced on its fastest tier (``GPU`` with device
    rows, else ``CPU``)."""
    wrong = [x.id for x in nodes if any(rec.medium_of(h) != (MEDIUM_GPU if x.vbuf else MEDIUM_CPU)
                                        for h in x.block_hashes or ())]
    if wrong:
        _fail("KV events announced blocks on another tier than the one they are on", wrong)


def _check_host(cache: HostTierMixin, nodes: list[Any], pinned: Collection[int],
                parked: np.ndarray | None) -> None:
    held = [x for x in nodes if x.hbuf]
    pages = np.frombuffer(b"".join(x.hbuf for x in held), dtype=np.int32)
    owner = np.repeat(np.arange(len(held)), [len(x.hbuf) >> 2 for x in held])
    uniq, counts = np.unique(pages, return_counts=True)
    if (counts > 1).any():
        twice = uniq[counts > 1]
        holders = [held[i].id for i in owner[np.isin(pages, twice)]]
        raise InvariantError(f"TieredRadixCache: host pages {describe_ids(twice.tolist())} held by two "
                             f"nodes (double-owned): nodes {describe_ids(holders)}")
    if parked is not None and parked.size:
        twice = np.intersect1d(pages, parked)
        if twice.size or np.unique(parked).size != parked.size:
            raise InvariantError(f"TieredRadixCache: host pages parked for a late storage read held twice: "
                                 f"{describe_ids(twice.tolist() or parked.tolist())}")
        pages = np.concatenate([pages, parked.astype(np.int32)])
    cache.host_alloc.check_invariants(pages)
    if pinned:
        raise InvariantError(f"TieredRadixCache: nodes {describe_ids(pinned)} left pinned")
