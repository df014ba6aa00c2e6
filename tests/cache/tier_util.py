"""Helpers for the tier tests: a tiered cache over real pools, the scheduler's cycle on it,
and KV contents that name their own prefix (so a page put back in the wrong place shows)."""
from __future__ import annotations

import numpy as np
import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache.radix_key import RadixKey
from radixkv.cache.tiered_cache import TieredRadixCache
from radixkv.memory.host_kv_pool import HostKVPool
from radixkv.memory.kv_pool import MHATokenToKVPool


def make_cache(ps=1, device_tokens=32, host_tokens=64, write_policy="write_back", storage=None,
               layers=2, events=False):
    kv = MHATokenToKVPool(device_tokens, ps, torch.float64, 1, 2, layers)
    if ps == 1:
        alloc = TokenToKVPoolAllocator(device_tokens, "cpu", kvcache=kv)
    else:
        alloc = PagedTokenToKVPoolAllocator(device_tokens, ps, "cpu", kvcache=kv)
    host = HostKVPool(kv, host_tokens // ps)
    return TieredRadixCache(None, alloc, host_pool=host, page_size=ps, write_policy=write_policy,
                            storage=storage, layout_fingerprint="test", enable_kv_events=events)


def kv_of(tokens: np.ndarray) -> torch.Tensor:
    """The KV value of each position: a function of the prefix up to it (a rolling hash)."""
    h = np.cumsum((tokens.astype(np.int64) + 7) * 1_000_003 % 9_999_991) % 1_000_000
    return torch.from_numpy(h.astype(np.float64) + np.arange(tokens.size) * 1e-3)


def write_kv(cache: TieredRadixCache, rows: torch.Tensor, values: torch.Tensor) -> None:
    kv = cache.host_pool.kv_pool
    for layer in range(kv.layer_num):
        kv.k_buffer[layer][rows] = (values + layer).view(-1, 1, 1).expand(-1, 1, 2)
        kv.v_buffer[layer][rows] = (-values - layer).view(-1, 1, 1).expand(-1, 1, 2)


def read_kv(cache: TieredRadixCache, rows: torch.Tensor) -> torch.Tensor:
    kv = cache.host_pool.kv_pool
    k0 = kv.k_buffer[0][rows][:, 0, 0]
    for layer in range(kv.layer_num):
        assert torch.equal(kv.k_buffer[layer][rows][:, 0, 0], k0 + layer)
        assert torch.equal(kv.v_buffer[layer][rows][:, 0, 1], -k0 - layer)
    return k0


def record_stores(cache) -> list[list[int]]:
    """The host page ids of each ``host_pool.store`` call (a demotion copy) on ``cache`` from now on."""
    stores: list[list[int]] = []
    store = cache.host_pool.store

    def spy(pages, rows):
        stores.append(pages.tolist())
        return store(pages, rows)

    cache.host_pool.store = spy
    return stores


def check_copies_hit_held_pages_once(cache, stores: list[list[int]]) -> None:
    """No copy in ``stores`` wrote a host page twice, and every page written is held by a node."""
    written = [p for s in stores for p in s]
    assert len(written) == len(set(written)), f"one demotion copy wrote pages twice: {stores}"
    held = {int(p) for x in cache.iter_nodes() if x.hbuf for p in np.frombuffer(x.hbuf, np.int32)}
    assert written and set(written) <= held, f"a demotion copy wrote freed host pages: {stores}"


def serve(cache: TieredRadixCache, tokens: np.ndarray, extra_key=None) -> tuple[int, int, int]:
    """One request through the scheduler's cycle (match, load back, lock, alloc, insert, free
    duplicates, unlock), checking the reused KV. Returns (device, host, storage) tokens hit.
    A request that does not fit the device is skipped after its match (returns the hits)."""
    ps = cache.page_size
    n = tokens.size - tokens.size % ps
    key = RadixKey(tokens[:n], extra_key)
    m = cache.match_prefix(key)
    dev, host, sto = m.prefix_len, m.host_len - m.storage_len, m.storage_len
    m = cache.load_back(m)
    cache.wait_loads()
    pre = m.prefix_len
    want = kv_of(tokens[:n])
    if pre:
        got = read_kv(cache, m.device_indices)
        assert torch.equal(got, want[:pre]), "reused KV differs from the from-scratch KV"
    cache.inc_lock_ref(m.last_node)
    alloc = cache.token_to_kv_pool_allocator
    need = n - pre
    if alloc.available_size() < need:
        cache.evict(need - alloc.available_size())
    new = alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
    if new is None:
        cache.dec_lock_ref(m.last_node)
        return dev, host, sto
    write_kv(cache, new, want[pre:])
    value = torch.cat([m.device_indices, new])
    got_prefix, node, path = cache._insert(key, value, 0)
    tree = torch.from_numpy(np.frombuffer(b"".join(x.vbuf for x in path), np.int32).astype(np.int64))
    own = value[pre:got_prefix]
    dup = own[own != tree[pre:got_prefix]]
    if dup.numel():
        alloc.free(dup)
    cache.dec_lock_ref(m.last_node)
    return dev, host, sto
