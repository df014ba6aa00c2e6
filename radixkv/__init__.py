"""radixkv: a prefix (KV) cache manager for LLM serving.

Layers (bottom up), following SGLang's memory pool:

* ``radixkv.allocator``  index allocators for KV rows (token and paged)
* ``radixkv.memory``     request-to-token table, KV buffers, Mamba state pool, hybrid pools
* ``radixkv.cache``      the RadixCache (token prefix -> KV rows)
"""
from radixkv.errors import (  # noqa: F401
    RadixKVError,
    InvalidArgumentError,
    InvalidIndexError,
    DoubleFreeError,
    CapacityError,
    InvariantError,
)

__version__ = "0.1.0"
