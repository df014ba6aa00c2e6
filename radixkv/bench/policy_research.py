"""Scan-resistant baselines and research candidates for :mod:`blocksim` (leaf-only eviction).

Baselines, each restricted to evicting leaves (a queue's "head" is its head-most *evictable
leaf*; non-leaf blocks wait in their queue until their children go):

* ``slru``     segmented LRU: probation + protected (80% of capacity), demotion to probation;
* ``2q``       2Q: FIFO ``A1in`` (25%), ghost ``A1out``, LRU ``Am``;
* ``s3fifo``   S3-FIFO: small FIFO (10%) with one-hit promotion, main FIFO with reinsertion
  (freq up to 3), ghost of blocks evicted from the small queue;
* ``arc``      ARC: T1 (seen once) / T2 (seen again) LRU lists, ghosts B1 / B2 (capacity
  each), adaptive target for T1;
* ``wtinylfu`` W-TinyLFU: 1% LRU window, main LRU, admission by an aging frequency count.

Research candidates (all in sort-key form, so they port to the RadixCache's policy hooks):

* ``lru2``      LRU-2: key = (penultimate use, last use); history of evicted blocks kept
  for ``4 x capacity`` tokens of insertions;
* ``probation`` static probation: blocks never reused since entering (``f == 1``) go first,
  LRU inside each class; ``f`` survives eviction for ``4 x capacity`` tokens (ghost);
* ``aplru``     adaptive-probation LRU (:class:`AdaptiveProbationLRU`, the recommended one).

Every structure is a per-queue :class:`~radixkv.bench.blocksim.LeafHeap` plus per-block
arrays: O(log n) per callback. Ghosts are bounded FIFOs of block ids (tokens as the unit),
the simulator's stand-in for sets of block hashes.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from radixkv.bench.blocksim import BlockPolicy, KeyPolicy, LeafHeap, register
from radixkv.errors import InvariantError, describe_ids

__all__ = ["Ghost", "QueuePolicy", "SLRU", "TwoQ", "S3FIFO", "ARC", "WTinyLFU",
           "LRU2", "Probation", "AdaptiveProbationLRU"]


def _grow(a: np.ndarray, n: int, fill=0) -> np.ndarray:
    return a if n <= len(a) else np.concatenate([a, np.full(n - len(a), fill, a.dtype)])


class Ghost:
    """A bounded FIFO of evicted block ids, sized in tokens (a set of hashes in a real cache).

    ``add`` appends (re-adding moves it to the back), ``discard`` removes lazily, the front is
    trimmed while the total exceeds ``cap_tokens``. O(1) amortized per operation.
    """

    def __init__(self, n_blocks: int, cap_tokens: int):
        self.cap = int(cap_tokens)
        self.seq = np.zeros(n_blocks, dtype=np.int64)   # 0: absent, else entry number
        self.size_of = np.zeros(n_blocks, dtype=np.int64)
        self.fifo: deque = deque()
        self.n = 0
        self.tokens = 0

    def grow(self, n):
        self.seq = _grow(self.seq, n)
        self.size_of = _grow(self.size_of, n)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self.seq[ids] > 0

    def add(self, b: int, ln: int) -> None:
        self.discard(b)
        self.n += 1
        self.seq[b] = self.n
        self.size_of[b] = ln
        self.tokens += ln
        self.fifo.append((b, self.n))
        while self.tokens > self.cap and self.fifo:
            v, s = self.fifo.popleft()
            if self.seq[v] == s:
                self.discard(v)

    def discard(self, b: int) -> None:
        if self.seq[b]:
            self.seq[b] = 0
            self.tokens -= int(self.size_of[b])

    def check_invariants(self) -> None:
        """Token count = sizes of present ids, within the cap; each present id is queued."""
        present = np.flatnonzero(self.seq)
        tok = int(self.size_of[present].sum())
        if tok != self.tokens or self.tokens > self.cap:
            raise InvariantError(f"ghost counts {self.tokens} tokens (cap {self.cap}), holds {tok}")
        queued = {b for b, s in self.fifo if self.seq[b] == s}
        lost = [int(b) for b in present if int(b) not in queued]
        if lost:
            raise InvariantError(f"ghost ids missing from its FIFO: {describe_ids(lost)}")


class QueuePolicy(BlockPolicy):
    """Blocks live in numbered queues; each queue files its evictable leaves in a
    :class:`LeafHeap` under a per-block key (an LRU/FIFO position). ``qtok[q]`` counts the
    tokens of every cached block of queue ``q`` (leaf or not).

    With ``track_order`` every member is also kept in order (``order[q]``), so a policy can
    act on a queue's oldest block even when it is an interior block pinned by its children
    (promotion is not eviction); without it, blocks a later request extended would sit in
    a small queue forever and leave only the newest tails to evict."""

    n_queues = 2
    #: also keep every member (leaf or not) of each queue in order (``order[q]``)
    track_order = False

    def attach(self, sim):
        super().attach(sim)
        n = sim.n_blocks
        self.order = [LeafHeap(n) for _ in range(self.n_queues)] if self.track_order else []
        self.q = np.full(n, -1, dtype=np.int8)
        self.qkey = np.zeros(n, dtype=np.int64)
        self.is_leaf = np.zeros(n, dtype=bool)
        self.heaps = [LeafHeap(n) for _ in range(self.n_queues)]
        self.qtok = [0] * self.n_queues
        self.tick = 0

    def grow(self, n):
        self.q = _grow(self.q, n, -1)
        self.qkey = _grow(self.qkey, n)
        self.is_leaf = _grow(self.is_leaf, n)
        for h in self.heaps + self.order:
            h.grow(n)

    def place(self, ids: np.ndarray, q: int) -> None:
        """Put ``ids`` (cached or just inserted) at the back of queue ``q``."""
        bl = self.sim.block_len
        old = self.q[ids]
        for oq in range(self.n_queues):
            m = old == oq
            if m.any():
                self.qtok[oq] -= int(bl[ids[m]].sum())
        self.qtok[q] += int(bl[ids].sum())
        self.q[ids] = q
        keys = self.tick + 1 + np.arange(len(ids))
        self.tick += len(ids)
        self.qkey[ids] = keys
        if self.track_order:
            for b, oq, k in zip(ids.tolist(), old.tolist(), keys.tolist()):
                if oq >= 0:
                    self.order[oq].unfile(b)
                self.order[q].file(b, k)
        for b, oq in zip(ids[self.is_leaf[ids]].tolist(), old[self.is_leaf[ids]].tolist()):
            self.heaps[oq].unfile(b)
            self.heaps[q].file(b, int(self.qkey[b]))

    def leaf_added(self, b):
        self.is_leaf[b] = True
        self.heaps[self.q[b]].file(b, int(self.qkey[b]))

    def leaf_removed(self, b):
        self.is_leaf[b] = False
        self.heaps[self.q[b]].unfile(b)

    def on_evict(self, b):
        q = int(self.q[b])
        ln = int(self.sim.block_len[b])
        self.is_leaf[b] = False
        self.heaps[q].unfile(b)
        if self.track_order:
            self.order[q].unfile(b)
        self.qtok[q] -= ln
        self.q[b] = -1

    def evictable(self):
        return np.unique(np.concatenate([h.members() for h in self.heaps]))

    def check_invariants(self):
        sim = self.sim
        cached = sim.cached
        wrong = np.flatnonzero(cached != (self.q >= 0))
        if len(wrong):
            raise InvariantError(f"{self.name}: queue membership disagrees with the cache for {describe_ids(wrong)}")
        for qi in range(self.n_queues):
            tok = int(sim.block_len[self.q == qi].sum())
            if tok != self.qtok[qi]:
                raise InvariantError(f"{self.name}: queue {qi} counts {self.qtok[qi]} tokens, holds {tok}")
            filed = self.heaps[qi].members()
            bad = filed[self.q[filed] != qi]
            if len(bad):
                raise InvariantError(f"{self.name}: blocks {describe_ids(bad)} filed in queue {qi} but not in it")
            if self.track_order:
                members = np.flatnonzero(self.q == qi)
                listed = self.order[qi].members()
                if not np.array_equal(members, listed):
                    odd = np.setxor1d(members, listed)
                    raise InvariantError(f"{self.name}: queue {qi} order list disagrees on {describe_ids(odd)}")
        for h in self.heaps + self.order:
            h.check_invariants()
        for g in (getattr(self, "ghost", None), getattr(self, "b1", None), getattr(self, "b2", None)):
            if g is not None:
                g.check_invariants()


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
        g = self.ghost.contains(ids)
        for b in ids[g]:
            self.ghost.discard(int(b))
        if g.any():
            self.place(ids[g], 1)
        if (~g).any():
            self.place(ids[~g], 0)

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
        g = self.ghost.contains(ids)
        for b in ids[g]:
            self.ghost.discard(int(b))
        if g.any():
            self.place(ids[g], 1)
        if (~g).any():
            self.place(ids[~g], 0)

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


for _cls in (SLRU, TwoQ, S3FIFO, ARC, WTinyLFU, LRU2, Probation, AdaptiveProbationLRU):
    register(_cls.name, _cls)
