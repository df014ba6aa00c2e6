"""Index allocators: free lists of ids held in device tensors (pure bookkeeping).

* ``FreeSlots``: a free list of ids ``1..size`` (request rows, Mamba slots, ...).
* ``TokenToKVPoolAllocator``: KV slots one at a time (page size 1).
* ``PagedTokenToKVPoolAllocator``: KV slots by whole pages, with ``alloc_extend`` /
  ``alloc_decode``.
"""
from radixkv.allocator.base import AllocatorStats, BaseKVAllocator
from radixkv.allocator.free_slots import FreeSlots
from radixkv.allocator.page_free_list import (
    FreeGroupError,
    FreeListCounts,
    FreeListState,
    PageFreeList,
    StaleBackupError,
)
from radixkv.allocator.paged_allocator import PagedTokenToKVPoolAllocator
from radixkv.allocator.token_allocator import TokenToKVPoolAllocator

__all__ = [
    "AllocatorStats",
    "BaseKVAllocator",
    "FreeGroupError",
    "FreeListCounts",
    "FreeListState",
    "FreeSlots",
    "PageFreeList",
    "PagedTokenToKVPoolAllocator",
    "StaleBackupError",
    "TokenToKVPoolAllocator",
]
