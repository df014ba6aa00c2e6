"""Two *partial-knowledge oracles* for the block simulator: online eviction fed one fact
about the future, analysis aids for what a predictor could buy, not policies to deploy.

* :class:`ReuseOracle` knows whether each block will ever be requested again;
* :class:`PopularityOracle` knows each block's total request count.

Both are LRU (the RadixCache's :class:`~radixkv.cache.policies.base.LRUPolicy`, run on
blocks by :class:`~radixkv.bench.block_policy.TreePolicy`) with that fact put first in the
key. Each needs the trace it replays.
"""
from __future__ import annotations

import numpy as np

from radixkv.bench.belady import NEVER, next_use
from radixkv.bench.block_policy import TreePolicy
from radixkv.cache.policies.base import LRUPolicy

__all__ = ["ReuseOracle", "PopularityOracle"]


class _OracleLRU(TreePolicy):
    def __init__(self) -> None:
        super().__init__(LRUPolicy())
        self.name = type(self).name


class ReuseOracle(_OracleLRU):
    """LRU where blocks that will never be requested again are evicted first (key:
    (reused-later, last use)); needs the trace it replays."""

    name = "oracle-reuse"

    def __init__(self, trace):
        super().__init__()
        self.trace = trace
        self.alive_occ = next_use(trace) < NEVER

    def attach(self, sim):
        super().attach(sim)
        self.alive = np.zeros(sim.n_blocks, dtype=bool)

    def _mark(self, ids):
        t = self.sim.now
        req = self.trace.blocks[self.trace.offsets[t]:self.trace.offsets[t + 1]]
        start = int(np.flatnonzero(req == ids[0])[0])
        o = int(self.trace.offsets[t]) + start
        self.alive[ids] = self.alive_occ[o:o + len(ids)]

    def on_hit(self, ids):
        super().on_hit(ids)
        self._mark(ids)

    def on_insert(self, ids):
        super().on_insert(ids)
        self._mark(ids)

    def key(self, b):
        return (bool(self.alive[b]), int(self.last[b]))


class PopularityOracle(_OracleLRU):
    """Least popular first, popularity = the block's request count over the whole trace
    (past and future); ties by least recent use."""

    name = "oracle-popularity"

    def __init__(self, trace):
        super().__init__()
        self.count = np.bincount(trace.blocks, minlength=trace.n_blocks)

    def key(self, b):
        return (int(self.count[b]), int(self.last[b]))
