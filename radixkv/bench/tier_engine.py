"""The real :class:`~radixkv.cache.tiered_cache.TieredRadixCache` as a hit-rate replay engine
(``radixkv bench hitrate --engine radix --host-capacity-frac H [--storage-capacity-frac S|inf]``).

The cycle is :class:`~radixkv.bench.radix_engine.RadixReplayEngine`'s, with the tiered
cache's steps: ``match_prefix`` over every tier, ``load_back`` of the host (and storage) pages
into device rows, lock; device eviction demotes to the host, host eviction drops (storage
keeps what it was given). The KV bytes are not moved: the host pool's copies are no-ops here
(:class:`CountingHostPool`), and the storage backend (:class:`CountingStorage`) keeps page keys
under an LRU capacity, so the replay measures the tiers' bookkeeping at trace scale. The bytes'
paths are tested in ``tests/cache`` and ``tests/engine``. A loaded padded page (the prompt's
last partial page) takes real rows for its padding tokens: a small capacity cost the
single-tier engine does not pay.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from radixkv.bench.radix_engine import PendingMatch, RadixReplayEngine
from radixkv.cache.radix_key import RadixKey
from radixkv.cache.tiered_cache import TieredRadixCache
from radixkv.errors import InvalidArgumentError
from radixkv.memory.host_kv_pool import HostKVPool
from radixkv.memory.kv_pool import MHATokenToKVPool
from radixkv.storage.tier_controller import StorageController

__all__ = ["CountingHostPool", "CountingStorage", "TieredReplayEngine"]


class CountingHostPool(HostKVPool):
    """A host pool whose copies move no bytes (the replay needs the bookkeeping only)."""

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros((torch.as_tensor(rows).numel() // self.kv_pool.page_size, self.page_bytes),
                           dtype=torch.uint8)

    def store(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        return None

    def snapshot(self, pages: torch.Tensor) -> torch.Tensor:
        return torch.empty(0)

    def load_from(self, src: torch.Tensor, rows: torch.Tensor) -> None:
        return None

    def load(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        return None

    def write_rows(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        return None


class CountingStorage:
    """A storage backend that keeps page keys (no bytes) under an LRU page capacity
    (``None``: unbounded). A get refreshes a page; a set past capacity drops the oldest."""

    name = "counting"

    def __init__(self, capacity_pages: int | None) -> None:
        self.capacity = capacity_pages
        self.pages: OrderedDict[str, None] = OrderedDict()

    def register_buffer(self, buffer: torch.Tensor) -> None:
        return None

    def batch_exists(self, keys: Sequence[str]) -> int:
        n = 0
        for k in keys:
            if k not in self.pages:
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[str], dst: torch.Tensor) -> list[bool]:
        out = []
        for k in keys:
            hit = k in self.pages
            if hit:
                self.pages.move_to_end(k)
            out.append(hit)
        return out

    def batch_set(self, keys: Sequence[str], src: torch.Tensor) -> list[bool]:
        for k in keys:
            self.pages[k] = None
            self.pages.move_to_end(k)
        while self.capacity is not None and len(self.pages) > self.capacity:
            self.pages.popitem(last=False)
        return [True] * len(keys)

    def close(self) -> None:
        return None


class TieredReplayEngine(RadixReplayEngine):
    """:class:`RadixReplayEngine` over a TieredRadixCache: ``capacity_tokens`` on the device,
    ``host_tokens`` on the host, and a storage tier of ``storage_tokens`` (``None``: off,
    ``-1``: unbounded), the host tier under ``write_policy``. ``tier_hits`` counts the prompt
    tokens each tier served."""

    def __init__(self, capacity_tokens: int, host_tokens: int, storage_tokens: int | None = None,
                 policy: str = "default", page_size: int = 16, write_policy: str = "write_back") -> None:
        super().__init__(capacity_tokens, policy, page_size)
        if host_tokens < page_size:
            raise InvalidArgumentError(f"the host tier needs at least one page ({page_size} tokens), "
                                       f"got {host_tokens}")
        kv = MHATokenToKVPool(max(page_size, 1), page_size, torch.float16, 1, 1, 1)
        host = CountingHostPool(kv, host_tokens // page_size)
        self.storage: StorageController | None = None
        if storage_tokens is not None:
            cap = None if storage_tokens < 0 else max(storage_tokens // page_size, 1)
            self.storage = StorageController(CountingStorage(cap), host.page_bytes, timeout_s=60.0)
        self.cache = TieredRadixCache(None, self.alloc, host_pool=host, page_size=self.page_size,
                                      eviction_policy=self.cache.policy, storage=self.storage,
                                      write_policy=write_policy)
        self.tier_hits = {"device": 0, "host": 0, "storage": 0}

    def match_prefix(self, tokens: np.ndarray) -> int:
        """Match over the tiers, load what fits back to the device, lock; returns the hit
        (device + loaded tokens of the prompt)."""
        if self._pending is not None:
            raise InvalidArgumentError("match_prefix called twice without insert")
        key = RadixKey(self._padded(tokens))
        cache = self.cache
        assert isinstance(cache, TieredRadixCache)
        m = cache.match_prefix(key)
        dev, h = m.prefix_len, m.host_len - m.storage_len
        m = cache.load_back(m)
        cache.inc_lock_ref(m.last_node)
        self._pending = PendingMatch(tokens, key, m.device_indices, m.last_node, m.prefix_len)
        n = len(tokens)
        got = min(m.prefix_len, n)
        d = min(dev, got)
        host = min(dev + h, got) - d
        self.tier_hits["device"] += d
        self.tier_hits["host"] += host
        self.tier_hits["storage"] += got - d - host
        return got

    def insert(self, tokens: np.ndarray) -> int:
        done = super().insert(tokens)
        if self.storage is not None:
            self.storage.drain(60.0)  # the replay is sequential: each backup lands before the next request
        return done

    def close(self) -> None:
        if self.storage is not None:
            self.storage.close(60.0)

    def check_invariants(self) -> None:
        super().check_invariants()
