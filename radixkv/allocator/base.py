"""``BaseKVAllocator``: what the token and paged KV allocators share.

A thin layer over ``PageFreeList`` (pure bookkeeping of page ids ``1..num_pages``) that
speaks in KV slots: ``available_size()`` is in tokens, states and stats are NamedTuples.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from radixkv.allocator.page_free_list import FreeListState, PageFreeList
from radixkv.contracts import KVPool
from radixkv.errors import InvalidArgumentError
from radixkv.validation import check_count


class AllocatorStats(NamedTuple):
    """Counts of one allocator (pages; with ``page_size == 1`` pages are slots).

    ``free_pages + release_pages + group_pages + used_pages == num_pages`` and
    ``available_size == (free_pages + release_pages) * page_size``.
    """

    size: int
    page_size: int
    num_pages: int
    available_size: int
    free_pages: int
    release_pages: int
    group_pages: int
    used_pages: int


class BaseKVAllocator:
    """Shared API of the KV slot allocators (see the subclasses for ``alloc``/``free``).

    Attributes:
        size: usable KV slots (``num_pages * page_size``); slot ids run up to
            ``size + page_size - 1`` because page 0 (slots ``0..page_size-1``) is reserved.
        page_size, num_pages, device, need_sort, checks.
        dtype: the KV dtype of the pool served (SGLang's ``dtype`` argument; kept for
            reference, the allocator hands out ids only). ``None`` when not given.
        enable_memory_saver: accepted for SGLang's signature; changes nothing.
        free_group, is_not_in_free_group: SGLang's names for the open free group (the id
            tensors freed into it so far) and whether none is open.
    """

    page_size: int = 1

    def __init__(self, size: int, page_size: int, device: torch.device | str, need_sort: bool,
                 kvcache: KVPool | None,
                 checks: bool, kind: str, dtype: torch.dtype | None = None, enable_memory_saver: bool = False):
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype or None, got {dtype!r}")
        self.dtype = dtype
        self.enable_memory_saver = bool(enable_memory_saver)
        size = check_count(size, "size")
        page_size = check_count(page_size, "page_size")
        if page_size < 1:
            raise InvalidArgumentError("page_size must be >= 1")
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self.need_sort = bool(need_sort)
        self.checks = bool(checks)
        self._kvcache = kvcache
        self._fl = PageFreeList(
            self.num_pages, self.device, need_sort=need_sort, checks=checks, kind=kind
        )

    # ------------------------------------------------------------------ queries
    def available_size(self) -> int:
        """Free KV slots, counting those pending in ``release_pages`` (not an open free
        group). O(1)."""
        return self._fl.available() * self.page_size

    def get_kvcache(self) -> KVPool | None:
        """The KV buffer object this allocator was built for (stored as given)."""
        return self._kvcache

    @property
    def free_pages(self) -> torch.Tensor:
        """A copy of the free list (page ids, slot ids when ``page_size == 1``) in hand-out
        order. O(free)."""
        return self._fl.free_ids()

    @property
    def release_pages(self) -> torch.Tensor:
        """A copy of the ids pending release (``need_sort``). O(pending)."""
        return self._fl.release_ids()

    def stats(self) -> AllocatorStats:
        """Counts as a NamedTuple. O(1)."""
        c = self._fl.counts()
        return AllocatorStats(
            self.size, self.page_size, self.num_pages, self.available_size(),
            c.free, c.release, c.group, c.in_use,
        )

    debug_state = stats

    # ------------------------------------------------------------------ batching
    def merge_and_sort_free(self) -> None:
        """Merge ``release_pages`` into ``free_pages`` and sort it. O(F log F)."""
        self._fl.merge_and_sort()

    @property
    def is_not_in_free_group(self) -> bool:
        """SGLang's flag: no free group is open (frees go straight to the free list)."""
        return not self._fl.in_group

    @property
    def free_group(self) -> list[torch.Tensor]:
        """SGLang's list of the id tensors freed into the open group (a copy; empty when
        none is open)."""
        return self._fl.group_ids()

    def free_group_begin(self) -> None:
        """Open a free group: frees until ``free_group_end()`` are validated one by one
        (a double free inside the group raises at once) and released together.

        Raises FreeGroupError when a group is already open."""
        self._fl.group_begin()

    def free_group_end(self) -> None:
        """Release every id freed since ``free_group_begin()`` in one batch.

        Raises FreeGroupError without an open group."""
        self._fl.group_end()

    # ------------------------------------------------------------------ backup
    def backup_state(self) -> FreeListState:
        """O(1) snapshot of the free list for ``restore_state``.

        A backup stays restorable until ``clear()``, until a restore of an older backup,
        or until the rings overwrite it: always for the speculative pattern (backup,
        allocate, restore), and with frees in between within the bounds spelled out in
        ``radixkv.allocator.page_free_list``. Restoring a lost backup raises
        StaleBackupError. Raises FreeGroupError inside a group.
        """
        return self._fl.backup()

    def restore_state(self, state: FreeListState) -> None:
        """Roll the free list back to ``state`` exactly (the slots allocated since are
        free again, the slots freed since are in use again). O(ids allocated and freed
        since the backup); O(free) when a need_sort merge ran since.

        Raises (unchanged): InvalidArgumentError (not a state of this allocator),
        FreeGroupError (group open), StaleBackupError (see ``backup_state``)."""
        self._fl.restore(state)

    def clear(self) -> None:
        """Free everything (ascending order), drop pending releases and an open group,
        invalidate backups. O(num_pages)."""
        self._fl.clear()

    def check_invariants(self) -> None:
        """Raise InvariantError (naming the ids) unless no id is both free and in use, no
        id is held twice across free_pages, release_pages and the open free group, and
        ``available + group + in use == num_pages``. O(num_pages)."""
        self._fl.check_invariants(type(self).__name__)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.stats()}, device={self.device})"
