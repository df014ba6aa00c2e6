"""Decode reserves: KV slots a running request holds ahead for its next decode tokens.

A decode step takes the new token's slot from the front of the request's reserve, so a step
whose requests all have one makes no allocator call and evicts nothing: its result depends on
earlier results alone, which lets a remote client answer it locally
(``radixkv.service.client.local_decode``). :func:`top_up` gives every request with an empty
reserve ``min(n, limit - seq_len)`` slots from ONE allocator call, only when all are free
(never by eviction), else nobody gets one. Reserves count as held by the request in the
conservation law and go back at finish or abort (:func:`free_reserves`). Page size 1 only.
Why: ``docs/internals.md``, "Decode reserves".
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from radixkv.contracts import KVAllocator
from radixkv.errors import InvalidArgumentError
from radixkv.scheduler.req import Req

__all__ = ["top_up", "free_reserves", "reserved_slots"]

_EMPTY = np.empty(0, dtype=np.int64)


def top_up(reqs: Sequence[Req], allocator: KVAllocator, n: int, limit: int) -> int:
    """Give each request of ``reqs`` (holding a row) with an empty reserve
    ``min(n, limit - seq_len)`` slots when the allocator has them all; returns the slots
    handed out (0 when nothing was needed or they were not all free). O(batch + slots).

    Raises InvalidArgumentError for a paged allocator (page size > 1) when ``n > 0``."""
    if n <= 0:
        return 0
    if int(getattr(allocator, "page_size", 1)) != 1:
        raise InvalidArgumentError("decode reserves need page_size 1")
    wants = [(r, min(n, limit - r.seq_len)) for r in reqs
             if r.req_pool_idx is not None and r.decode_reserve.size == 0]
    wants = [(r, k) for r, k in wants if k > 0]
    total = sum(k for _, k in wants)
    if total == 0 or allocator.available_size() < total:
        return 0
    slots = allocator.alloc(total)
    if slots is None:
        return 0
    host = slots.to("cpu", torch.int64).numpy()
    pos = 0
    for r, k in wants:
        r.decode_reserve = host[pos:pos + k].copy()
        pos += k
    return total


def reserved_slots(reqs: Iterable[Req]) -> np.ndarray:
    """The reserves of ``reqs`` concatenated (int64). O(slots)."""
    parts = [r.decode_reserve for r in reqs if r.decode_reserve.size]
    return np.concatenate(parts) if parts else _EMPTY


def free_reserves(reqs: Iterable[Req], allocator: KVAllocator) -> None:
    """Give the reserves of ``reqs`` back to the allocator in one call and empty them."""
    reqs = list(reqs)
    slots = reserved_slots(reqs)
    if slots.size:
        allocator.free(torch.from_numpy(slots).to(allocator.device))
    for r in reqs:
        if r.decode_reserve.size:
            r.decode_reserve = _EMPTY
