"""The incremental state eviction orders of MambaRadixCache against the O(S log S) ones.

``lru`` pops its victims off a lazy heap (radixkv.cache.hybrid.state_order); the reference is the
order it replaced, verbatim: a stable argsort by ``last_access`` of the unpinned states in
attach order (``StateTable.unpinned``). Two caches run the same seeded workload (inserts
with and without states, matches that re-touch states, locks that pin them, full and state
evictions, resets, and forced ties in ``last_access``), one with each order, and must pick
the same victims in the same order at every eviction. Same for ``flop`` against its
original code. Then the heap's own invariants: bounded size through churn, pinned states
kept, and ``check_invariants`` naming the corrupted node ids / slots.
"""
import heapq

import numpy as np
import pytest

from radixkv.allocator import TokenToKVPoolAllocator
from radixkv.cache.hybrid.mamba_policies import FlopStateOrder, LRUStateOrder, StateEvictionOrder
from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
from radixkv.cache.hybrid.state_order import COMPACT_SLACK
from radixkv.errors import InvariantError
from radixkv.memory import MambaPool


# ----------------------------------------------------------------------------- references
class RefLRU(StateEvictionOrder):
    """The LRU order as it was before the heap: O(S log S) at every eviction."""

    name = "ref-lru"

    def __init__(self):
        self.log, self.ties, self.pinned_older = [], 0, 0

    def order(self, cache, nodes):
        la = np.fromiter((n.last_access for n in nodes), dtype=np.float64, count=len(nodes))
        return np.argsort(la, kind="stable")

    def victims(self, cache, k):
        nodes = cache._states.unpinned()
        out = StateEvictionOrder.victims(self, cache, k)
        keys = [n.last_access for n in nodes]
        self.ties += sum(keys.count(v.last_access) > 1 for v in out)
        pinned = [n.last_access for n in cache._states.slot_of if n in cache._states.pins]
        self.pinned_older += bool(out and pinned and min(pinned) < out[0].last_access)
        self.log.append([n.id for n in out])
        return out


class RecLRU(LRUStateOrder):
    """The heap order, logging its victims (``order`` not overridden: the heap path)."""

    def __init__(self):
        self.log = []

    def victims(self, cache, k):
        out = super().victims(cache, k)
        self.log.append([n.id for n in out])
        return out


class RefFlop(StateEvictionOrder):
    """FlopStateOrder's original code, verbatim (alpha 1, the cache's FlopModel)."""

    def __init__(self):
        self.log = []

    def order(self, cache, nodes):
        n = len(nodes)
        if n <= 1:
            return np.arange(n)
        la = np.fromiter((x.last_access for x in nodes), dtype=np.float64, count=n)
        rank = np.empty(n, dtype=np.float64)
        rank[np.argsort(la, kind="stable")] = np.arange(n, dtype=np.float64)
        recency = rank / (n - 1)
        model = cache.flop_model
        ends = cache.state_positions(nodes)
        above = np.fromiter((cache.nearest_state_ancestor_end(x) for x in nodes), dtype=np.int64, count=n)
        util = (model.prefix_flops(ends) - model.prefix_flops(above)) / float(model.state_bytes)
        top = float(util.max())
        score = recency + (1.0 * util / top if top > 0 else 0.0)
        return np.argsort(score, kind="stable")

    def victims(self, cache, k):
        out = StateEvictionOrder.victims(self, cache, k)
        self.log.append([n.id for n in out])
        return out


class RecFlop(FlopStateOrder):
    def __init__(self):
        super().__init__()
        self.log = []

    def victims(self, cache, k):
        out = super().victims(cache, k)
        self.log.append([n.id for n in out])
        return out


# ----------------------------------------------------------------------------- workload
KV, SLOTS = 400, 24


def make(order, kv=KV, slots=SLOTS):
    alloc = TokenToKVPoolAllocator(kv)
    mamba = MambaPool(slots, (3, 4), (1, 2, 2), 2)
    return MambaRadixCache(None, alloc, mamba_pool=mamba, state_eviction_policy=order), alloc, mamba


def ops(seed, steps):
    """A seeded list of operations (drawn before any cache runs, so both caches get the same)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        r = rng.random()
        toks = rng.integers(0, 3, int(rng.integers(1, 14))).astype(np.int32)
        if r < 0.40:
            out.append(("insert", toks, bool(rng.random() < 0.85)))
        elif r < 0.62:
            out.append(("match", toks, None))
        elif r < 0.74:
            out.append(("lock", toks, None))
        elif r < 0.80:
            out.append(("unlock", None, int(rng.integers(0, 1 << 30))))
        elif r < 0.90:
            out.append(("evict_states", None, int(rng.integers(1, 4))))
        elif r < 0.96:
            out.append(("evict", None, (int(rng.integers(1, 30)), int(rng.integers(0, 3)))))
        elif r < 0.985:
            out.append(("tie", None, int(rng.integers(0, 1 << 30))))
        else:
            out.append(("reset", None, None))
    return out


def run(order, script, audit_every=1):
    """Drive one cache through ``script``; returns it (its order logged the victims)."""
    cache, alloc, mamba = make(order)
    locks = []
    for step, (op, toks, arg) in enumerate(script):
        if op == "insert":
            need = len(toks)
            if alloc.available_size() < need:
                cache.evict(need - alloc.available_size())
            slot = None
            if arg:
                if mamba.available_size() == 0:
                    cache.evict(0, 1)
                got = mamba.alloc(1)
                slot = None if got is None else int(got[0])
            rows = alloc.alloc(need)
            if rows is None:
                if slot is not None:
                    mamba.free(slot)
                continue
            res = cache.insert_with_state(toks, rows, slot)
            if res.prefix_len:
                alloc.free(rows[:res.prefix_len])
        elif op == "match":
            cache.match_prefix(toks)
        elif op == "lock":
            node = cache.match_prefix(toks).last_node
            if node.parent is not None:
                cache.inc_lock_ref(node)
                locks.append(node)
        elif op == "unlock" and locks:
            cache.dec_lock_ref(locks.pop(arg % len(locks)))
        elif op == "evict_states":
            cache.evict(0, arg)
        elif op == "evict":
            cache.evict(*arg)
        elif op == "tie":  # several states get the same, newer, last_access (keys only grow)
            states = sorted(cache._states.slot_of, key=lambda n: n.id)
            if len(states) >= 2:
                rng = np.random.default_rng(arg)
                pick = rng.choice(len(states), size=min(len(states), 2 + arg % 4), replace=False)
                cache._clock += 1
                for i in pick:
                    states[int(i)].last_access = cache._clock
        elif op == "reset":
            for node in locks:
                cache.dec_lock_ref(node)
            locks.clear()
            cache.reset()
        if step % audit_every == 0:
            cache.check_invariants()
    cache.check_invariants()
    return cache


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lru_heap_picks_the_same_victims_as_the_stable_sort(seed):
    script = ops(seed, 1500)
    ref, new = RefLRU(), RecLRU()
    a = run(ref, script)
    b = run(new, script)
    assert len(ref.log) == len(new.log) and len(ref.log) > 100
    for i, (x, y) in enumerate(zip(ref.log, new.log)):
        assert x == y, f"eviction {i}: reference {x}, heap {y}"
    assert sum(map(len, ref.log)) > 200  # the workload really evicts states
    assert ref.ties > 0 and ref.pinned_older > 0  # ties broken in attach order; pinned skipped
    assert a.pretty_print() == b.pretty_print()


@pytest.mark.parametrize("seed", [3, 4])
def test_flop_order_unchanged(seed):
    script = ops(seed, 600)
    ref, new = RefFlop(), RecFlop()
    a = run(ref, script, audit_every=7)
    b = run(new, script, audit_every=7)
    assert ref.log == new.log and sum(map(len, ref.log)) > 50
    assert a.pretty_print() == b.pretty_print()


def test_a_subclass_overriding_order_gets_the_full_ranking():
    class NewestFirst(LRUStateOrder):
        def order(self, cache, nodes):
            return LRUStateOrder.order(self, cache, nodes)[::-1]

    cache, alloc, mamba = make(NewestFirst())
    for toks in ([1, 2], [1, 2, 3], [2, 2]):
        cache.insert_with_state(toks, alloc.alloc(len(toks)), int(mamba.alloc(1)[0]))
    newest = cache.match_prefix([2, 2]).last_node
    assert cache.evict(0, 1).num_states == 1 and cache.state_slot(newest) is None
    cache.check_invariants()


# ----------------------------------------------------------------------------- heap invariants
def test_heap_stays_bounded_when_states_leave_by_full_eviction():
    cache, alloc, mamba = make(RecLRU(), kv=120, slots=16)
    rng = np.random.default_rng(7)
    peak = shrunk = 0
    for _ in range(1500):
        toks = rng.integers(0, 50, int(rng.integers(4, 12))).astype(np.int32)
        before = len(cache._states.lru.heap)
        if alloc.available_size() < len(toks):
            cache.evict(len(toks))  # leaves go with their states: their heap entries go dead
        if mamba.available_size() == 0:
            cache.evict(0, 1)
        rows = alloc.alloc(len(toks))
        res = cache.insert_with_state(toks, rows, int(mamba.alloc(1)[0]))
        if res.prefix_len:
            alloc.free(rows[:res.prefix_len])
        heap = cache._states.lru.heap
        shrunk += len(heap) < before
        peak = max(peak, len(heap))
        assert len(heap) <= 2 * len(cache._states) + COMPACT_SLACK
    cache.check_invariants()
    assert shrunk > 0 and peak > 16  # dead entries piled up and were compacted away


def test_pinned_states_are_skipped_and_keep_their_entries():
    cache, alloc, mamba = make(RecLRU(), slots=4)
    nodes = [cache.insert_with_state(t, alloc.alloc(3), int(mamba.alloc(1)[0])).node
             for t in ([0, 0, 0], [1, 1, 1], [2, 2, 2])]
    for n in nodes[:2]:
        cache.inc_lock_ref(n)
    assert cache.evict(0, 3).num_states == 1 and cache.state_slot(nodes[2]) is None
    assert cache.evict(0, 1).num_states == 0  # the two left are pinned
    cache.check_invariants()  # each still has its entry
    cache.dec_lock_ref(nodes[1])
    assert cache.evict(0, 1).num_states == 1 and cache.state_slot(nodes[1]) is None
    cache.check_invariants()


def test_a_touched_state_is_evicted_after_an_untouched_one():
    cache, alloc, mamba = make(RecLRU(), slots=4)
    a = cache.insert_with_state([0, 1], alloc.alloc(2), int(mamba.alloc(1)[0])).node
    b = cache.insert_with_state([1, 1], alloc.alloc(2), int(mamba.alloc(1)[0])).node
    cache.match_prefix([0, 1])  # a is newer than b now; its heap entry is stale
    assert cache.evict(0, 1).num_states == 1 and cache.state_slot(b) is None
    assert cache.state_slot(a) is not None
    cache.check_invariants()


def three_states():
    cache, alloc, mamba = make(RecLRU(), slots=4)
    nodes = [cache.insert_with_state(t, alloc.alloc(2), int(mamba.alloc(1)[0])).node
             for t in ([0, 1], [1, 1], [2, 1])]
    cache.check_invariants()
    return cache, nodes


def test_check_invariants_names_a_state_missing_from_the_heap():
    cache, nodes = three_states()
    heap = cache._states.lru.heap
    heap[:] = [e for e in heap if e[3] is not nodes[1]]
    heapq.heapify(heap)
    with pytest.raises(InvariantError, match=rf"no entry.*\[{nodes[1].id}\]"):
        cache.check_invariants()


def test_check_invariants_names_a_state_filed_twice():
    cache, nodes = three_states()
    heap = cache._states.lru.heap
    heapq.heappush(heap, next(e for e in heap if e[3] is nodes[2]))
    with pytest.raises(InvariantError, match=rf"filed twice.*\[{nodes[2].id}\]"):
        cache.check_invariants()


def test_check_invariants_names_an_entry_ahead_of_its_node():
    cache, nodes = three_states()
    heap = cache._states.lru.heap
    i = next(i for i, e in enumerate(heap) if e[3] is nodes[0])
    key, seq, slot, node = heap[i]
    heap[i] = (node.last_access + 5, seq, slot, node)
    heapq.heapify(heap)
    with pytest.raises(InvariantError, match=rf"above their node's last_access.*\[{nodes[0].id}\]"):
        cache.check_invariants()


def test_check_invariants_names_stray_marks_and_an_unbounded_heap():
    cache, nodes = three_states()
    lru = cache._states.lru
    lru.seq_at[4] = 99  # slot 4 holds no state
    with pytest.raises(InvariantError, match=r"leaked.*\[4\]"):
        cache.check_invariants()
    lru.seq_at[4] = 0
    for i in range(2 * 3 + COMPACT_SLACK):  # dead entries nobody compacts
        heapq.heappush(lru.heap, (-1, -1 - i, 4, nodes[0]))
    with pytest.raises(InvariantError, match="never compacted"):
        cache.check_invariants()
    lru.compact(cache._states.slot_of)
    cache.check_invariants()


def test_flop_tree_keeps_the_nearest_state_ancestors_and_check_names_a_stale_one():
    cache, alloc, mamba = make("flop", slots=8)
    put = [[0, 1], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5], [0, 1, 2, 9], [0, 7]]
    nodes = [cache.insert_with_state(t, alloc.alloc(len(t)), int(mamba.alloc(1)[0])).node for t in put]
    anc, slot = cache._states.anc, cache.state_slot
    # [0] and [0,1,2] are tombstones made by splits; states keep their ends
    assert [int(anc.above[slot(n)]) for n in nodes] == [0, 2, 4, 2, 0]
    for n in (nodes[0], nodes[2], nodes[3], nodes[4]):
        cache.inc_lock_ref(n)
    assert cache.evict(0, 1).num_states == 1 and slot(nodes[1]) is None  # the only unpinned state
    cache.check_invariants()
    assert int(anc.above[slot(nodes[2])]) == 2  # it sees the state above the one gone
    rows = alloc.alloc(3)
    mid = cache.insert_with_state([0, 1, 2], rows, int(mamba.alloc(1)[0])).node
    alloc.free(rows)  # all three tokens were cached: the rows are the caller's duplicates
    cache.check_invariants()  # a state appears on the tombstone: both branches below see it,
    assert int(anc.above[slot(nodes[2])]) == 3 and int(anc.above[slot(nodes[3])]) == 3  # across [3]
    assert cache.evict(0, 1).num_states == 1 and slot(mid) is None
    assert int(anc.above[slot(nodes[2])]) == 2 and int(anc.above[slot(nodes[3])]) == 2
    cache.check_invariants()
    anc.above[slot(nodes[2])] += 1
    with pytest.raises(InvariantError, match=rf"ancestor position out of date.*\[{nodes[2].id}\]"):
        cache.check_invariants()
