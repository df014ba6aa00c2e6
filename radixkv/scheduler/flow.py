"""The scheduler's memory flow (SGLang's ``mem_cache/common.py``).

* :func:`alloc_for_extend`: match and lock each new request's prefix, give it a
  ``req_to_token`` row, take KV slots for the tokens to compute (evicting from the tree when
  the allocator falls short), write prefix + new slots into the rows.
* :func:`alloc_for_decode`: one KV slot per request for the token it just generated.
* :func:`release_kv_cache`: a finished request's KV goes into the tree, its row is freed.

Invariants: the KV conservation law (:mod:`radixkv.cache.kv_conservation`: every slot is
free, in the tree, or held by one running request); all-or-nothing (a call that raises,
``CapacityError`` included, keeps no lock, row or slot and changes no field; eviction runs
only once the call will succeed; a tiered tree's loads of host pages stay cached). Hybrid
models: the request's own Mamba slot holds the state at ``kv_committed_len``; extend matches
to the deepest cached state and forks it.
Lengths, hybrid states and track buffers in full: ``docs/internals.md``, "The memory flow".
"""
from __future__ import annotations

from typing import Any, cast

import torch

from radixkv.cache.radix_key import RadixKey
from radixkv.contracts import (
    HybridPrefixCache,
    HybridReqTable,
    KVAllocator,
    PagedKVAllocator,
    PrefixCache,
    PrefixMatch,
    ReqToTokenTable,
    StatePool,
)
from radixkv.errors import CapacityError, InvalidArgumentError
from radixkv.kernels.write_cache_indices import write_cache_indices
from radixkv.scheduler.batch import Batch, ForwardMode
from radixkv.scheduler.decode_reserve import free_reserves
from radixkv.scheduler.req import Req
from radixkv.scheduler.track import prepare_track, track_interval

__all__ = [
    "alloc_for_extend",
    "alloc_for_decode",
    "release_kv_cache",
    "pages_needed",
]


def _ceil_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a + (b - 1), b, rounding_mode="floor")


def pages_needed(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> int:
    """KV slots to allocate so that every request grows from ``prefix_lens`` to
    ``seq_lens`` tokens: with pages, only the pages a request does not already touch
    (``ceil(seq/ps) - ceil(prefix/ps)`` each, times ``ps``). O(bs), vectorized."""
    if page_size == 1:
        return int((seq_lens - prefix_lens).sum())
    return int(((_ceil_div(seq_lens, page_size) - _ceil_div(prefix_lens, page_size)) * page_size).sum())


def _make_room(tree_cache: PrefixCache, allocator: KVAllocator, need: int, what: str,
               state_pool: StatePool | None = None, need_states: int = 0) -> None:
    """Evict from the tree until ``need`` KV slots (and ``need_states`` free slots of the
    Mamba ``state_pool``) are available, or raise CapacityError without evicting anything
    when even evicting all it can would not be enough."""
    avail = allocator.available_size()
    s_avail = state_pool.available_size() if need_states and state_pool is not None else 0
    if avail >= need and s_avail >= need_states:
        return
    evictable = tree_cache.evictable_size()
    if avail + evictable < need:
        raise CapacityError(
            f"{what}: need {need} KV slots, {avail} free + {evictable} evictable",
            requested=need, available=avail + evictable,
        )
    if s_avail < need_states:
        s_evictable = tree_cache.mamba_evictable_size() if hasattr(tree_cache, "mamba_evictable_size") else 0
        if s_avail + s_evictable < need_states:
            raise CapacityError(f"{what}: need {need_states} Mamba state slots, {s_avail} free + "
                                f"{s_evictable} evictable", requested=need_states, available=s_avail + s_evictable)
        cast(HybridPrefixCache, tree_cache).evict(max(0, need - avail), need_states - s_avail)
    else:
        tree_cache.evict(need - avail)
    s_avail = state_pool.available_size() if need_states and state_pool is not None else 0
    if allocator.available_size() < need or s_avail < need_states:  # evict() freed less than it said
        raise CapacityError(f"{what}: need {need} KV / {need_states} state slots, only "
                            f"{allocator.available_size()} / {s_avail} after eviction",
                            requested=need, available=allocator.available_size())


def _check_rows_free(pool: ReqToTokenTable, reqs: list[Req]) -> None:
    n_new = sum(r.req_pool_idx is None for r in reqs)
    if n_new > pool.available_size():
        raise CapacityError(
            f"need {n_new} request rows, {pool.available_size()} free",
            requested=n_new, available=pool.available_size(),
        )


def _check_extend(reqs: list[Req], targets: list[int], width: int) -> None:
    """Every target in ``(kv_committed_len, seq_len]`` and within the row ``width``; a
    request without a row holds no lock or KV. O(bs)."""
    for r, t in zip(reqs, targets):
        if not r.kv_committed_len < t <= r.seq_len:
            raise InvalidArgumentError(
                f"request {r.rid!r}: extend target {t} outside ({r.kv_committed_len}, {r.seq_len}]"
            )
        if t > width:
            raise CapacityError(f"request {r.rid!r}: {t} tokens exceed the row width {width}",
                                requested=t, available=width)
        if r.req_pool_idx is None and (r.last_node is not None or r.kv_committed_len):
            raise InvalidArgumentError(f"request {r.rid!r} has no row but holds a lock or KV")


def _match_and_lock(batch: Batch, targets: list[int], matches: list[PrefixMatch | None],
                    locked: list[Any], tier_lens: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Each request's prefix slots (int64, on the batch's device): a new request's match of
    ``fill_ids[:target - 1]`` (a tiered tree's host pages loaded first, counted in
    ``tier_lens``), its node locked (appended to ``locked`` at once, so the caller can unlock
    on failure) and its match put in ``matches``; a request with a row, its committed slots.
    O(bs) matches."""
    pool, tree, dev = batch.req_to_token_pool, batch.tree_cache, batch.device
    prefixes: list[torch.Tensor] = []
    for i, r in enumerate(batch.reqs):
        if r.req_pool_idx is None:
            m = tree.match_prefix(RadixKey(r.fill_ids[: targets[i] - 1], r.extra_key))
            m, tier_lens[i] = _load_tiers(tree, m)
            tree.inc_lock_ref(m.last_node)
            locked.append(m.last_node)
            matches[i] = m
            prefixes.append(torch.as_tensor(m.device_indices).to(device=dev, dtype=torch.int64))
        else:
            prefixes.append(pool.req_to_token[r.req_pool_idx, : r.kv_committed_len].to(torch.int64))
    return prefixes


def _states_needed(pool: ReqToTokenTable, reqs: list[Req]) -> int:
    """Mamba slots an extend takes (hybrid pools; 0 otherwise): one per request without
    one, and the track buffers of each new row."""
    if getattr(pool, "mamba_pool", None) is None:
        return 0
    per_row: int = getattr(pool, "track_slots_per_row", lambda: 0)()
    return sum(r.mamba_pool_idx is None for r in reqs) + per_row * sum(r.req_pool_idx is None for r in reqs)


def _alloc_extend_slots(batch: Batch, pre: torch.Tensor, seq: torch.Tensor, ext: torch.Tensor,
                        prefixes: list[torch.Tensor]) -> torch.Tensor | None:
    """KV slots for tokens ``pre .. seq`` of each request (``alloc``, or ``alloc_extend``
    after each prefix's last slot with pages); None when the allocator falls short."""
    allocator, dev = batch.allocator, batch.device
    if batch.page_size == 1:
        return allocator.alloc(int(ext.sum()))
    last_loc = torch.stack([p[-1] if p.numel() else p.new_tensor(-1) for p in prefixes]) \
        if prefixes else torch.empty(0, dtype=torch.int64, device=dev)
    return cast(PagedKVAllocator, allocator).alloc_extend(pre.to(dev), seq.to(dev), last_loc, int(ext.sum()))


def alloc_for_extend(batch: Batch) -> torch.Tensor:
    """Prepare ``batch`` for an extend (prefill) step; return ``out_cache_loc``.

    Match and lock each new request's prefix (``fill_ids[:T - 1]``, ``T = batch.target_len(i)``;
    a request with a row keeps it, its committed tokens the prefix), make room (evict), take
    rows (hybrid: Mamba slots, matched states forked in) and KV slots for ``prefix_len .. T``,
    write both into the rows; set ``prefix_indices``, ``last_node``, ``cache_protected_len``
    (new requests), ``kv_committed_len = T`` and the batch tensors. Raises (nothing changes
    or leaks) ``InvalidArgumentError`` (a bad target or request), ``CapacityError`` (row
    width, rows or slots even after eviction). Cost: O(bs) matches, O(tokens), one evict.
    """
    reqs, pool, allocator, tree = batch.reqs, batch.req_to_token_pool, batch.allocator, batch.tree_cache
    targets = [batch.target_len(i) for i in range(len(reqs))]
    _check_extend(reqs, targets, pool.req_to_token.shape[1])
    _check_rows_free(pool, reqs)
    track_interval(pool, batch.page_size)  # a bad interval raises before anything changes

    locked: list[Any] = []  # the tree's nodes
    tier_lens = [(0, 0)] * len(reqs)
    matches: list[PrefixMatch | None] = [None] * len(reqs)
    new_rows: list[Req] = []
    out = None
    backup = None
    try:
        prefixes = _match_and_lock(batch, targets, matches, locked, tier_lens)
        pre = torch.tensor([p.numel() for p in prefixes], dtype=torch.int64)
        seq = torch.tensor(targets, dtype=torch.int64)
        ext = seq - pre
        need = pages_needed(pre, seq, batch.page_size)
        state_pool = getattr(pool, "mamba_pool", None)
        _make_room(tree, allocator, need, "alloc_for_extend", state_pool, _states_needed(pool, reqs))

        new_rows = [r for r in reqs if r.req_pool_idx is None]
        rows = pool.alloc(reqs)
        if rows is None:
            raise CapacityError("request rows ran out", requested=len(new_rows),
                                available=pool.available_size())
        forks = [(m.last_node, reqs[i]) for i, m in enumerate(matches) if m is not None]
        if state_pool is not None and forks and hasattr(tree, "fork_states"):
            tree.fork_states([node for node, _ in forks], [r for _, r in forks])
        backup = allocator.backup_state()
        out = _alloc_extend_slots(batch, pre, seq, ext, prefixes)
        if out is None:
            raise CapacityError(f"alloc_for_extend: {need} KV slots not available",
                                requested=need, available=allocator.available_size())
        write_cache_indices(pool.req_to_token, rows, pre, seq, ext, out, prefixes)
    except BaseException:
        if out is not None:
            allocator.restore_state(backup)
        for r in new_rows:
            if r.req_pool_idx is not None:
                pool.free(r)
        for node in locked:
            tree.dec_lock_ref(node)
        raise

    for i, (r, match) in enumerate(zip(reqs, matches)):
        if match is not None:
            r.prefix_indices = prefixes[i]
            r.last_node = match.last_node
            r.cache_protected_len = int(pre[i])
        r.kv_committed_len = targets[i]
    batch.req_pool_indices = torch.tensor(rows, dtype=torch.int64, device=batch.device)
    _set_forward(batch, ForwardMode.EXTEND, pre, ext, seq, seq.to(batch.device), out)
    batch.tier_lens = tier_lens
    wait_loads = getattr(tree, "wait_loads", None)
    if wait_loads is not None:  # a worker reads the loaded rows only once their copies are done
        wait_loads()
    return out


def _load_tiers(tree: PrefixCache, m: PrefixMatch) -> tuple[PrefixMatch, tuple[int, int]]:
    """A tiered tree's match with its host (and storage) pages loaded into device rows as
    far as they fit (``TieredRadixCache.load_back``); returns it and ``(tokens loaded,
    of which read from storage)``. Other trees' matches come back as they are."""
    host_len = getattr(m, "host_len", 0)
    if not host_len:
        return m, (0, 0)
    loaded_m = cast(Any, tree).load_back(m)
    loaded = int(loaded_m.device_indices.numel() - m.device_indices.numel())
    from_storage = max(0, loaded - (host_len - getattr(m, "storage_len", 0)))
    return loaded_m, (loaded, from_storage)


def _set_forward(batch: Batch, mode: str, pre: torch.Tensor, ext: torch.Tensor, seq: torch.Tensor,
                 seq_d: torch.Tensor, out: torch.Tensor) -> None:
    """Set the batch's step fields for tokens ``pre .. seq`` (CPU int64; ``ext = seq - pre``,
    ``seq_d`` on the device) written at ``out``, and the track-buffer positions (hybrid)."""
    batch.prefix_lens, batch.extend_lens = pre, ext
    batch.seq_lens_cpu, batch.seq_lens = seq, seq_d
    batch.out_cache_loc = out
    batch.forward_mode = mode
    prepare_track(batch, batch.reqs, pre, seq)


def _check_decode(reqs: list[Req], width: int) -> None:
    """Every request holds a row and exactly one uncommitted token within ``width``. O(bs)."""
    for r in reqs:
        if r.req_pool_idx is None:
            raise InvalidArgumentError(f"request {r.rid!r} holds no row; extend it first")
        if r.seq_len != r.kv_committed_len + 1:
            raise InvalidArgumentError(
                f"request {r.rid!r}: decode needs exactly one uncommitted token, has "
                f"{r.seq_len - r.kv_committed_len}"
            )
        if r.seq_len > width:
            raise CapacityError(f"request {r.rid!r}: {r.seq_len} tokens exceed the row width {width}",
                                requested=r.seq_len, available=width)


def _alloc_decode_slots(batch: Batch, res: list[int], need: int, rows_d: torch.Tensor,
                        pos_d: torch.Tensor) -> torch.Tensor | None:
    """One KV slot per request: page size 1, the front of its decode reserve (requests
    ``res``) or one of ``need`` fresh slots; pages, ``alloc_decode`` after the row's last
    slot. None when the allocator falls short."""
    reqs, allocator, dev = batch.reqs, batch.allocator, batch.device
    if batch.page_size != 1:
        last_loc = batch.req_to_token_pool.req_to_token[rows_d, (pos_d - 1).clamp(min=0)].to(torch.int64)
        return cast(PagedKVAllocator, allocator).alloc_decode(pos_d + 1, last_loc)
    if not need:  # every request decodes into its reserve: no allocator call
        return torch.tensor([int(r.decode_reserve[0]) for r in reqs], dtype=torch.int64).to(dev)
    fresh = allocator.alloc(need)
    if not res or fresh is None:
        return fresh
    out = torch.empty(len(reqs), dtype=torch.int64, device=dev)  # reserved slots first, fresh for the others
    mask = torch.zeros(len(reqs), dtype=torch.bool, device=dev)
    mask[res] = True
    out[mask] = torch.tensor([int(reqs[i].decode_reserve[0]) for i in res], dtype=torch.int64, device=dev)
    out[~mask] = fresh.to(dev, torch.int64)
    return out


def alloc_for_decode(batch: Batch) -> torch.Tensor:
    """Prepare ``batch`` for one decode step; return ``out_cache_loc`` (one slot each).

    Each request holds a row and one uncommitted token (``seq_len == kv_committed_len + 1``),
    whose slot goes to ``req_to_token[row, seq_len - 1]`` (SGLang's order: write, then
    ``seq_lens += 1``); afterwards ``batch.seq_lens == kv_committed_len == seq_len``. Page
    size 1: a slot from ``req.decode_reserve`` when it has one, else from the allocator;
    pages: ``alloc_decode`` (a fresh page when the token starts one, else ``last_loc + 1``).
    Raises (nothing changes) ``InvalidArgumentError`` (no row, not one uncommitted token),
    ``CapacityError`` (row width, slots even after eviction). Cost: O(bs) vectorized, one evict.
    """
    reqs, pool, allocator, ps = batch.reqs, batch.req_to_token_pool, batch.allocator, batch.page_size
    _check_decode(reqs, pool.req_to_token.shape[1])
    track_interval(pool, ps)  # a bad interval raises before anything changes
    pos = torch.tensor([r.seq_len - 1 for r in reqs], dtype=torch.int64)
    rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
    res = [i for i, r in enumerate(reqs) if r.decode_reserve.size] if ps == 1 else []
    need = len(reqs) - len(res) if ps == 1 else ps * int((pos % ps == 0).sum())
    _make_room(batch.tree_cache, allocator, need, "alloc_for_decode")

    rows_d, pos_d = rows.to(batch.device), pos.to(batch.device)
    backup = allocator.backup_state() if need or ps != 1 else None
    out = _alloc_decode_slots(batch, res, need, rows_d, pos_d)
    if out is None:
        raise CapacityError(f"alloc_for_decode: {need} KV slots not available",
                            requested=need, available=allocator.available_size())
    try:
        if len(reqs):
            pool.write((rows_d, pos_d), out)
    except BaseException:
        if backup is not None:
            allocator.restore_state(backup)
        raise

    for r in reqs:
        r.kv_committed_len = r.seq_len
    for i in res:
        reqs[i].decode_reserve = reqs[i].decode_reserve[1:]
    batch.req_pool_indices = rows_d
    _set_forward(batch, ForwardMode.DECODE, pos, torch.ones_like(pos), pos + 1, pos_d + 1, out)
    return out


def release_kv_cache(req: Req, tree_cache: PrefixCache, req_to_token_pool: ReqToTokenTable | None = None) -> None:
    """A finished request gives its KV to the tree and its row back.

    ``tree_cache.cache_finished_req(req)`` inserts ``fill_ids[:kv_committed_len]`` with
    the request's slots, frees the slots the tree already had (duplicates) and any
    unaligned tail, and unlocks ``req.last_node``; then ``req_to_token_pool.free(req)``
    (default ``tree_cache.req_to_token_pool``) frees the row and sets ``req_pool_idx`` to
    ``None``. Hybrid: when the tree took the request's Mamba slot (``cache_finished_req``
    returned True) the row is freed without it and ``mamba_pool_idx`` becomes ``None``;
    otherwise the slot is freed with the row. Raises ``InvalidArgumentError`` (nothing
    changes) when the request holds no row.
    """
    pool = req_to_token_pool if req_to_token_pool is not None else tree_cache.req_to_token_pool
    allocator = tree_cache.token_to_kv_pool_allocator
    if pool is None or allocator is None:
        raise InvalidArgumentError("release_kv_cache needs a tree built over a request table and a KV allocator")
    if req.req_pool_idx is None:
        raise InvalidArgumentError(f"request {req.rid!r} holds no row (released twice?)")
    if req.decode_reserve.size:
        free_reserves([req], allocator)
    if tree_cache.cache_finished_req(req) is True:  # the tree keeps the Mamba slot
        cast(HybridReqTable, pool).free(req, free_mamba_cache=False)
        req.mamba_pool_idx = None
    else:
        pool.free(req)
