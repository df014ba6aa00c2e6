"""``StateStorageMixin``: the storage tier (L3) of a hybrid tree
(:class:`~radixkv.cache.hybrid.tiered_mamba_cache.TieredMambaRadixCache`). KV pages go under
the KV tier's chained page keys; a Mamba state under a key derived from the page key at its
position and the state layout's fingerprint, as ``chunks`` page-sized rows (one controller and
one backend hold both; a foreign layout's state is never found).

Backup: a node that gets a device state (admit ``all``; ``reused``: once a match hits it again)
queues its path's pages not yet queued and the state in one ``backup``. Fetch: a match asks
for the pages past its walk, then for the deepest page end past the path's deepest state (in
the path, or past it where the pages are stored) with every chunk of a state stored
(``last_present``), then that state (read whole, else a counted miss): into a host state slot
on the path's node there (split there), or with the KV up to it in host pages as a new
host-only leaf; ``load_back`` takes either to the device. No state: no hit. Its three waits
share one deadline (the controller's timeout); KV events: a leaf's pages ``BlockStored(CPU)``,
then the state ``StateStored(CPU)``. The story: docs/tiers.md.
"""
from __future__ import annotations

import hashlib
import heapq
import struct
import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.cache.block_hash import encode_extra_key
from radixkv.cache.kv_events import MEDIUM_CPU
from radixkv.cache.radix_key import RadixKey
from radixkv.cache.tiered_cache import TierNode
from radixkv.cache.tree_node import NamespaceHead, TreeNode, sync_only
from radixkv.errors import InvalidArgumentError
from radixkv.memory.host_state_pool import HostStatePool
from radixkv.storage.keys import layout_fingerprint, page_keys, storage_seed

if TYPE_CHECKING:
    from radixkv.allocator.host_pages import HostPageAllocator
    from radixkv.cache.hybrid.host_states import HostStateTable
    from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
    from radixkv.memory.host_kv_pool import HostKVPool
    from radixkv.storage.tier_controller import StorageController

    _Base = MambaRadixCache
else:
    _Base = object

__all__ = ["StateStorageMixin", "state_fingerprint", "STATE_KEY_VERSION"]
_I32 = np.dtype(np.int32)
#: Bumped whenever the state format or its key derivation changes: old states become misses.
STATE_KEY_VERSION = b"radixkv/state/v1"
_RECENT = 4096  # nodes remembered as holding a stored state (a state loaded back is not queued again)


def state_fingerprint(pool: HostStatePool) -> str:
    """A digest of the state layout (layers, shapes and dtypes of the conv and temporal
    states): a state stored by another layout is never loaded."""
    c, t = pool.conv, pool.temporal
    return layout_fingerprint(kind="state", conv=(c.shape[0], *c.shape[2:]), conv_dtype=c.dtype,
                              temporal=(t.shape[0], *t.shape[2:]), temporal_dtype=t.dtype)


class StateStorageMixin(_Base):
    """Storage for a hybrid tree with host tiers (mixed in first). ``storage_stats``:
    ``states_queued`` / ``states_fetched``, ``state_misses`` (stored KV without a whole
    stored state: absent, short or corrupt chunks), ``states_fetched_in_tree`` (of the
    fetched, states for KV the tree held) and ``in_tree_state_tokens`` (their hit tokens past
    the path's deepest state). Costs: a backup O(path) + the new pages' hashes + one state
    copy; a fetch one hash per page asked or newly keyed and <= one storage timeout."""

    if TYPE_CHECKING:  # the tree's (TieredMambaRadixCache, HostTierMixin)
        host_pool: HostKVPool
        host_alloc: HostPageAllocator
        _hstates: HostStateTable
        _pinned: set[int]
        _host_tokens: int
        _host_heap: list[tuple[int, int, TierNode]]

        def _host_alloc(self, n: int) -> np.ndarray | None: ...

        def _page_rows(self, node: TierNode) -> torch.Tensor | None: ...

        def _in_tree(self, node: TreeNode) -> bool: ...

    def _init_storage(self, storage: StorageController | None, fingerprint: str) -> None:
        self.storage = storage
        self._fingerprint = fingerprint
        self._seeds: dict[Hashable, bytes] = {}
        hsp: HostStatePool = self._hstates_pool()
        self._state_fp = state_fingerprint(hsp).encode("ascii")
        pb = self.host_pool.page_bytes
        self._chunks = -(-hsp.slot_bytes // pb)
        self._recent: OrderedDict[int, None] = OrderedDict()  # node ids
        self._probed: OrderedDict[int, None] = OrderedDict()  # stateless nodes whose page ends storage lacked
        self.storage_stats = {"states_queued": 0, "states_fetched": 0, "state_misses": 0,
                              "states_fetched_in_tree": 0, "in_tree_state_tokens": 0}

    def _hstates_pool(self) -> HostStatePool:
        pool = self.host_state_pool
        if not isinstance(pool, HostStatePool):
            raise InvalidArgumentError("a hybrid storage tier needs a host state tier")
        return pool

    # ------------------------------------------------------------------ keys
    def _storage_seed(self, ns: Hashable) -> bytes:
        seed = self._seeds.get(ns)
        if seed is None:
            seed = self._seeds[ns] = storage_seed(encode_extra_key(ns), self._fingerprint)
        return seed

    def _keyed_path(self, node: Any) -> list[Any]:
        """The nodes from the namespace head (excluded) down to ``node``, each given its
        page keys if it had none. O(depth) + one hash per page newly keyed."""
        path: list[Any] = []
        x = node
        while x.parent is not None:
            path.append(x)
            x = x.parent
        path.reverse()
        prior: str | None = None
        seed = self._storage_seed(x.extra_key)
        for y in path:
            if y.pkeys is None:
                y.pkeys = page_keys(np.frombuffer(y.kbuf, _I32).copy(), self.page_size, seed, prior)
            prior = y.pkeys[-1]
        return path

    def _state_key(self, kv_key: str) -> str:
        return hashlib.sha256(STATE_KEY_VERSION + bytes.fromhex(kv_key) + self._state_fp).hexdigest()

    def _chunk_keys(self, state_key: str) -> list[str]:
        base = bytes.fromhex(state_key)
        return [hashlib.sha256(base + struct.pack("<I", j)).hexdigest() for j in range(self._chunks)]

    # ------------------------------------------------------------------ backup
    def _storage_backup(self, node: Any) -> None:
        """Queue the pages of ``node``'s path not yet queued and its device state (one
        ``backup``); nothing when it holds no device state or its state was queued lately."""
        st = self.storage
        slot = self._states.slot_of.get(node)
        if st is None or slot is None or node.parent is None:
            return
        if node.id in self._recent:
            return
        path = self._keyed_path(node)
        skey = self._state_key(node.pkeys[-1])
        keys: list[str] = []
        rows: list[torch.Tensor] = []
        fresh: list[TierNode] = []
        for x in path:
            if x.backed:
                continue
            r = self._page_rows(x)
            if r is None:
                return
            keys += x.pkeys
            rows.append(r)
            fresh.append(x)
        pb = self.host_pool.page_bytes
        state = torch.zeros(self._chunks * pb, dtype=torch.uint8)
        raw = self._hstates_pool().device_state_bytes(slot)
        state[:raw.numel()] = raw
        rows.append(state.view(self._chunks, pb))
        keys += self._chunk_keys(skey)
        if st.backup(keys, torch.cat(rows)):
            for x in fresh:
                x.backed = True
            self._remember(node)
            self.storage_stats["states_queued"] += 1

    def _remember(self, node: TreeNode) -> None:
        """Note that storage holds ``node``'s state (queued or read): not queued again while
        remembered (a node made anew, e.g. after a drop, is queued again: ids are never reused)."""
        self._probed.pop(node.id, None)
        self._note(self._recent, [node.id])

    @staticmethod
    def _note(ids: OrderedDict[int, None], new: list[int]) -> None:
        """Add ``new`` node ids to the bounded LRU set ``ids`` (the oldest forgotten past 4096)."""
        for i in new:
            ids[i] = None
            ids.move_to_end(i)
        while len(ids) > _RECENT:
            ids.popitem(last=False)

    # ------------------------------------------------------------------ fetch
    def _storage_fetch(self, key: RadixKey, head: TreeNode | None, path: list[Any], pos: int,
                       n: int) -> tuple[list[Any], int, TierNode | None]:
        """Storage's part of a match whose walk gave ``path`` (``pos`` bytes of ``key``;
        ``head``: its namespace head or ``None``): the deepest stored state at a page end past
        the path's deepest state, within the path (attached to its node, split there, as a
        host state: :meth:`_attach_stored`) or past it, as far as storage holds the KV (a new
        host-only leaf, :meth:`_adopt_stored`). Returns the path and ``pos`` (a host drop may
        shorten them) and that leaf or ``None``. Its waits share one deadline, the controller's
        timeout from the start; costs one hash per page asked or newly keyed. Path nodes whose
        page ends a whole probe found absent are skipped later (``_probed``)."""
        st = self.storage
        if st is None:
            return path, pos, None
        deadline = time.monotonic() + st.timeout_s
        pb = self._page_bytes
        inside: list[str] = []  # page keys of the path's pages past its deepest state, not known absent
        ends: list[int] = []  # their end positions (bytes)
        tail: list[Any] = []  # the nodes holding them
        prior, best = None, 0
        if path:
            keyed = self._keyed_path(path[-1])
            prior = keyed[-1].pkeys[-1]
            dev, hosted = self._states.slot_of, self._hstates.slot_of
            depth = i0 = 0
            for i, x in enumerate(keyed):
                depth += len(x.kbuf)
                if x in dev or x in hosted:
                    best, i0 = depth, i + 1
            depth = best
            for x in keyed[i0:]:  # a state ends a node: the stretch is whole nodes
                if x.id not in self._probed:
                    tail.append(x)
                    inside += x.pkeys
                    ends += range(depth + pb, depth + len(x.kbuf) + 1, pb)
                depth += len(x.kbuf)
        keys: list[str] = []
        rows = torch.empty(0, dtype=torch.uint8)
        if pos < n:
            tokens = np.frombuffer(key._buf, _I32, count=(n - pos) >> 2, offset=pos).copy()
            keys = page_keys(tokens, self.page_size, self._storage_seed(key.extra_key), prior)
            rows = st.fetch(keys, deadline - time.monotonic())
        k = int(rows.shape[0])
        if not inside and not k or time.monotonic() >= deadline:  # (a KV read's timeout is counted)
            return path, pos, None
        groups = [self._chunk_keys(self._state_key(x)) for x in inside + keys[:k]]
        j = st.last_present(groups, deadline - time.monotonic())
        state = st.fetch(groups[j], deadline - time.monotonic()) if j >= 0 else None
        if state is None or int(state.shape[0]) < self._chunks:
            if time.monotonic() < deadline:  # else a timeout (counted), not a miss
                self.storage_stats["state_misses"] += int(bool(k or j >= 0))
                if j < 0:  # every candidate absent: not asked again (a state queued there may not have landed)
                    idle = st.stats.pending == 0
                    self._note(self._probed, [x.id for x in tail if idle or x.id not in self._recent])
            return path, pos, None
        if j < len(inside):  # a state within the path: its KV is the tree's
            end = ends[j]
            path = self._attach_stored(path, end, state)
            self.storage_stats["in_tree_state_tokens"] += (end - best) >> 2
            return path, sum(len(y.kbuf) for y in path), None
        j -= len(inside)
        node = path[-1] if path else head
        leaf = self._adopt_stored(key, node, pos, keys[:j + 1], rows[:j + 1], state)
        if leaf is None:
            return path, pos, None
        return path + [leaf], pos + len(leaf.kbuf), leaf

    def _attach_stored(self, path: list[Any], end: int, state: torch.Tensor) -> list[Any]:
        """Give the path's node ending at ``end`` bytes (a page end past the path's deepest
        state; the node holding that page is split there if it runs past) ``state`` as a host
        state (announced ``StateStored(CPU)``), and return the path up to that node: nodes past
        it and still linked (a full host state table's drop may take some)."""
        depth = i = 0
        while depth + len(path[i].kbuf) < end:  # end <= the path's end: i stays in it
            depth += len(path[i].kbuf)
            i += 1
        x, rest = path[i], path[i + 1:]
        if depth + len(x.kbuf) > end:
            rest = path[i:]
            x = self._split(x, end - depth)
        hslot, gone = self._hstates.demote(x, end >> 2)
        self._hstates_pool().write_state_bytes(hslot, state)
        if gone is not None:
            self._host_state_dropped(gone)
        if x.skey is not None:  # a filed leaf: its state-aware order key changed
            self._refile(x)
        self._remember(x)
        self.storage_stats["states_fetched"] += 1
        self.storage_stats["states_fetched_in_tree"] += 1
        out = path[:i] + [x]
        for y in rest:
            if not self._in_tree(y):
                break
            out.append(y)
        return out

    def _adopt_stored(self, key: RadixKey, node: TreeNode | None, pos: int, keys: list[str],
                      rows: torch.Tensor, state: torch.Tensor) -> TierNode | None:
        """Link a host-only leaf holding ``rows`` (host pages) and ``state`` (a host state
        slot) under ``node``, its ancestors pinned meanwhile; ``None`` without host room."""
        pinned: list[int] = []
        x: Any = node
        while x is not None and x.parent is not None:
            pinned.append(x.id)
            x = x.parent
        self._pinned.update(pinned)
        try:
            pages = self._host_alloc(len(keys))  # may drop other host leaves (and an emptied head)
            if pages is None:
                return None
            self.host_pool.write_rows(torch.from_numpy(pages.astype(np.int64)), rows)
            if node is None or node.parent is None:
                node = self._heads.get(key.extra_key)
                if node is None:
                    node = self._heads[key.extra_key] = NamespaceHead(self._new_id(), key.extra_key)
            size = len(keys) * self._page_bytes
            kb = key._buf[pos:pos + size]
            self._clock += 1
            leaf = TierNode(self._new_id(), node, kb, b"", self._clock)
            leaf.hbuf, leaf.pkeys, leaf.backed, leaf.hits = pages.tobytes(), list(keys), True, 1
            if self.kv_events is not None:  # announced on the host tier, before its state is
                ph = node.block_hashes[-1] if node.parent is not None and node.block_hashes else None
                leaf.block_hashes = self.kv_events.on_stored(ph, np.frombuffer(kb, _I32), key.extra_key,
                                                             MEDIUM_CPU)
            node.children[kb[:self._page_bytes]] = leaf
            sync_only(node)
            self._host_tokens += size >> 2
            pinned.append(leaf.id)
            self._pinned.add(leaf.id)
            hslot, gone = self._hstates.demote(leaf, (pos + size) >> 2)
            self._hstates_pool().write_state_bytes(hslot, state)
            if gone is not None:
                self._host_state_dropped(gone)
            heapq.heappush(self._host_heap, (leaf.last_access, leaf.id, leaf))
            self._remember(leaf)  # loaded back, its state is not written again
            self.storage_stats["states_fetched"] += 1
            return leaf
        finally:
            self._pinned.difference_update(pinned)
