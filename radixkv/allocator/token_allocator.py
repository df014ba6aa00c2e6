"""``TokenToKVPoolAllocator``: hands out single KV slots (page size 1), SGLang style.

Slots are ``1..size``; slot 0 is the padding slot and is never handed out. Costs: see
``radixkv.allocator.page_free_list`` (alloc O(n); free O(k log k) with checks; backup O(1)).
"""
from __future__ import annotations

import torch

from radixkv.allocator.base import BaseKVAllocator
from radixkv.allocator.page_free_list import id_runs
from radixkv.contracts import IndexLike, KVPool
from radixkv.validation import check_count, check_range, index_tensor


class TokenToKVPoolAllocator(BaseKVAllocator):
    """KV slot allocator with page size 1.

    Args:
        size: usable slots (ids ``1..size``).
        device: where indices live; ``alloc`` returns int64 tensors on it.
        need_sort: freed slots wait in ``release_pages`` and are merged, sorted, into
            ``free_pages`` only when an ``alloc`` would otherwise fall short.
        kvcache: the KV buffer object this allocator serves (``get_kvcache()``).
        checks: validate ``free`` (off only for benchmarks: bad frees then corrupt state).
        dtype, enable_memory_saver: SGLang's arguments, by keyword (see ``BaseKVAllocator``;
            SGLang's positional order is ``(size, dtype, device, kvcache, need_sort)``).
    """

    def __init__(self, size: int, device: torch.device | str = "cpu", need_sort: bool = False,
                 kvcache: KVPool | None = None,
                 checks: bool = True, *, dtype: torch.dtype | None = None, enable_memory_saver: bool = False):
        super().__init__(size, 1, device, need_sort, kvcache, checks, kind="slot", dtype=dtype,
                         enable_memory_saver=enable_memory_saver)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free slots (int64 on ``device``), or None (state unchanged) when
        fewer are available. O(need_size), plus a merge under need_sort when needed.

        Raises InvalidArgumentError for a negative or non-int ``need_size``."""
        return self._fl.alloc(check_count(need_size, "need_size"))

    def free(self, free_index: IndexLike) -> None:
        """Return slots (int32/int64 tensor or numpy array, any shape). Inside a free group
        they are released at ``free_group_end()``. O(k log k) with checks; O(k) when the
        slots form a few runs of consecutive ids (a leaf's rows, a request's).

        Raises (state unchanged): InvalidArgumentError (non-integer dtype),
        InvalidIndexError (slot 0 or > size), DoubleFreeError (already free, pending
        release, in the open group, or repeated in the call)."""
        ids = index_tensor(free_index, self.device, "free_index", sequences=False)
        if self.checks and ids.device.type == "cpu":
            # the compiled one-pass free when built; else an evicted leaf's / a request's
            # slots are a few runs of consecutive ids: checked per run (no sort); anything
            # else, or a bad free, takes the exact path
            if self._fl.free_host(ids.numpy()):
                return
            runs = id_runs(ids.numpy())
            if runs is not None and self._fl.free_runs(*runs, ids=ids.numpy()):
                return
        self._fl.free(ids)

    def is_free(self, indices: IndexLike) -> torch.Tensor:
        """Bool tensor: whether each slot is not in use (free, pending or in a group).
        Raises InvalidIndexError for slots outside ``0..size``. O(k)."""
        ids = index_tensor(indices, self.device, "indices", sequences=False)
        check_range(ids, 0, self.size + 1, "slots")
        return self._fl.is_free(ids)
