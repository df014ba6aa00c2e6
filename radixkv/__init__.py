"""radixkv: a prefix (KV) cache manager for LLM serving.

Layers (bottom up), following SGLang's memory pool:

* ``radixkv.contracts``  the Protocols between the layers below (read it first), beside
  ``radixkv.errors`` (the one error hierarchy) and ``radixkv.validation`` (input checks)
* ``radixkv.allocator``  index allocators for KV rows (token and paged)
* ``radixkv.memory``     request-to-token table, KV buffers, Mamba state pool, hybrid pools
* ``radixkv.cache``      the RadixCache (token prefix -> KV rows)
* ``radixkv.scheduler``  the scheduler flow (alloc_for_extend / alloc_for_decode / release)
* ``radixkv.engine``     the cache-engine protocol and ``CacheEngine`` (embedded mode)
* ``radixkv.service``    the gRPC cache manager and ``connect()`` (service mode)
"""
from typing import TYPE_CHECKING, Any

from radixkv.errors import (  # noqa: F401
    CapacityError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    InvariantError,
    NotFoundError,
    PermissionDeniedError,
    RadixKVError,
    StaleSessionError,
    UnauthenticatedError,
)

__version__ = "0.1.0"

#: The public classes and functions importable from ``radixkv`` itself, each loaded from its
#: layer on first use (module ``__getattr__``), so that ``import radixkv`` stays cheap: no
#: torch pools, no tree, no gRPC until one of them is touched.
_LAZY: dict[str, str] = {
    **dict.fromkeys(("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"), "radixkv.allocator"),
    **dict.fromkeys(("ReqToTokenPool", "MHATokenToKVPool", "MLATokenToKVPool", "MambaPool",
                     "HybridLinearKVPool", "HybridReqToTokenPool"), "radixkv.memory"),
    **dict.fromkeys(("RadixCache", "RadixKey", "MambaRadixCache", "MatchResult", "EvictionPolicy",
                     "register_policy", "available_policies"), "radixkv.cache"),
    **dict.fromkeys(("Req", "Batch", "alloc_for_extend", "alloc_for_decode", "release_kv_cache"),
                    "radixkv.scheduler"),
    **dict.fromkeys(("CacheEngine", "EngineConfig", "ExtendItem", "DecodeItem", "MatchQuery", "EngineStats"),
                    "radixkv.engine"),
    "connect": "radixkv.service.client",
}

__all__ = [
    "CapacityError", "DoubleFreeError", "InvalidArgumentError", "InvalidIndexError", "InvariantError",
    "NotFoundError", "PermissionDeniedError", "RadixKVError", "StaleSessionError", "UnauthenticatedError",
    "__version__", *_LAZY,
]

if TYPE_CHECKING:
    from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: F401
    from radixkv.cache import (  # noqa: F401
        EvictionPolicy,
        MambaRadixCache,
        MatchResult,
        RadixCache,
        RadixKey,
        available_policies,
        register_policy,
    )
    from radixkv.engine import CacheEngine, DecodeItem, EngineConfig, EngineStats, ExtendItem, MatchQuery  # noqa: F401
    from radixkv.memory import (  # noqa: F401
        HybridLinearKVPool,
        HybridReqToTokenPool,
        MambaPool,
        MHATokenToKVPool,
        MLATokenToKVPool,
        ReqToTokenPool,
    )
    from radixkv.scheduler.batch import Batch  # noqa: F401
    from radixkv.scheduler.flow import alloc_for_decode, alloc_for_extend, release_kv_cache  # noqa: F401
    from radixkv.scheduler.req import Req  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value          # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
