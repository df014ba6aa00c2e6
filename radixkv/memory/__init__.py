"""Memory pools (SGLang's memory pool, layers 1 and 3): each pool's tensors are views into one
contiguous allocation (:mod:`radixkv.memory.arena`), so a pool is one block of memory.

* ``ReqToTokenPool``: request row -> KV indices table.
* ``MHATokenToKVPool`` / ``MLATokenToKVPool``: per-token K/V buffers of full-attention layers.
* ``MambaPool`` / ``KimiLinearStateShape``: fixed-size recurrent state slots (KDA / Mamba);
  ``KimiLinearCacheParams``: a KDA model's state shape, layers and dtypes.
* ``HybridReqToTokenPool`` / ``HybridLinearKVPool``: the hybrid (linear + full attention) pools.
"""
from radixkv.memory.arena import Arena, ArenaLayout, TensorSpec, plan_layout
from radixkv.memory.cache_params import KimiLinearCacheParams, Mamba2StateDType
from radixkv.memory.hybrid import HybridReqToTokenPool
from radixkv.memory.hybrid_kv import HybridLinearKVPool
from radixkv.memory.kv_pool import KVCache, KVSizeBytes, MHATokenToKVPool, MLATokenToKVPool
from radixkv.memory.mamba_pool import (
    KimiLinearStateShape,
    Mamba2LayerCache,
    MambaCache,
    MambaPool,
    MambaStateSizeBytes,
)
from radixkv.memory.req_to_token import ReqToTokenPool

__all__ = [
    "Arena", "ArenaLayout", "TensorSpec", "plan_layout",
    "ReqToTokenPool",
    "KVCache", "KVSizeBytes", "MHATokenToKVPool", "MLATokenToKVPool",
    "KimiLinearStateShape", "KimiLinearCacheParams", "Mamba2StateDType",
    "Mamba2LayerCache", "MambaCache", "MambaPool", "MambaStateSizeBytes",
    "HybridLinearKVPool", "HybridReqToTokenPool",
]
