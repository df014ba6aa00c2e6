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


def __getattr__(name):
    # Lazy: importing radixkv stays cheap (no torch pools, no gRPC) until these are used.
    if name in ("CacheEngine", "EngineConfig"):
        from radixkv import engine

        return getattr(engine, name)
    if name == "connect":
        from radixkv.service.client import connect

        return connect
    raise AttributeError(f"module 'radixkv' has no attribute {name!r}")
