"""Replaying decode steps in bulk: what the manager runs for a client's ``ApplyDecodes``.

A remote client answers a decode call itself when every request of it holds >= 2 reserved
KV slots (``radixkv.service.client.local_decode``), then sends the manager the calls it
answered, to run as ``alloc_decode`` each. Such a call takes each request's front reserved
slot, writes it into the request's row and appends the token: no allocator call, no
eviction, no top-up. :func:`replay_decodes` (``CacheEngine.replay_decodes``) runs the
longest leading run of the calls for which that holds as ONE batched update (one
``req_to_token`` write, one append per request); the caller runs the rest with
``alloc_decode`` (which raises a bad call's error). A call whose validity is in any doubt (a
bad or foreign rid, a rid twice in it, a request with < 2 reserved slots at that point, at
``max_context_len`` or the row width, hybrid state tracking) ends the run before it.

Cost: O(items + distinct requests), vectorized but for one loop over the distinct requests.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from radixkv.errors import RadixKVError
from radixkv.scheduler.track import track_interval

if TYPE_CHECKING:
    from radixkv.contracts import ReqToTokenTable
    from radixkv.engine.config import EngineConfig
    from radixkv.engine.requests import EngineReq

__all__ = ["can_replay", "replay_decodes"]


def can_replay(config: EngineConfig, pool: ReqToTokenTable, calls: int) -> bool:
    """Whether a replay of ``calls`` calls may run in bulk at all: decode reserves on, page
    size 1, no state tracking. O(1)."""
    return bool(calls and config.decode_reserve and config.page_size == 1 and track_interval(pool, 1) is None)


def replay_decodes(pool: ReqToTokenTable, max_context_len: int, reqs: list[EngineReq], call_lens: np.ndarray,
                   rid_index: np.ndarray, token_ids: np.ndarray) -> int:
    """Apply the leading calls of a replay in bulk (see the module doc; ``can_replay`` holds):
    call ``k`` names ``reqs[rid_index[a:b]]`` (the session's, distinct) with tokens
    ``token_ids[a:b]``, ``b - a = call_lens[k]``. Returns how many calls were applied
    (0 .. len(call_lens)); raises nothing for bad input (the calls it declines are left to
    ``alloc_decode``)."""
    n, m = int(rid_index.size), len(reqs)
    if n == 0:  # calls naming nobody change nothing
        return len(call_lens)
    idx = rid_index.astype(np.int64)
    ends = np.cumsum(call_lens, dtype=np.int64)
    call_of = np.repeat(np.arange(len(call_lens)), call_lens)
    # the occurrence of each item's request so far: it takes reserve[occ], column seq_len + occ
    order = np.argsort(idx, kind="stable")
    s = idx[order]
    first = np.ones(n, bool)
    first[1:] = s[1:] != s[:-1]
    occ_sorted = np.arange(n) - np.maximum.accumulate(np.where(first, np.arange(n), 0))
    occ = np.empty(n, np.int64)
    occ[order] = occ_sorted
    seq = np.array([r.seq_len for r in reqs], np.int64)
    ready = np.array([r.req_pool_idx is not None and r.seq_len == r.kv_committed_len for r in reqs], bool)
    left = np.array([r.decode_reserve.size for r in reqs], np.int64)
    width = min(int(max_context_len), int(pool.req_to_token.shape[1]))
    pos = seq[idx] + occ
    ok = ready[idx] & (occ <= left[idx] - 2) & (pos + 1 <= width) & (token_ids >= 0)
    dup = np.zeros(n, bool)  # a rid twice in one call
    key = np.sort(call_of * max(m, 1) + idx)
    dup[:n - 1] = key[1:] == key[:-1]
    bad = ~ok
    calls = len(call_lens)
    if bad.any():
        calls = int(call_of[int(np.argmax(bad))])
    if dup.any():
        calls = min(calls, int(key[int(np.argmax(dup))] // max(m, 1)))
    if calls == 0:
        return 0
    k = int(ends[calls - 1])
    idx, pos, occ, toks = idx[:k], pos[:k], occ[:k], token_ids[:k]
    flat = np.concatenate([r.decode_reserve for r in reqs])
    base = np.concatenate([[0], np.cumsum(left)[:-1]]).astype(np.int64)
    slots = flat[base[idx] + occ]
    rows = np.array([r.req_pool_idx if r.req_pool_idx is not None else -1 for r in reqs], np.int64)[idx]
    dev = pool.req_to_token.device
    try:
        pool.write((torch.from_numpy(rows).to(dev), torch.from_numpy(pos).to(dev)), torch.from_numpy(slots).to(dev))
    except RadixKVError:
        return 0
    counts = np.bincount(idx, minlength=m).tolist()
    order = np.argsort(idx, kind="stable")
    grouped = toks[order]
    at = 0
    for r, c in zip(reqs, counts):
        if c:
            r.append_outputs(grouped[at:at + c])
            r.kv_committed_len = r.seq_len
            r.decode_reserve = r.decode_reserve[c:]
            at += c
    return calls
