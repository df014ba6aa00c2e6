"""Request-level entry points of the RadixCache (SGLang's ``cache_finished_req`` /
``cache_unfinished_req``), the bodies of those methods of :class:`~radixkv.cache.RadixCache`.

Row ownership, the contract they keep: a request's row holds tree-owned rows (locked through
``req.last_node``) for tokens ``[0, cache_protected_len)`` and its own rows after. Caching
inserts the page-aligned tokens with the request's rows and frees the request's duplicates of
rows the tree already held (never a row the tree owns); finished: the unaligned tail is freed
and the lock released; unfinished: the tree's rows are written into the request's row and
the lock moves to the inserted key's end. ONE allocator free per call; arguments validated
before anything changes. Tokens with rows: ``min(len(fill_ids), kv_committed_len)``. The
full rules: ``docs/internals.md``, "Row ownership at the request entry points".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixkv.cache.radix_key import RadixKey
from radixkv.cache.tree_node import TreeNode
from radixkv.contracts import CacheRequest
from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError

if TYPE_CHECKING:
    from radixkv.cache.radix_cache import RadixCache

__all__ = ["cache_finished_req", "cache_unfinished_req"]

_I32 = np.dtype(np.int32)


def _request_rows(cache: RadixCache, req: CacheRequest) -> tuple[int, np.ndarray, np.ndarray]:
    """Validate ``req`` against the pool; return (row, tokens with rows, their KV rows)."""
    pool = cache.req_to_token_pool
    if pool is None:
        raise InvalidArgumentError("this RadixCache has no req_to_token_pool")
    row = req.req_pool_idx
    if row is None or isinstance(row, bool) or not isinstance(row, (int, np.integer)):
        raise InvalidArgumentError(f"request {req.rid!r} holds no req_to_token row")
    table = pool.req_to_token
    if not 0 <= int(row) < table.shape[0]:
        raise InvalidIndexError(f"req_pool_idx {row} out of range [0, {table.shape[0]})")
    tokens = req.fill_ids
    n = tokens.size
    committed = int(getattr(req, "kv_committed_len", 0) or 0)
    if 0 < committed < n:
        n = committed
    if n > table.shape[1]:
        raise LengthMismatchError(f"request {req.rid!r} has {n} tokens, its row holds {table.shape[1]}")
    protected = req.cache_protected_len
    if not 0 <= protected <= n:
        raise InvalidArgumentError(f"cache_protected_len {protected} outside [0, {n}]")
    if req.last_node is not None:
        cache._check_node(req.last_node)
        if req.last_node.parent is not None and req.last_node.lock_ref < 1:
            raise InvalidArgumentError(f"request {req.rid!r} holds an unlocked last_node")
    kv = table[int(row), :n].to("cpu", copy=True).numpy()
    return int(row), tokens[:n], kv


def _free(cache: RadixCache, rows: np.ndarray) -> None:
    if rows.size and cache.token_to_kv_pool_allocator is not None:
        t = torch.from_numpy(rows.astype(np.int64))
        cache.token_to_kv_pool_allocator.free(t if cache.device.type == "cpu" else t.to(cache.device))


def _insert_request(cache: RadixCache, req: CacheRequest, tokens: np.ndarray,
                    kv: np.ndarray) -> tuple[int, TreeNode, np.ndarray, np.ndarray]:
    """Insert the aligned part; return (aligned, prefix, node, tree rows of [0, aligned),
    request rows to free: duplicates differing from the tree's)."""
    n = tokens.size
    aligned = n - n % cache.page_size
    key = RadixKey(tokens[:aligned], req.extra_key)
    prefix, node, path = cache._insert(key, kv[:aligned], req.priority or 0)
    tree_prefix = np.frombuffer(b"".join(x.vbuf for x in path), dtype=_I32)
    lo = req.cache_protected_len
    own = kv[lo:prefix]
    dup = own[own != tree_prefix[lo:prefix]] if prefix > lo else own[:0]
    tree_rows = np.concatenate([tree_prefix, kv[prefix:aligned]])
    return aligned, node, tree_rows, dup


def cache_finished_req(cache: RadixCache, req: CacheRequest) -> None:
    """Cache a finished request: insert its page-aligned tokens with its rows, free its
    duplicate rows and its unaligned tail's rows (one allocator call), and release the
    lock on ``req.last_node``. With ``disable`` every row of the request is freed.

    Raises (nothing changes): InvalidArgumentError / InvalidIndexError /
    LengthMismatchError for a request without a valid row, with a bad
    ``cache_protected_len`` or a ``last_node`` not locked in this tree.
    """
    row, tokens, kv = _request_rows(cache, req)
    if cache.disable:
        _free(cache, kv)
        return
    aligned, _, _, dup = _insert_request(cache, req, tokens, kv)
    _free(cache, np.concatenate([dup, kv[aligned:]]))
    if req.last_node is not None:
        cache.dec_lock_ref(req.last_node)


def cache_unfinished_req(cache: RadixCache, req: CacheRequest, chunked: bool = False) -> None:
    """Cache an unfinished request (chunked prefill): insert its page-aligned tokens, free
    its duplicate rows, point its ``req_to_token`` row at the tree's rows, move its lock to
    the node where the inserted key ends, and update ``req.prefix_indices`` (tree rows plus
    the request's unaligned tail), ``req.last_node`` and ``req.cache_protected_len``.
    No-op with ``disable``. Raises as :func:`cache_finished_req`.
    """
    if cache.disable:
        return
    row, tokens, kv = _request_rows(cache, req)
    aligned, node, tree_rows, dup = _insert_request(cache, req, tokens, kv)
    _free(cache, dup)
    lo = req.cache_protected_len
    if aligned > lo:
        pool: Any = cache.req_to_token_pool  # checked by _request_rows; SGLang's may lack write()
        new = torch.from_numpy(tree_rows[lo:aligned].copy()).to(pool.req_to_token.device)
        if hasattr(pool, "write"):
            pool.write((row, slice(lo, aligned)), new)
        else:
            pool.req_to_token[row, lo:aligned] = new
    cache.inc_lock_ref(node)
    if req.last_node is not None:
        cache.dec_lock_ref(req.last_node)
    prefix = np.concatenate([tree_rows, kv[aligned:]]).astype(np.int64)
    t = torch.from_numpy(prefix)
    req.prefix_indices = t if cache.device.type == "cpu" else t.to(cache.device)
    req.last_node = node
    req.cache_protected_len = aligned
