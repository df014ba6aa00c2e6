"""The concrete classes satisfy the layer contracts of radixkv.contracts.

Checked twice: by mypy (this file is in ``[tool.mypy] files``: each annotated assignment is a
static check that the class matches the Protocol's signatures) and at run time here
(``isinstance`` against the ``runtime_checkable`` Protocols: every member is present).
"""
from __future__ import annotations

import pytest
import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
from radixkv.cache.radix_cache import RadixCache
from radixkv.contracts import (
    HybridPrefixCache,
    HybridReqTable,
    KVAllocator,
    KVPool,
    PagedKVAllocator,
    PrefixCache,
    ReqToTokenTable,
    StatePool,
)
from radixkv.memory import (
    HybridLinearKVPool,
    HybridReqToTokenPool,
    MambaPool,
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)


def _mamba_pool() -> MambaPool:
    return MambaPool(4, (3, 8), (2, 4, 4), num_layers=2)


def test_allocators_are_kv_allocators() -> None:
    token: KVAllocator = TokenToKVPoolAllocator(16)
    paged: PagedKVAllocator = PagedTokenToKVPoolAllocator(16, 4)
    assert isinstance(token, KVAllocator) and not isinstance(token, PagedKVAllocator)
    assert isinstance(paged, PagedKVAllocator)


def test_request_tables() -> None:
    plain: ReqToTokenTable = ReqToTokenPool(4, 8)
    hybrid: HybridReqTable = HybridReqToTokenPool(4, 8, _mamba_pool())
    assert isinstance(plain, ReqToTokenTable) and not isinstance(plain, HybridReqTable)
    assert isinstance(hybrid, HybridReqTable)


def test_kv_and_state_pools() -> None:
    mamba = MambaPool(4, (3, 8), (2, 4, 4), num_layers=2)
    state: StatePool = mamba
    mha = MHATokenToKVPool(16, 1, torch.float32, head_num=2, head_dim=4, layer_num=2)
    pools: list[KVPool] = [
        mha,
        MLATokenToKVPool(16, 1, torch.float32, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=2),
        HybridLinearKVPool(mha, [0, 2], mamba),
    ]
    assert all(isinstance(p, KVPool) for p in pools)
    assert isinstance(state, StatePool)


@pytest.mark.parametrize("hybrid", [False, True])
def test_trees(hybrid: bool) -> None:
    tree: PrefixCache
    if hybrid:
        mamba_tree: HybridPrefixCache = MambaRadixCache(HybridReqToTokenPool(4, 8, _mamba_pool()),
                                                        TokenToKVPoolAllocator(16))
        tree = mamba_tree
    else:
        tree = RadixCache(ReqToTokenPool(4, 8), TokenToKVPoolAllocator(16))
    for name in ("match_prefix", "inc_lock_ref", "dec_lock_ref", "evict", "evictable_size",
                 "protected_size", "all_values", "cache_finished_req"):
        assert callable(getattr(tree, name))
    assert isinstance(tree.token_to_kv_pool_allocator, KVAllocator)
    assert isinstance(tree.req_to_token_pool, ReqToTokenTable)
