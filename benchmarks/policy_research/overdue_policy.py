"""Research candidate ``odlru``: adaptive-probation LRU whose bonus *expires* when a block
is overdue (a non-static key kept exact by lazy re-keying).

Motivation (``docs/hitrate.md``): every static key tried keeps a reused block's bonus for
ever, yet a block whose expected next use did not come is *less* likely to be reused. Here
the bonus of :class:`~radixkv.bench.policy_research.AdaptiveProbationLRU` (``aplru``) holds
only until a per-block deadline:

* ``gap[b]``: the virtual time (tokens inserted) between the block's last two touches
  (a ghost hit counts as a touch, the eviction having kept ``lastv``);
* with ``inherit=True`` the new blocks of a request that hit a reused block take that
  block's gap and class (a continuing conversation's fresh tail is expected back as soon
  as its prefix was);
* key = ``lastv + B`` while ``now <= lastv + overdue * gap``, ``lastv`` afterwards.

The key falls at a known time, so the policy keeps a second heap of deadlines; ``victim``
first pops every deadline that has passed and re-files those leaves with their bonus-free
key (stale deadlines are skipped by a per-block stamp). Each filing pushes at most one
deadline, so the cost stays O(log n) amortized per touch, LRU's order.
"""
from __future__ import annotations

import heapq

import numpy as np

from policy_research.history_policies import AdaptiveProbationLRU
from radixkv.bench.block_policy import grow_array as _grow
from radixkv.errors import InvariantError, describe_ids

__all__ = ["OverdueAPLRU"]


class OverdueAPLRU(AdaptiveProbationLRU):
    """``aplru`` with bonuses that expire ``overdue x gap`` tokens after the last touch
    (see the module docstring). ``overdue = inf`` is exactly ``aplru``."""

    name = "odlru"

    def __init__(self, overdue: float = 4.0, inherit: bool = True, **kw):
        super().__init__(**kw)
        self.overdue, self.inherit = float(overdue), bool(inherit)

    def attach(self, sim):
        super().attach(sim)
        n = sim.n_blocks
        self.gap = np.zeros(n, dtype=np.float64)
        self.deadline = np.full(n, np.inf)
        self.dstamp = np.zeros(n, dtype=np.int64)
        self._dheap: list = []
        self._dseq = 0
        self._req_gap = 0.0                # gap of the current request's hit tail (0: none)

    def grow(self, n):
        super().grow(n)
        self.gap = _grow(self.gap, n)
        self.deadline = _grow(self.deadline, n, np.inf)
        self.dstamp = _grow(self.dstamp, n)

    def on_hit(self, ids):
        now = self.sim.inserted_total
        self.gap[ids] = now - self.lastv[ids]
        super().on_hit(ids)
        tail = int(ids[-1])
        self._req_gap = float(self.gap[tail]) if self.f[tail] >= 2 and self.gap[tail] > 0 else 0.0

    def on_insert(self, ids):
        now = self.sim.inserted_total
        g = self.gt[ids]
        back = g >= 0                      # ghost candidates: gap since their last touch
        self.gap[ids] = np.where(back, now - self.lastv[ids], 0.0)
        super().on_insert(ids)             # ghost_hits, f, B, lastv, freeze
        if self.inherit and self._req_gap > 0:
            fresh = self.f[ids] < 2
            self.f[ids[fresh]] = 2
            self.gap[ids[fresh]] = self._req_gap
            self.freeze(ids[fresh])
        self._req_gap = 0.0

    def freeze(self, ids):
        super().freeze(ids)
        bonus = (self.f[ids] >= 2) & (self.gap[ids] > 0)
        due = np.full(len(ids), np.inf)
        due[bonus] = self.lastv[ids[bonus]] + self.overdue * self.gap[ids[bonus]]
        self.deadline[ids] = due

    def key(self, b):
        if self.deadline[b] <= self.sim.inserted_total:
            return float(self.lastv[b])
        return float(self.kval[b])

    def leaf_added(self, b):
        super().leaf_added(b)
        d = self.deadline[b]
        if np.isfinite(d) and d > self.sim.inserted_total and self.kval[b] != self.lastv[b]:
            self._dseq += 1
            self.dstamp[b] = self._dseq
            heapq.heappush(self._dheap, (float(d), self._dseq, b))

    def leaf_removed(self, b):
        super().leaf_removed(b)
        self.dstamp[b] = 0

    def on_evict(self, b):
        super().on_evict(b)
        self.dstamp[b] = 0

    def victim(self):
        now, h, st = self.sim.inserted_total, self._dheap, self.dstamp
        while h and h[0][0] <= now:
            _, s, b = heapq.heappop(h)
            if st[b] == s:                 # still filed under its bonus key: drop the bonus
                st[b] = 0
                self.leaves.file(b, float(self.lastv[b]))
        if len(h) > 2 * self.leaves.live + 4096:
            self._dheap = [e for e in h if st[e[2]] == e[1]]
            heapq.heapify(self._dheap)
        return self.leaves.peek()

    def check_invariants(self):
        super().check_invariants()
        pending = np.flatnonzero(self.dstamp)
        stray = pending[[int(b) not in self.leaves for b in pending]] if len(pending) else pending
        if len(stray):
            raise InvariantError(f"odlru: deadlines pending for unfiled blocks {describe_ids(stray)}")
