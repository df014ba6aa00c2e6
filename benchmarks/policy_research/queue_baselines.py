"""Scan-resistant baselines for :mod:`radixkv.bench.blocksim` (leaf-only eviction), built
on :class:`~radixkv.bench.queue_policies.QueuePolicy`:

* ``slru``     segmented LRU: probation + protected (80% of capacity), demotion to probation;
* ``2q``       2Q: FIFO ``A1in`` (25%), ghost ``A1out``, LRU ``Am``;
* ``s3fifo``   S3-FIFO: small FIFO (10%) with one-hit promotion, main FIFO with reinsertion
  (freq up to 3), ghost of blocks evicted from the small queue;
* ``arc``      ARC: T1 (seen once) / T2 (seen again) LRU lists, ghosts B1 / B2 (capacity
  each), adaptive target for T1;
* ``wtinylfu`` W-TinyLFU: 1% LRU window, main LRU, admission by an aging frequency count.

Registered by :mod:`radixkv.bench.policy_research`. O(log n) per callback.
"""
from __future__ import annotations

import numpy as np

from policy_research.queue_policies import Ghost, QueuePolicy
from radixkv.bench.block_policy import grow_array as _grow

__all__ = ["SLRU", "TwoQ", "S3FIFO", "ARC", "WTinyLFU"]



def _admit_by_ghost(policy, ids) -> None:
    """New blocks go to queue 1 when the ghost history remembers them (their ghost entry is
    dropped), else to queue 0."""
    g = policy.ghost.contains(ids)
    for b in ids[g]:
        policy.ghost.discard(int(b))
    if g.any():
        policy.place(ids[g], 1)
    if (~g).any():
        policy.place(ids[~g], 0)

class SLRU(QueuePolicy):
    """Segmented LRU: new blocks on probation (0); a hit promotes to protected (1), capped at
    ``protected_frac`` of capacity by demoting its LRU leaf back to probation's MRU end."""

    name = "slru"

    def __init__(self, protected_frac: float = 0.8):
        self.protected_frac = protected_frac

    def on_insert(self, ids):
        self.place(ids, 0)

    def on_hit(self, ids):
        self.place(ids, 1)
        cap = self.protected_frac * self.sim.capacity
        while self.qtok[1] > cap:
            b = self.heaps[1].peek()
            if b < 0:
                break
            self.place(np.array([b]), 0)

    def victim(self):
        b = self.heaps[0].peek()
        return b if b >= 0 else self.heaps[1].peek()


class TwoQ(QueuePolicy):
    """2Q (full version): FIFO ``A1in`` (0) for new blocks up to ``kin`` of capacity, ghost
    ``A1out`` (``kout`` of capacity) of blocks evicted from it, LRU ``Am`` (1) for blocks
    re-requested from the ghost or hit in ``Am``. Tree adaptation: when ``A1in``'s oldest
    block cannot leave by eviction because a later request extended it (it has children and
    was hit), it moves to ``Am`` (2Q would have re-admitted it from ``A1out``); otherwise the
    oldest evictable leaf of ``A1in`` goes."""

    name = "2q"
    track_order = True

    def __init__(self, kin: float = 0.25, kout: float = 0.5):
        self.kin, self.kout = kin, kout

    def attach(self, sim):
        super().attach(sim)
        self.ghost = Ghost(sim.n_blocks, int(self.kout * sim.capacity))
        self.hit = np.zeros(sim.n_blocks, dtype=bool)

    def grow(self, n):
        super().grow(n)
        self.ghost.grow(n)
        self.hit = _grow(self.hit, n)

    def on_insert(self, ids):
        self.hit[ids] = False
        _admit_by_ghost(self, ids)

    def on_hit(self, ids):
        self.hit[ids] = True
        am = ids[self.q[ids] == 1]
        if len(am):
            self.place(am, 1)

    def victim(self):
        while True:
            if self.qtok[0] > self.kin * self.sim.capacity or self.heaps[1].peek() < 0:
                h = self.order[0].peek()
                if h >= 0 and not self.is_leaf[h] and self.hit[h]:
                    self.place(np.array([h]), 1)
                    continue
                a1 = self.heaps[0].peek()
                if a1 >= 0:
                    return a1
            am = self.heaps[1].peek()
            return am if am >= 0 else self.heaps[0].peek()

    def on_evict(self, b):
        if self.q[b] == 0:
            self.ghost.add(b, int(self.sim.block_len[b]))
        super().on_evict(b)


class S3FIFO(QueuePolicy):
    """S3-FIFO: small FIFO S (0, ``small_frac`` of capacity), main FIFO M (1), ghost G.
    Hits raise ``freq`` (max 3). Evicting from S: its oldest block, if ``freq >= promote_at``,
    moves to M (leaf or not: promotion is no eviction); otherwise S's oldest evictable leaf
    goes if unhit (into G), or moves to M if hit. Evicting from M: a head leaf with
    ``freq > 0`` is reinserted at M's tail with ``freq - 1``. New blocks found in G go
    straight to M."""

    name = "s3fifo"
    track_order = True

    def __init__(self, small_frac: float = 0.1, promote_at: int = 1):
        self.small_frac, self.promote_at = small_frac, promote_at

    def attach(self, sim):
        super().attach(sim)
        self.freq = np.zeros(sim.n_blocks, dtype=np.int8)
        self.ghost = Ghost(sim.n_blocks, int((1 - self.small_frac) * sim.capacity))

    def grow(self, n):
        super().grow(n)
        self.freq = _grow(self.freq, n)
        self.ghost.grow(n)

    def on_insert(self, ids):
        self.freq[ids] = 0
        _admit_by_ghost(self, ids)

    def on_hit(self, ids):
        self.freq[ids] = np.minimum(self.freq[ids] + 1, 3)

    def victim(self):
        small_cap = self.small_frac * self.sim.capacity
        while True:
            m = self.heaps[1].peek()
            if self.qtok[0] >= small_cap or m < 0:
                h = self.order[0].peek()
                if h >= 0 and self.freq[h] >= self.promote_at:
                    self.place(np.array([h]), 1)
                    continue
                s = self.heaps[0].peek()
                if s >= 0:
                    if self.freq[s] >= self.promote_at:
                        self.place(np.array([s]), 1)
                        continue
                    return s
            if m < 0:
                return -1
            if self.freq[m] > 0:
                self.freq[m] -= 1
                self.place(np.array([m]), 1)
                continue
            return m

    def on_evict(self, b):
        if self.q[b] == 0:
            self.ghost.add(b, int(self.sim.block_len[b]))
        super().on_evict(b)


class ARC(QueuePolicy):
    """ARC on leaves: T1 (0) blocks seen once, T2 (1) blocks seen again, both LRU; ghosts
    B1/B2 (``capacity`` tokens each) of their evictions; target ``p`` for T1's tokens grows
    on B1 re-requests and shrinks on B2 re-requests (by the usual size ratios)."""

    name = "arc"

    def attach(self, sim):
        super().attach(sim)
        self.b1 = Ghost(sim.n_blocks, sim.capacity)
        self.b2 = Ghost(sim.n_blocks, sim.capacity)
        self.p = 0.0

    def grow(self, n):
        super().grow(n)
        self.b1.grow(n)
        self.b2.grow(n)

    def on_insert(self, ids):
        bl = self.sim.block_len
        in1, in2 = self.b1.contains(ids), self.b2.contains(ids)
        if in1.any():
            t1, t2 = max(self.b1.tokens, 1), max(self.b2.tokens, 1)
            self.p = min(float(self.sim.capacity), self.p + max(1.0, t2 / t1) * float(bl[ids[in1]].sum()))
        if in2.any():
            t1, t2 = max(self.b1.tokens, 1), max(self.b2.tokens, 1)
            self.p = max(0.0, self.p - max(1.0, t1 / t2) * float(bl[ids[in2]].sum()))
        for b in ids[in1 | in2]:
            self.b1.discard(int(b))
            self.b2.discard(int(b))
        seen = in1 | in2
        if seen.any():
            self.place(ids[seen], 1)
        if (~seen).any():
            self.place(ids[~seen], 0)

    def on_hit(self, ids):
        self.place(ids, 1)

    def victim(self):
        t1, t2 = self.heaps[0].peek(), self.heaps[1].peek()
        if t1 >= 0 and (self.qtok[0] > self.p or t2 < 0):
            return t1
        return t2 if t2 >= 0 else t1

    def on_evict(self, b):
        (self.b1 if self.q[b] == 0 else self.b2).add(b, int(self.sim.block_len[b]))
        super().on_evict(b)


class WTinyLFU(QueuePolicy):
    """W-TinyLFU: new blocks enter an LRU window (0, ``window_frac`` of capacity); when the
    window is over size its LRU leaf competes with the main LRU's (1) leaf and the one with
    the lower access count is evicted (the other stays or joins main). Counts cover evicted
    blocks too (a sketch in a real cache) and are halved every ``10 x capacity`` tokens."""

    name = "wtinylfu"
    track_order = True

    def __init__(self, window_frac: float = 0.01):
        self.window_frac = window_frac

    def attach(self, sim):
        super().attach(sim)
        self.count = np.zeros(sim.n_blocks, dtype=np.float32)
        self.since_decay = 0

    def grow(self, n):
        super().grow(n)
        self.count = _grow(self.count, n)

    def _count(self, ids):
        self.count[ids] += 1
        self.since_decay += int(self.sim.block_len[ids].sum())
        if self.since_decay > 10 * max(self.sim.capacity, 1):
            self.count *= 0.5
            self.since_decay = 0

    def on_insert(self, ids):
        self._count(ids)
        self.place(ids, 0)

    def on_hit(self, ids):
        self._count(ids)
        w = ids[self.q[ids] == 0]
        m = ids[self.q[ids] == 1]
        if len(w):
            self.place(w, 0)
        if len(m):
            self.place(m, 1)

    def victim(self):
        while True:
            over = self.qtok[0] > self.window_frac * self.sim.capacity
            m = self.heaps[1].peek()
            if over or m < 0:
                h = self.order[0].peek()                  # the window's LRU block
                if h >= 0 and not self.is_leaf[h] and over:
                    self.place(np.array([h]), 1)          # pinned by children: admit it
                    continue
                w = self.heaps[0].peek()
                if w >= 0:
                    if m < 0 and over:
                        self.place(np.array([w]), 1)      # main has room: admit freely
                        continue
                    if m >= 0 and self.count[w] > self.count[m]:
                        self.place(np.array([w]), 1)      # admitted: main's victim goes
                        return m
                    return w
            return m if m >= 0 else self.heaps[0].peek()
