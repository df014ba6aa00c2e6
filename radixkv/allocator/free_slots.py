"""``FreeSlots``: a free list of the integer ids ``1..size`` held in device tensors.

Pure bookkeeping, no KV data. Id 0 is the reserved padding id and is never handed out.
Used for request rows, Mamba state slots, and as the model of the KV slot allocators.

Cost model (k = ids in the call): ``alloc`` O(k), ``free`` O(k log k) with checks (the sort
finds duplicates within the call) and O(k) without; nothing on the hot path is O(size).
The free list is a preallocated ring buffer of ``size`` ids (FIFO: freed ids are handed
out after the ids already free) plus a bool "is free" mask of ``size + 1`` entries for the
vectorized double-free check. Memory: 5 bytes per id.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixkv.allocator.host_view import HostViews, set_mask
from radixkv.allocator.id_ring import IdRing
from radixkv.allocator.invariants import check_free_lists
from radixkv.contracts import IndexLike
from radixkv.errors import DoubleFreeError, InvalidArgumentError, InvalidIndexError, InvariantError, describe_ids
from radixkv.validation import (
    check_count,
    check_ids_to_free,
    check_range,
    index_tensor,
)


class FreeSlots(HostViews):
    """A free list of ids ``1..size`` on ``device``.

    Args:
        size: number of usable ids (ids ``1..size``); must be >= 0.
        device: where the ids live; ``alloc`` returns tensors on it.
        checks: validate ``free`` arguments (range, double free, duplicates, dtype). With
            ``checks=False`` (benchmarks only) a bad ``free`` corrupts the state silently.

    Every raising call leaves the state exactly unchanged.
    """

    def __init__(self, size: int, device: torch.device | str = "cpu", *, checks: bool = True):
        self.size = check_count(size, "size")
        self.device = torch.device(device)
        self.checks = bool(checks)
        self._ring = IdRing(self.size, self.device)
        self._free = torch.zeros(self.size + 1, dtype=torch.bool, device=self.device)
        self.clear()

    def available(self) -> int:
        """Number of free ids. O(1)."""
        return len(self._ring)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` free ids: an int64 tensor of ``n`` distinct ids on ``device``, or
        ``None`` (state unchanged) when fewer than ``n`` are free. O(n).

        Raises:
            InvalidArgumentError: ``n`` is not a non-negative int.
        """
        n = check_count(n)
        if n > len(self._ring):
            return None
        ids = self._ring.pop(n)
        if n:
            self._set_free(ids, False)
        return ids

    def _set_free(self, ids: torch.Tensor, value: bool) -> None:
        """``free_mask[ids] = value``; on CPU through the numpy view (no torch dispatch)."""
        set_mask(self._free, self._host_mask(), ids, value)

    def free(self, ids: IndexLike) -> None:
        """Return ``ids`` (an int32/int64 tensor or numpy array, any shape) to the free list.
        O(k log k) with checks, O(k) without.

        Raises (state unchanged):
            InvalidArgumentError: a non-integer dtype.
            InvalidIndexError: ids outside ``1..size`` (0 is the reserved padding id).
            DoubleFreeError: ids already free, or repeated within ``ids``.
        """
        ids = index_tensor(ids, self.device, "ids", sequences=False)
        if ids.numel() == 0:
            return
        if self.checks:
            check_ids_to_free(ids, self._free, 1, self.size)
        self._ring.push(ids)
        self._set_free(ids, True)

    def _host_mask(self) -> np.ndarray | None:
        """The numpy view of the free mask on CPU (cached, see :mod:`.host_view`), else
        ``None``."""
        return self.host_view("_free")

    def alloc_one(self) -> int | None:
        """Take one free id as an int, or ``None`` (state unchanged) when none is free: the
        one-id case of :meth:`alloc` (same id, same order) without tensor dispatch on CPU.
        O(1)."""
        if self._ring.tail == self._ring.head:
            return None
        i = self._ring.pop_one()
        host = self._host_mask()
        if host is not None:
            host[i] = False
        else:
            self._free[i] = False
        return i

    def free_one(self, i: int) -> None:
        """Return the one id ``i`` (an int): the one-id case of :meth:`free`, with the same
        checks and errors, on CPU through host views (no torch dispatch). O(1).

        Raises (state unchanged):
            InvalidArgumentError: ``i`` is not an int (``bool`` included).
            InvalidIndexError: ``i`` outside ``1..size``.
            DoubleFreeError: ``i`` is already free.
        """
        if type(i) is not int:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise InvalidArgumentError(f"ids must be ints, got {i!r}")
            i = int(i)
        host = self._host_mask()
        if self.checks:
            if not 1 <= i <= self.size:
                raise InvalidIndexError(f"ids out of range [1, {self.size}]: {describe_ids([i])}")
            if (host[i] if host is not None else bool(self._free[i].item())):
                raise DoubleFreeError(f"ids already free: {describe_ids([i])}")
        self._ring.push_one(i)
        if host is not None:
            host[i] = True
        else:
            self._free[i] = True

    def is_free(self, ids: IndexLike) -> torch.Tensor:
        """A bool tensor (flat, on ``device``): whether each of ``ids`` is free. O(k).

        Raises:
            InvalidArgumentError / InvalidIndexError: non-integer dtype / ids outside
                ``0..size`` (id 0 is reported as not free).
        """
        ids = index_tensor(ids, self.device, "ids", sequences=False)
        check_range(ids, 0, self.size + 1, "ids")
        return self._free[ids]

    def free_among(self, ids: Sequence[int]) -> list[int]:
        """The ids among ``ids`` (a sequence of Python ints in ``0..size``) that are free,
        in their order, as a list (empty when all are allocated; id 0 is never free).

        Host-side fast path for a few ids: on CPU a numpy view of the free mask (about 1 us for one
        id), elsewhere one :meth:`is_free` lookup (one device sync). O(k).

        Raises (nothing changes):
            InvalidArgumentError: an id that is not an int (``bool`` included).
            InvalidIndexError: an id outside ``0..size``.
        """
        size = self.size
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise InvalidArgumentError(f"ids must be ints, got {i!r}")
            if not 0 <= i <= size:
                raise InvalidIndexError(f"id {int(i)} out of range [0, {size}]")
        if not ids:
            return []
        if self.device.type == "cpu":
            host = self._free.numpy()  # a view, not a copy: always current
            if len(ids) == 1:
                return [ids[0]] if host[ids[0]] else []
            mask = host[np.asarray(ids, dtype=np.int64)]
        else:
            mask = self._free[torch.as_tensor(ids, dtype=torch.int64).to(self.device)].cpu().numpy()
        return [i for i, f in zip(ids, mask.tolist()) if f] if mask.any() else []

    def is_free_one(self, i: int) -> bool:
        """Whether the one id ``i`` (an int in ``0..size``) is free; id 0 never is.

        The one-id case of :meth:`free_among` (the slot a request hands to the Mamba tree),
        without its list handling: on CPU one read of a numpy view of the free mask, made
        once and kept (the mask tensor is allocated once and only ever written in place, so
        the view stays current); elsewhere one device lookup. O(1).

        Raises (nothing changes):
            InvalidArgumentError: ``i`` is not an int (``bool`` included).
            InvalidIndexError: ``i`` outside ``0..size``.
        """
        if type(i) is not int:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise InvalidArgumentError(f"ids must be ints, got {i!r}")
            i = int(i)
        if not 0 <= i <= self.size:
            raise InvalidIndexError(f"id {i} out of range [0, {self.size}]")
        host = self._host_mask()
        if host is None:
            return bool(self._free[i].item())
        return bool(host[i])

    def clear(self) -> None:
        """Make every id ``1..size`` free again (in ascending order). O(size)."""
        self._ring.reset(torch.arange(1, self.size + 1, dtype=torch.int32, device=self.device))
        self._free.fill_(True)
        self._free[0] = False

    def check_invariants(self) -> None:
        """Raise InvariantError (naming the ids) unless the ring holds exactly the ids
        marked free, each once, all in ``1..size``, and ``available() + in use == size``.
        O(size)."""
        if not 0 <= len(self._ring) <= self.size:
            raise InvariantError(f"FreeSlots: count {len(self._ring)} outside 0..{self.size}")
        check_free_lists("FreeSlots", self._free, {"free": self._ring.live()})

    def __repr__(self) -> str:
        return f"FreeSlots(size={self.size}, available={self.available()}, device={self.device})"
