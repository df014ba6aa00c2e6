"""``HostTierMixin``: what a prefix tree with a host KV tier does the same way whatever else
its nodes hold (:class:`~radixkv.cache.tiered_cache.TieredRadixCache`, KV only;
:class:`~radixkv.cache.hybrid.tiered_mamba_cache.TieredMambaRadixCache`, hybrid models):
sizes, locks (only device nodes), splits that carry host pages, reviving host-only nodes
with an insert's rows, filing device leaves, host page allocation, the write-through copy of
a new leaf, an evict's demotion copy and the tier-move and removal events.

Nodes are :class:`~radixkv.cache.tiered_cache.TierNode` (``vbuf``: device rows, ``hbuf``: host
pages or ``None``). The class using it sets ``host_pool``, ``host_alloc``, ``write_policy``,
``_host_tokens``, ``_dups``, ``_pinned`` and ``tier_stats`` (with ``written_through_pages`` and
``demoted_pages``) and defines ``evict_host``. The story: docs/tiers.md.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable, Generator, Hashable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU
from radixkv.cache.radix_key import RadixKey, common_prefix_tokens
from radixkv.cache.rows import check_value, rows_bytes, rows_tensor
from radixkv.cache.tree_node import TreeNode
from radixkv.contracts import WRITE_POLICIES
from radixkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from radixkv.allocator.host_pages import HostPageAllocator
    from radixkv.cache.radix_cache import RadixCache
    from radixkv.cache.tiered_cache import TierNode
    from radixkv.memory.host_kv_pool import HostKVPool

    _Base = RadixCache
else:
    _Base = object

__all__ = ["HostTierMixin", "check_write_policy"]
_I32 = np.dtype(np.int32)


def check_write_policy(write_policy: object) -> str:
    """``write_policy`` if it is one of :data:`~radixkv.contracts.WRITE_POLICIES`, else
    ``InvalidArgumentError``."""
    if write_policy not in WRITE_POLICIES:
        raise InvalidArgumentError(f"write_policy must be one of {list(WRITE_POLICIES)}, got {write_policy!r}")
    return str(write_policy)


class HostTierMixin(_Base):
    """The host KV tier's shared tree rules (mixed in before the tree class). Costs: as the
    tree's own; ``_revive`` O(path), ``dec_lock_ref`` O(depth x children)."""

    if TYPE_CHECKING:
        host_pool: HostKVPool
        host_alloc: HostPageAllocator
        write_policy: str
        _host_tokens: int
        _dups: dict[int, TierNode]
        _pinned: set[int]
        _host_heap: list[tuple[int, int, TierNode]]
        tier_stats: dict[str, int]

        def evict_host(self, num_pages: int) -> int: ...

    def host_size(self) -> int:
        """Tokens with a host copy. O(1)."""
        return self._host_tokens

    def host_capacity(self) -> int:
        """Tokens the host tier holds at most. O(1)."""
        return self.host_pool.num_pages * self.page_size

    def _revive(self, key: RadixKey, value: Any) -> None:
        """Give the host-only nodes on ``key``'s path the caller's rows (validated first)."""
        buf, pb = key._buf, self._page_bytes
        if len(buf) % pb:
            return  # InsertMixin.insert raises
        node: Any = self._heads.get(key.extra_key)
        pos = 0
        spans: list[tuple[TierNode, int, int]] = []
        while node is not None and pos < len(buf):
            child = node.children.get(buf[pos:pos + pb])
            if child is None:
                break
            m = min(len(child.kbuf), (common_prefix_tokens(child.kbuf, buf, pos, len(buf)) * 4) // pb * pb)
            if not child.vbuf:
                spans.append((child, pos, m))
            if m < len(child.kbuf):
                break
            pos += m
            node = child
        if not spans:
            return
        value = check_value(value, len(buf) >> 2)
        tail = rows_bytes(value, spans[0][1] >> 2)  # validates every row the tree would take
        base = spans[0][1]
        last: TreeNode | None = None
        for child, start, m in spans:
            if m < len(child.kbuf):
                child = self._split(child, m)
            last = child
            child.vbuf = tail[start - base:start - base + m]
            self._moved(child, MEDIUM_GPU)
            if self._on_insert is not None:
                self._on_insert(child)
            self._evictable += m >> 2
            if self.write_policy == "write_back":
                self._drop_host_copy(child)
            parent: Any = child.parent
            if parent.skey is not None:  # it has a device child now
                self._leaves.remove(parent)
                parent.skey = None
        if last is not None:
            self._file_if_leaf(last)

    def inc_lock_ref(self, node: TreeNode) -> int:
        """RadixCache's; a host-only node cannot be locked (load it first)."""
        if self.disable:
            return 0
        self._check_node(node)
        if node.parent is not None and not node.vbuf:
            raise InvalidArgumentError(f"node {node.id} is not on the device (load_back it first)")
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode) -> int:
        """RadixCache's (checks, counts, leaves filed); then an unlocked node whose children
        are all host-only is filed too: it is a device leaf. O(depth)."""
        delta = super().dec_lock_ref(node)
        x: Any = node
        while delta and x.parent is not None and x.lock_ref == 0:  # the unlocked nodes: the path's tail
            self._file_if_leaf(x)
            x = x.parent
        return delta

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        hook = self._on_split
        if not child.vbuf:  # the policy keeps no state for host-only nodes
            self._on_split = None
        try:
            new: Any = super()._split(child, m)
        finally:
            self._on_split = hook
        c: Any = child
        pages = m // self._page_bytes
        if c.hbuf is not None:
            new.hbuf, c.hbuf = c.hbuf[:pages * 4], c.hbuf[pages * 4:]
            if c.id in self._dups:
                self._dups[new.id] = new
        if c.pkeys is not None:
            new.pkeys, c.pkeys = c.pkeys[:pages], c.pkeys[pages:]
        new.backed = c.backed
        return new  # type: ignore[no-any-return]

    def _has_device_child(self, node: TreeNode) -> bool:
        return any(c.vbuf for c in node.children.values())

    def _file_if_leaf(self, node: TreeNode) -> None:
        """File ``node`` as an evictable device leaf if it now is one."""
        if node.parent is None or not node.vbuf or node.lock_ref or node.skey is not None:
            return
        if not self._has_device_child(node):
            node.skey = self._sort_key(node)
            self._leaves.add(node)

    def _host_leaf(self, node: TierNode) -> bool:
        """``node`` is in the tree, host-only and childless."""
        return node.hbuf is not None and not node.vbuf and not node.children and self._in_tree(node)

    def _host_alloc(self, n: int) -> np.ndarray | None:
        pages = self.host_alloc.alloc(n)
        if pages is None and n <= self.host_alloc.num_pages:
            self.evict_host(n - self.host_alloc.available_size())
            pages = self.host_alloc.alloc(n)
        return pages

    def _in_tree(self, node: TreeNode) -> bool:
        p: Any = node.parent
        return p is not None and p.children.get(node.kbuf[:self._page_bytes]) is node

    def _page_rows(self, node: TierNode) -> torch.Tensor | None:
        """``node``'s pages as host page rows ``[pages, page_bytes]`` (uint8, CPU, a copy a
        storage backup may keep): from its device rows, else its host pages; ``None`` when it
        is on neither tier."""
        if node.vbuf:
            return self.host_pool.gather(rows_tensor(node.vbuf, self.device))
        if node.hbuf is not None:
            return self.host_pool.pages[torch.from_numpy(np.frombuffer(node.hbuf, _I32).astype(np.int64))]
        return None

    def _drop_host_copy(self, node: TierNode) -> None:
        if node.hbuf is not None:
            self.host_alloc.free(np.frombuffer(node.hbuf, _I32))
            self._host_tokens -= len(node.kbuf) >> 2
            node.hbuf = None

    @staticmethod
    def _namespace(node: TreeNode) -> Hashable:
        x: Any = node
        while x.parent is not None:
            x = x.parent
        return x.extra_key  # type: ignore[no-any-return]

    def _moved(self, node: TreeNode, dst: str) -> None:
        """KV events of ``node``'s pages moving to tier ``dst``: ``BlockStored`` in ``dst``, then
        ``BlockRemoved`` from the tier they left (same hashes), so no consumer sees them absent
        (docs/events.md, section 6)."""
        if self.kv_events is None or not node.block_hashes:
            return
        parent: Any = node.parent
        ph = parent.block_hashes[-1] if parent.parent is not None and parent.block_hashes else None
        self.kv_events.on_moved(node.block_hashes, dst, ph, np.frombuffer(node.kbuf, _I32), self._namespace(node))


    def _write_through(self, leaf: TierNode) -> None:
        """``write_through``: copy the new device leaf ``leaf``'s pages to fresh host pages
        (one batched copy, done before return); skipped when the host has no room even after
        dropping host-only leaves. O(pages)."""
        if self.write_policy != "write_through" or leaf.hbuf is not None or not leaf.vbuf:
            return
        pages = self._host_alloc(len(leaf.kbuf) // self._page_bytes)
        if pages is None:
            return
        ev = self.host_pool.store(torch.from_numpy(pages.astype(np.int64)), rows_tensor(leaf.vbuf, self.device))
        if ev is not None:
            ev.synchronize()
        leaf.hbuf = pages.tobytes()
        self._host_tokens += len(leaf.kbuf) >> 2
        self.tier_stats["written_through_pages"] += int(pages.size)

    def _copy_demoted(self, demoted: list[tuple[TierNode, np.ndarray, bytes]]) -> None:
        """The demotion copy of one ``evict``: ``(node, host pages, device rows)`` in one batched
        copy, done before return (the caller frees the rows); a node dropped since its demotion
        (under a later victim) is skipped: its pages went back, a later victim may hold them.
        O(pages)."""
        demoted = [d for d in demoted if d[0].hbuf is not None]
        if not demoted:
            return
        pages = np.concatenate([p for _, p, _ in demoted])
        ev = self.host_pool.store(torch.from_numpy(pages.astype(np.int64)),
                                  rows_tensor(b"".join(r for _, _, r in demoted), self.device))
        if ev is not None:
            ev.synchronize()
        self.tier_stats["demoted_pages"] += int(pages.size)

    def _record_removed(self, order: list[TierNode], top_medium: str = MEDIUM_CPU) -> None:
        """KV events of the subtree ``order`` (its top first, parents before children) leaving
        the tree: ``BlockRemoved`` children first (no removal leaves an orphan: a router
        refuses one), the top's on ``top_medium``, the rest (host-only) on ``CPU``."""
        if self.kv_events is None:
            return
        top = order[0] if order else None
        for x in reversed(order):
            self.kv_events.on_removed(x.block_hashes or (), top_medium if x is top else MEDIUM_CPU)

    def _drop_lru_host_leaves(self, need: int, freed: int, drop: Callable[[TierNode, int], int]) -> int:
        """Call ``drop(leaf, pages still needed)`` (it returns the host pages it freed) on
        host-only leaves off ``_host_heap``, least recently used first, until ``freed``
        reaches ``need`` or none is left: stale entries are skipped or re-filed, pinned ones
        kept and filed again. Returns ``freed``. O(log H) a leaf."""
        victims = self._lru_host_leaves()
        try:
            while freed < need:
                node = next(victims, None)
                if node is None:
                    break
                freed += drop(node, need - freed)
        finally:
            victims.close()
        return freed

    def _lru_host_leaves(self) -> Generator[TierNode, None, None]:
        """The leaves :meth:`_drop_lru_host_leaves` drops (pinned ones filed again on close)."""
        heap = self._host_heap
        kept: list[tuple[int, int, TierNode]] = []
        try:
            while heap:
                item = heapq.heappop(heap)
                node = item[2]
                if not self._host_leaf(node):
                    continue
                if node.id in self._pinned:
                    kept.append(item)
                    continue
                if node.last_access != item[0]:
                    heapq.heappush(heap, (node.last_access, node.id, node))
                    continue
                yield node
        finally:
            for item in kept:
                heapq.heappush(heap, item)

    def _walk(self, head: TreeNode, buf: bytes, n: int) -> tuple[list[TierNode], int]:
        """The nodes matching ``buf[:n]`` over both tiers (a match ending inside a node
        splits it at the page boundary), each touched; returns them and the bytes matched."""
        pb, node, pos, tick = self._page_bytes, head, 0, self._clock
        path: list[TierNode] = []
        while pos < n:
            child: Any = node.children.get(buf[pos:pos + pb])
            if child is None:
                break
            kb = child.kbuf
            split = not buf.startswith(kb, pos, n)
            if split:
                m = common_prefix_tokens(kb, buf, pos, n)
                child = self._split(child, (m - m % self.page_size) * 4)
                kb = child.kbuf
            tick += 1
            child.last_access = tick
            child.hits += 1
            if self._on_hit is not None and child.vbuf:  # the policy orders device nodes only
                self._on_hit(child)
            if not self._lazy and child.skey is not None:
                self._refile(child)
            pos += len(kb)
            path.append(child)
            node = child
            if split:
                break
        self._clock = tick
        return path, pos
