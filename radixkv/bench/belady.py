"""The offline bound: Belady's farthest-next-use eviction under prefix semantics.

:mod:`blocksim`'s simulator with the future known: every block occurrence gets its next use
(one stable sort), and eviction takes the evictable leaf used farthest ahead (a lazy heap);
as a parent is in every request its child is in, the leaf rule costs Belady nothing.
``bypass=True`` (default, the README's "offline optimum") caches a new block only while it
is reused sooner than the farthest evictable block; ``bypass=False`` inserts every block
(forced insertion). Optimal for unit-size blocks; with partial tail blocks, a bound in
practice. Cost: O(B log B) for next uses, O(log n) per eviction. Why:
``docs/hitrate.md``, "The offline bound". The partial-knowledge oracles are research aids
(``benchmarks/policy_research/oracles.py``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from radixkv.bench.block_policy import LeafHeap
from radixkv.errors import InvalidArgumentError

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.bench.traces import BlockTrace

__all__ = ["NEVER", "BeladyResult", "next_use", "belady"]

#: next-use value of an occurrence whose block is never requested again.
NEVER = np.iinfo(np.int64).max // 4


class BeladyResult(NamedTuple):
    """Totals of the offline replay (``bypassed_tokens``: new tokens not cached)."""

    capacity_tokens: int
    prompt_tokens: int
    hit_tokens: int
    evicted_tokens: int
    bypassed_tokens: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def next_use(trace: BlockTrace) -> np.ndarray:
    """For each occurrence in ``trace.blocks``, the next request index containing the same
    block, or :data:`NEVER`. One stable argsort, O(B log B)."""
    req = np.repeat(np.arange(trace.n_requests, dtype=np.int64), np.diff(trace.offsets))
    order = np.argsort(trace.blocks, kind="stable")
    nxt = np.full(len(trace.blocks), NEVER, dtype=np.int64)
    same = trace.blocks[order[1:]] == trace.blocks[order[:-1]]
    nxt[order[:-1][same]] = req[order[1:][same]]
    return nxt


def belady(trace: BlockTrace, capacity_tokens: int, bypass: bool = True) -> BeladyResult:
    """Replay ``trace`` (a :class:`~radixkv.bench.traces.BlockTrace`) with farthest-next-use
    eviction; see the module docstring. O(B log B + evictions x log n)."""
    cap = int(capacity_tokens)
    if cap < 0:
        raise InvalidArgumentError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
    nxt = next_use(trace)
    bl, par = trace.block_len, trace.parent
    n = trace.n_blocks
    cached = np.zeros(n, dtype=bool)
    nch = np.zeros(n, dtype=np.int32)
    nu = np.zeros(n, dtype=np.int64)
    heap = LeafHeap(n)
    used = hit = evicted = bypassed = 0
    off, blk = trace.offsets, trace.blocks
    for t in range(trace.n_requests):
        o0, o1 = off[t], off[t + 1]
        ids, nx = blk[o0:o1], nxt[o0:o1]
        miss = np.flatnonzero(~cached[ids])
        k = int(miss[0]) if len(miss) else len(ids)
        hit += int(bl[ids[:k]].sum())
        nu[ids] = nx
        tail = int(ids[k - 1]) if k else -1
        if tail >= 0:
            heap.unfile(tail)                     # protected while the request runs
        stop = False
        for j in range(k, len(ids)):
            b = int(ids[j])
            if bypass and nx[j] >= NEVER:
                break
            ln = int(bl[b])
            while used + ln > cap:
                v = heap.peek()
                if v < 0 or (bypass and nu[v] <= nx[j]):
                    stop = True
                    break
                heap.unfile(v)
                cached[v] = False
                used -= int(bl[v])
                evicted += int(bl[v])
                p = int(par[v])
                if p >= 0:
                    nch[p] -= 1
                    if nch[p] == 0 and p != tail:
                        heap.file(p, -int(nu[p]))
            if stop:
                break
            cached[b] = True
            used += ln
            if tail >= 0:
                nch[tail] += 1
            tail = b
        bypassed += int(bl[ids[k:]].sum()) - int(bl[ids[k:]][cached[ids[k:]]].sum())
        if tail >= 0 and nch[tail] == 0:
            heap.file(tail, -int(nu[tail]))
    return BeladyResult(cap, trace.prompt_tokens, hit, evicted, bypassed)
