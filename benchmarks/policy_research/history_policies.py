"""Research candidates in sort-key form (they port to the RadixCache's policy hooks), for
:mod:`radixkv.bench.blocksim`:

* ``lru2``      LRU-2: key = (penultimate use, last use); history of evicted blocks kept
  for ``4 x capacity`` tokens of insertions;
* ``probation`` static probation: blocks never reused since entering (``f == 1``) go first,
  LRU inside each class; ``f`` survives eviction for ``4 x capacity`` tokens (ghost);
* ``aplru``     adaptive-probation LRU (:class:`AdaptiveProbationLRU`, the recommended one).

Per-block numpy arrays plus the :class:`~radixkv.bench.block_policy.LeafHeap` of
:class:`~radixkv.bench.block_policy.KeyPolicy`: O(log n) per callback. Registered by
:mod:`radixkv.bench.policy_research`.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from radixkv.bench.block_policy import KeyPolicy
from radixkv.bench.block_policy import grow_array as _grow

__all__ = ["LRU2", "Probation", "AdaptiveProbationLRU"]


class _History(KeyPolicy):
    """Shared state of the key-form candidates: per block the virtual time of its last touch
    (``sim.inserted_total``: tokens inserted so far), ``f`` = requests through it, and a
    ghost (eviction time, class) restoring ``f`` for a block re-inserted within
    ``window x capacity`` tokens of insertions (a dict keyed by block hash in a real cache).
    Keys are frozen at each touch (``kval``), so ``key(b)`` is a per-block field."""

    window = 4.0

    def attach(self, sim):
        super().attach(sim)
        n = sim.n_blocks
        self.lastv = np.zeros(n, dtype=np.int64)
        self.f = np.zeros(n, dtype=np.int64)
        self.gt = np.full(n, -1, dtype=np.int64)        # eviction time, -1: not in the ghost
        self.gclass = np.zeros(n, dtype=np.int8)
        self.kval = np.zeros(n, dtype=np.float64)

    def grow(self, n):
        super().grow(n)
        self.lastv = _grow(self.lastv, n)
        self.f = _grow(self.f, n)
        self.gt = _grow(self.gt, n, -1)
        self.gclass = _grow(self.gclass, n)
        self.kval = _grow(self.kval, n)

    def ghost_hits(self, ids):
        """Mask of ``ids`` (being inserted) evicted within the window; forgets the ghost."""
        s = self.sim
        g = self.gt[ids]
        hit = (g >= 0) & (s.inserted_total - g <= self.window * max(s.capacity, 1))
        self.f[ids] = np.where(hit, self.f[ids] + 1, 1)
        self.gt[ids] = -1
        return hit

    def on_hit(self, ids):
        self.lastv[ids] = self.sim.inserted_total
        self.f[ids] += 1
        self.freeze(ids)

    def on_insert(self, ids):
        self.ghost_hits(ids)
        self.lastv[ids] = self.sim.inserted_total
        self.freeze(ids)

    def on_evict(self, b):
        super().on_evict(b)
        self.gt[b] = self.sim.inserted_total
        self.gclass[b] = 1 if self.f[b] >= 2 else 0

    def freeze(self, ids):
        raise NotImplementedError

    def key(self, b):
        return float(self.kval[b])


class LRU2(_History):
    """LRU-K with K = 2: evict the leaf whose second-to-last use is oldest (blocks used once
    first, by last use). Key = penultimate * 2**40 + last, in virtual time (tokens)."""

    name = "lru2"

    def attach(self, sim):
        super().attach(sim)
        self.prev = np.full(sim.n_blocks, -1, dtype=np.int64)

    def grow(self, n):
        super().grow(n)
        self.prev = _grow(self.prev, n, -1)

    def on_hit(self, ids):
        self.prev[ids] = self.lastv[ids]
        super().on_hit(ids)

    def on_insert(self, ids):
        hit = self.ghost_hits(ids)
        self.prev[ids] = np.where(hit, self.lastv[ids], -1)
        self.lastv[ids] = self.sim.inserted_total
        self.freeze(ids)

    def freeze(self, ids):
        self.kval[ids] = (self.prev[ids] + 1).astype(np.float64) * 2.0 ** 40 + self.lastv[ids]


class Probation(_History):
    """Static probation: key = (f >= 2) * 2**60 + last use; never-reused blocks go first."""

    name = "probation"

    def freeze(self, ids):
        self.kval[ids] = np.where(self.f[ids] >= 2, 2.0 ** 60, 0.0) + self.lastv[ids]


class AdaptiveProbationLRU(_History):
    """Adaptive-probation LRU ("aplru"): LRU in virtual time with a bonus ``B`` for blocks
    already reused, ``B`` tuned online by ghost feedback.

    * ``f``: requests through the block, remembered across an eviction by the ghost
      (``window x capacity`` tokens of insertions); class 1 iff ``f >= 2``.
    * key (frozen at each touch) = ``last_touch_vtime + B * class`` (smallest evicted first);
      ``B = 0`` is exactly LRU, ``B = inf`` is :class:`Probation`.
    * On re-inserting a block still in the ghost (a miss that a longer stay would have
      turned into a hit), ``B`` moves toward the class that lost it, each hit weighted by
      the other class's share of recent ghost tokens (ARC's rule on rates, so the class
      with fewer evictions is not drowned out): class 1 raises ``B``, class 0 lowers it;
      ``0 <= B <= 64 x capacity``, starting at ``capacity / 4``.

    Per-touch cost O(1) per block; global state: ``B``, two ghost counters, the ghost.
    """

    name = "aplru"

    def __init__(self, window: float = 4.0, gain: float = 1.0, b0: float = 0.25, b_max: float = 64.0):
        self.window, self.gain, self.b0, self.b_max = window, gain, b0, b_max

    def attach(self, sim):
        super().attach(sim)
        self.B = self.b0 * sim.capacity
        self.ghost_tokens = [0, 0]
        self.expiry: deque = deque()

    def _expire(self):
        s = self.sim
        horizon = s.inserted_total - self.window * max(s.capacity, 1)
        while self.expiry and self.expiry[0][0] < horizon:
            _, c, ln = self.expiry.popleft()
            self.ghost_tokens[c] -= ln

    def on_insert(self, ids):
        s = self.sim
        self._expire()
        hit = self.ghost_hits(ids)
        if hit.any():
            cls = self.gclass[ids[hit]]
            ln = s.block_len[ids[hit]]
            lost0, lost1 = float(ln[cls == 0].sum()), float(ln[cls == 1].sum())
            g0, g1 = max(self.ghost_tokens[0], 1), max(self.ghost_tokens[1], 1)
            self.B += self.gain * (lost1 * max(1.0, g0 / g1) - lost0 * max(1.0, g1 / g0))
            self.B = min(self.b_max * s.capacity, max(0.0, self.B))
        self.lastv[ids] = s.inserted_total
        self.freeze(ids)

    def on_evict(self, b):
        super().on_evict(b)
        ln = int(self.sim.block_len[b])
        c = int(self.gclass[b])
        self.ghost_tokens[c] += ln
        self.expiry.append((self.sim.inserted_total, c, ln))

    def freeze(self, ids):
        self.kval[ids] = self.lastv[ids] + np.where(self.f[ids] >= 2, self.B, 0.0)
