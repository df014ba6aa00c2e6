"""Request-level entry points of the :class:`~radixkv.cache.hybrid.mamba_radix_cache.MambaRadixCache`
(the bodies of its ``cache_finished_req`` / ``cache_unfinished_req``): RadixCache's
(:mod:`radixkv.cache.req_cache`) plus the request's Mamba state.

A finished request hands its own slot to the tree (no copy) when its state position is the
inserted node's end and that node holds none; an unfinished request's state is forked into a
new tree slot. With a track buffer (:mod:`radixkv.scheduler.track`), when the request's own
state is past the last page end, the state its last tracked step wrote (at
``mamba_last_track_seqlen``) is forked into the node ending there (split out if needed).
Everything is validated before anything changes. Cost: as RadixCache's, plus O(1) for the
state (one slot copy for an unfinished request).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from radixkv.cache import req_cache
from radixkv.cache.radix_key import RadixKey
from radixkv.cache.req_cache import _free, _insert_request, _request_rows
from radixkv.cache.tree_node import TreeNode
from radixkv.contracts import CacheRequest
from radixkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache

__all__ = ["cache_finished_req", "cache_unfinished_req", "check_request", "tracked_state"]


def cache_finished_req(cache: MambaRadixCache, req: CacheRequest, state_len: int | None = None) -> bool:
    """RadixCache's ``cache_finished_req`` (insert the page-aligned tokens, free duplicate
    and tail rows, unlock), and the state: when the request's state position
    (``state_len``, default ``kv_committed_len``) is the inserted key's end and that
    node holds no state, the tree takes ``req.mamba_pool_idx`` as it is (no copy).

    Returns True when the tree took the slot: the caller must then free the row with
    ``free(req, free_mamba_cache=False)`` and drop ``req.mamba_pool_idx`` (as
    ``release_kv_cache`` does); on False the slot is still the request's to free.
    Raises (nothing changes) as RadixCache's, plus for a bad slot or ``state_len``.
    """
    row, tokens, kv = _request_rows(cache, req)
    slot, pos = check_request(cache, req, state_len)
    tracked = tracked_state(cache, req)
    if cache.disable:
        _free(cache, kv)
        return False
    aligned, node, _, dup = _insert_request(cache, req, tokens, kv)
    _free(cache, np.concatenate([dup, kv[aligned:]]))
    took = (slot is not None and pos == aligned and node.parent is not None
            and node not in cache._states.slot_of and cache.admission.admit(cache, node, True))
    if took and slot is not None:  # (took implies a slot; the test narrows its type)
        cache._attach(node, slot, aligned)
    elif pos != aligned and tracked is not None and 0 < tracked[1] <= aligned:
        _fork_tracked(cache, req, tokens, node, aligned, tracked, True)
    if req.last_node is not None:
        cache.dec_lock_ref(req.last_node)
    return took


def cache_unfinished_req(cache: MambaRadixCache, req: CacheRequest, chunked: bool = False,
                         state_len: int | None = None) -> None:
    """RadixCache's ``cache_unfinished_req`` (insert, re-point the row, move the lock),
    and the state: when the state position (``state_len``, default
    ``kv_committed_len``) is the end of the page-aligned inserted key, that node holds
    no state and the admission policy agrees, the request's state is forked (copied)
    into a new tree slot -- evicting one unpinned state if the pool is out; if none can
    be had the node stays a tombstone. Otherwise (e.g. an unaligned chunk end) the KV
    goes in without a state. Raises (nothing changes) as :meth:`cache_finished_req`."""
    if cache.disable:
        return
    _, tokens, _ = _request_rows(cache, req)
    slot, pos = check_request(cache, req, state_len)
    tracked = tracked_state(cache, req)
    req_cache.cache_unfinished_req(cache, req, chunked)
    node, aligned = req.last_node, req.cache_protected_len
    if slot is not None and pos == aligned:
        _fork(cache, node, slot, aligned, False)
    elif tracked is not None and 0 < tracked[1] <= aligned:
        _fork_tracked(cache, req, tokens, node, aligned, tracked, False)


def tracked_state(cache: MambaRadixCache, req: CacheRequest) -> tuple[int, int] | None:
    """(slot, position) of the state the request's last tracked step wrote into its
    ``mamba_ping_pong_track_buffer`` (the slot before ``mamba_next_track_idx``), or ``None``.
    Raises InvalidArgumentError for a position that is not a multiple of the page size."""
    pair = getattr(req, "mamba_ping_pong_track_buffer", None)
    pos = getattr(req, "mamba_last_track_seqlen", None)
    if not pair or pos is None:
        return None
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or pos < 0 or pos % cache.page_size:
        raise InvalidArgumentError(f"request {req.rid!r}: mamba_last_track_seqlen {pos!r} is not a "
                                   f"page-aligned position (page size {cache.page_size})")
    slot = pair[int(getattr(req, "mamba_next_track_idx", 0)) ^ 1]
    return cache._states.check_slot(cache.mamba_pool, slot, f"request {req.rid!r} track slot",
                                    cache.checks), int(pos)


def _fork_tracked(cache: MambaRadixCache, req: CacheRequest, tokens: np.ndarray, node: TreeNode,
                  aligned: int, tracked: tuple[int, int], finished: bool) -> None:
    """Fork the tracked state into the node ending at its position (``node`` when that is
    ``aligned``, else the ancestor split out there: the path is in the tree and locked)."""
    src, pos = tracked
    if pos != aligned:
        _, node, n = cache._kv_match(cache, RadixKey(tokens[:pos], req.extra_key))
        if n != pos:  # pragma: no cover - the path up to aligned was just inserted
            return
    _fork(cache, node, src, pos, finished)


def _fork(cache: MambaRadixCache, node: TreeNode, slot: int, pos: int, finished: bool) -> None:
    """Copy the state in ``slot`` (at ``pos``) into a new tree slot at ``node`` when the node
    holds none and the admission policy agrees -- evicting one unpinned state if the pool is
    out; if none can be had the node stays a tombstone."""
    if node.parent is None or node in cache._states.slot_of or not cache.admission.admit(cache, node, finished):
        return
    got = cache.mamba_pool.alloc(1)
    if got is None:
        cache.evict(0, 1)  # states only: node's KV stays, and it has no state to lose
        got = cache.mamba_pool.alloc(1)
        if got is None:
            return
    new = int(got[0])
    cache._copy([slot], [new])
    cache._attach(node, new, pos)


def check_request(cache: MambaRadixCache, req: CacheRequest, state_len: int | None) -> tuple[int | None, int]:
    """Validate the request's slot, state position and lock; returns (slot, position)."""
    slot = req.mamba_pool_idx
    if slot is not None:
        slot = cache._states.check_slot(cache.mamba_pool, slot, f"request {req.rid!r} mamba_pool_idx",
                                        cache.checks)
    pos = req.kv_committed_len if state_len is None else state_len
    if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or pos < 0:
        raise InvalidArgumentError(f"state_len must be an int >= 0, got {pos!r}")
    node = req.last_node
    if node is not None and node.parent is not None and cache._states.pins.get(node, 0) < 1 \
            and not cache.disable:
        raise InvalidArgumentError(f"request {req.rid!r}: its last_node {node.id} is not locked on itself")
    return slot, int(pos)
