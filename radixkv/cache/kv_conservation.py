"""The KV conservation law of the pool, the tree and the running requests, counted and audited.

Every KV slot of the pool is exactly one of: free (the allocator's), in the tree
(evictable or protected), or held by a running request and not yet in the tree (the
columns ``cache_protected_len .. kv_committed_len`` of its row, page-rounded, plus its
decode reserve). :func:`conservation` counts, :func:`check_conservation` also audits page
by page and names what leaked, is owned twice, or is free while referenced.

It lives in the cache layer so the trees' own audits (``MambaRadixCache.check_invariants``)
can run it; the scheduler's flow and the engine's audit import it from here. A request is read
through the fields the cache's request entry points read (``req_pool_idx``,
``cache_protected_len``, ``kv_committed_len``, ``rid``) plus ``decode_reserve`` (the int64
slots it holds ahead for decoding; empty when none).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol

import numpy as np
import torch

from radixkv.contracts import KVAllocator, PrefixCache
from radixkv.errors import InvalidArgumentError, InvariantError, describe_ids

__all__ = ["Conservation", "RunningRequest", "conservation", "check_conservation"]


class Conservation(NamedTuple):
    """Where the pool's KV slots are (all counts in slots).

    ``available + evictable + protected + held_by_requests == pool_size`` when nothing leaks.
    ``held_by_requests`` counts, per running request, the slots of the pages its committed
    tokens touch beyond its ``cache_protected_len`` (the tree owns those first tokens), plus
    its decode reserve.
    """

    pool_size: int
    available: int
    evictable: int
    protected: int
    held_by_requests: int

    @property
    def accounted(self) -> int:
        return self.available + self.evictable + self.protected + self.held_by_requests

    @property
    def ok(self) -> bool:
        return self.accounted == self.pool_size


class RunningRequest(Protocol):
    """What the audit reads of a request that holds a row (``radixkv.scheduler.req.Req``):
    :class:`~radixkv.contracts.CacheRequest`'s row and lengths, and its decode reserve."""

    @property
    def rid(self) -> str: ...
    @property
    def req_pool_idx(self) -> int | None: ...
    @property
    def kv_committed_len(self) -> int: ...
    @property
    def cache_protected_len(self) -> int: ...
    @property
    def decode_reserve(self) -> np.ndarray:
        """int64 KV slots allocated ahead for the next decode (may be empty)."""


def _held(req: RunningRequest, page_size: int) -> int:
    if req.req_pool_idx is None:
        return 0
    pages: int = -(-req.kv_committed_len // page_size)
    return pages * page_size - int(req.cache_protected_len) + int(req.decode_reserve.size)


def conservation(allocator: KVAllocator, tree_cache: PrefixCache,
                 running_reqs: Iterable[RunningRequest]) -> Conservation:
    """Count where the slots are (see :class:`Conservation`). O(requests)."""
    ps = int(getattr(allocator, "page_size", 1))
    return Conservation(
        pool_size=int(allocator.size),
        available=int(allocator.available_size()),
        evictable=int(tree_cache.evictable_size()),
        protected=int(tree_cache.protected_size()),
        held_by_requests=sum(_held(r, ps) for r in running_reqs),
    )


def _audit_pages(allocator: KVAllocator, tree_cache: PrefixCache, reqs: list[RunningRequest]) -> None:
    """Exact audit, in pages (slots when ``page_size == 1``): every page in use is owned
    by exactly one of the tree and the running requests (their columns
    ``cache_protected_len .. kv_committed_len`` and their decode reserves), no owned page is free, and every slot of a
    request's protected prefix is in the tree. Raises ``InvariantError`` naming the leaked /
    double-owned / freed-but-referenced pages. O(pool size + total tokens), vectorized."""
    ps = int(getattr(allocator, "page_size", 1))
    n_pages = int(allocator.size) // ps
    dev = allocator.device
    tree_slots = torch.as_tensor(tree_cache.all_values()).to(dev, torch.int64)
    owners = [torch.unique(torch.div(tree_slots, ps, rounding_mode="floor"))]
    heads = []
    table = tree_cache.req_to_token_pool
    for r in reqs:
        if r.req_pool_idx is None:
            continue
        if table is None:
            raise InvalidArgumentError("the audit of running requests needs a tree with a request table")
        row = table.req_to_token[r.req_pool_idx, : r.kv_committed_len]
        row = row.to(dev, torch.int64)
        owners.append(torch.unique(torch.div(row[r.cache_protected_len:], ps, rounding_mode="floor")))
        if r.decode_reserve.size:  # its own entry: a slot both reserved and in the row counts twice
            owners.append(torch.div(torch.from_numpy(r.decode_reserve).to(dev, torch.int64), ps,
                                    rounding_mode="floor"))
        heads.append(row[: r.cache_protected_len])
    owned = torch.cat(owners)
    oob = (owned < 1) | (owned > n_pages)
    if bool(oob.any()):
        raise InvariantError(f"KV pages outside 1..{n_pages} (or the padding page 0) referenced: "
                             f"{describe_ids(owned[oob].tolist())}")
    counts = torch.bincount(owned, minlength=n_pages + 1)[1:]
    pages = torch.arange(1, n_pages + 1, device=dev)
    in_use = ~torch.as_tensor(allocator.is_free(pages * ps)).to(dev)
    for what, mask in (
        ("owned by two of tree/requests (duplicated)", counts > 1),
        ("in use but owned by neither the tree nor a request (leaked)", in_use & (counts == 0)),
        ("free in the allocator but still referenced (double-freed)", ~in_use & (counts > 0)),
    ):
        if bool(mask.any()):
            raise InvariantError(f"KV pages {what}: {describe_ids(pages[mask].tolist())}")
    head = torch.cat(heads) if heads else tree_slots[:0]
    stray = head[~torch.isin(head, tree_slots)]
    if stray.numel():
        raise InvariantError(
            f"slots in requests' protected prefixes that the tree does not hold: {describe_ids(stray.tolist())}"
        )


def check_conservation(allocator: KVAllocator, tree_cache: PrefixCache, running_reqs: Iterable[RunningRequest],
                       exact: bool = True) -> Conservation:
    """:func:`conservation`, raising ``InvariantError`` unless the pool is exactly accounted
    for: the counts must add up, and (``exact``, the default) the page-level audit must
    find no page leaked, owned twice, or free while referenced; the message names them.
    ``running_reqs`` are all requests that hold a row. O(pool + tokens) when ``exact``.
    With a tree that holds Mamba states, also the slot law (free + tree evictable + tree
    protected + held by ``running_reqs`` == capacity, exactly: ``check_state_conservation``)."""
    reqs = list(running_reqs)
    c = conservation(allocator, tree_cache, reqs)
    ps = int(getattr(allocator, "page_size", 1))
    odd = [r.rid for r in reqs if _held(r, ps) < 0]
    if exact:
        _audit_pages(allocator, tree_cache, reqs)
    if not c.ok or odd:
        raise InvariantError(
            f"KV slots not conserved: available {c.available} + evictable {c.evictable} + "
            f"protected {c.protected} + held by requests {c.held_by_requests} = {c.accounted} "
            f"!= pool size {c.pool_size} (off by {c.pool_size - c.accounted}: >0 leaked, <0 counted twice)"
            + (f"; requests with cache_protected_len beyond their pages: {odd}" if odd else "")
        )
    check_states = getattr(tree_cache, "check_state_conservation", None)
    if check_states is not None:
        check_states(reqs)
    return c
