"""Eviction: the order of every built-in policy, SLRU's scan resistance and ghost
admission, the plug-in registry, batching, and the incremental leaf index (checked against
a brute-force minimum, and by counting sort-key evaluations instead of timing)."""
import numpy as np
import pytest
import torch

from radixkv.allocator import TokenToKVPoolAllocator
from radixkv.cache import (
    EvictionPolicy,
    RadixCache,
    RadixKey,
    available_policies,
    make_policy,
    register_policy,
)
from radixkv.cache.eviction import LRUPolicy
from radixkv.cache.policies.slru import SLRUPolicy
from radixkv.errors import InvalidArgumentError

POLICIES = ["lru", "lfu", "fifo", "filo", "mru", "priority", "slru"]


def make(policy="lru", size=512):
    alloc = TokenToKVPoolAllocator(size, device="cpu")
    return RadixCache(None, alloc, eviction_policy=policy), alloc


def put(cache, alloc, tokens, priority=0):
    rows = alloc.alloc(len(tokens))
    done = cache.insert(RadixKey(tokens), rows, priority=priority)
    if done:
        alloc.free(rows[:done])


def cached(cache, first_token):
    return cache.match_prefix([first_token, first_token + 1]).prefix_len > 0


def eviction_order(cache, firsts):
    """Evict one node at a time; return the first tokens in eviction order."""
    order = []
    while cache.evictable_size():
        before = {n.key[0] for n in cache.iter_nodes()}
        assert cache.evict(1) >= 1
        after = {n.key[0] for n in cache.iter_nodes()}
        order.extend(sorted(before - after))
        cache.check_invariants()
    return [t for t in order if t in firsts]


A, B, C, D = [10, 11, 12], [20, 21, 22], [30, 31, 32], [40, 41, 42]


def test_registry_lists_every_builtin():
    assert set(POLICIES) <= set(available_policies())
    with pytest.raises(InvalidArgumentError, match="known"):
        make_policy("nope")
    assert isinstance(make_policy("LRU"), LRUPolicy)


@pytest.mark.parametrize("policy, expected", [
    ("lru", [20, 30, 10]),
    ("fifo", [10, 20, 30]),
    ("filo", [30, 20, 10]),
    ("mru", [10, 30, 20]),
])
def test_recency_policies(policy, expected):
    cache, alloc = make(policy)
    for seq in (A, B, C):
        put(cache, alloc, seq)
    cache.match_prefix(A)  # A becomes the most recently used
    assert eviction_order(cache, {10, 20, 30}) == expected


def test_lfu_counts_hits_and_breaks_ties_by_recency():
    cache, alloc = make("lfu")
    for seq in (A, B, C, D):
        put(cache, alloc, seq)
    for _ in range(3):
        cache.match_prefix(A)
    cache.match_prefix(B)
    cache.match_prefix(D)
    cache.match_prefix(D)
    # C: 0 hits; B: 1; D: 2; A: 3 (the oldest inserted, but the most hit)
    assert eviction_order(cache, {10, 20, 30, 40}) == [30, 20, 40, 10]
    cache, alloc = make("lfu")
    for seq in (A, B, C):
        put(cache, alloc, seq)
    cache.match_prefix(A)
    cache.match_prefix(B)  # A and B tie on hits: A is older
    assert eviction_order(cache, {10, 20, 30}) == [30, 10, 20]


def test_priority_is_max_over_inserts_and_ties_go_by_recency():
    cache, alloc = make("priority")
    put(cache, alloc, A, priority=5)
    put(cache, alloc, B, priority=1)
    put(cache, alloc, C, priority=3)
    put(cache, alloc, D, priority=3)
    assert eviction_order(cache, {10, 20, 30, 40}) == [20, 30, 40, 10]
    cache, alloc = make("priority")
    put(cache, alloc, [1, 2, 3], priority=0)
    put(cache, alloc, [1, 2, 4], priority=9)
    shared = cache.match_prefix([1, 2]).last_node
    assert shared.priority == 9
    assert cache.evict(1) == 1 and cache.match_prefix([1, 2, 3]).prefix_len == 2  # [3] first
    assert cache.match_prefix([1, 2, 4]).prefix_len == 3


def test_parent_becomes_a_candidate_and_whole_nodes_go():
    cache, alloc = make()
    put(cache, alloc, [1, 2, 3, 4, 5])
    put(cache, alloc, [1, 2, 3, 9, 9])
    assert cache.evictable_leaf_count() == 2
    assert cache.evict(1) == 2           # one whole leaf of 2 tokens
    assert cache.evict(1) == 2           # the other leaf
    assert cache.evictable_leaf_count() == 1   # the parent [1,2,3] is a leaf now
    assert cache.evict(1) == 3 and cache.total_size() == 0
    assert cache.evict(1) == 0
    assert alloc.available_size() == 512


def test_one_allocator_free_per_evict():
    cache, alloc = make()
    for i in range(20):
        put(cache, alloc, [100 + i, 1, 2])
    calls = []
    real = alloc.free
    alloc.free = lambda idx: (calls.append(int(idx.numel())), real(idx))
    assert cache.evict(30) == 30
    assert calls == [30]
    assert cache.evict(0) == 0 and calls == [30]
    cache.check_invariants()


def test_locked_leaves_are_skipped():
    cache, alloc = make()
    put(cache, alloc, A)
    put(cache, alloc, B)
    m = cache.match_prefix(B)
    cache.match_prefix(A)
    cache.inc_lock_ref(m.last_node)  # B is the LRU leaf but locked
    assert cache.evict(100) == 3
    assert cached(cache, 20) and not cached(cache, 10)
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(100) == 3


class CountingLRU(LRUPolicy):
    name = "counting-lru"

    def __init__(self):
        super().__init__()
        self.calls = 0

    def sort_key(self, node):
        self.calls += 1
        return node.last_access


def test_evict_does_not_rebuild_a_heap_of_all_leaves():
    policy = CountingLRU()
    alloc = TokenToKVPoolAllocator(4096, device="cpu")
    cache = RadixCache(None, alloc, eviction_policy=policy)
    for i in range(500):
        put(cache, alloc, [1000 + i, 5, 6])
    assert cache.evictable_leaf_count() == 500
    policy.calls = 0
    assert cache.evict(6) == 6  # two leaves
    # O(evicted) key evaluations, not O(leaves): a heap rebuild would need 500
    assert policy.calls <= 6


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_each_eviction_takes_the_current_minimum(policy, seed):
    """Brute force: before each evict(1), the node with the smallest *current* sort key
    among unlocked leaves is the one that goes (checks lazy and eager re-keying)."""
    cache, alloc = make(policy, size=400)
    rng = np.random.default_rng(seed)
    locked = []
    for _step in range(300):
        toks = rng.integers(0, 4, rng.integers(1, 7)).tolist()
        op = rng.random()
        if op < 0.5:
            if alloc.available_size() < len(toks):
                cache.evict(len(toks))
            put(cache, alloc, toks, priority=int(rng.integers(0, 3)))
        elif op < 0.8:
            m = cache.match_prefix(toks)
            if rng.random() < 0.2:
                cache.inc_lock_ref(m.last_node)
                locked.append(m.last_node)
        elif locked and op < 0.9:
            cache.dec_lock_ref(locked.pop(int(rng.integers(len(locked)))))
        else:
            leaves = [n for n in cache.iter_nodes() if not n.children and n.lock_ref == 0]
            if not leaves:
                continue
            want = min(leaves, key=cache.policy.sort_key)
            assert cache.evict(1) == want.num_tokens
            assert all(n is not want for n in cache.iter_nodes())
        cache.check_invariants()
    for node in locked:
        cache.dec_lock_ref(node)
    cache.evict(10**6)
    assert cache.total_size() == 0 and alloc.available_size() == 400


def _scan(cache, alloc, rng, n_docs, hot):
    """Re-use ``hot`` now and then while one-shot documents stream through."""
    for i in range(n_docs):
        doc = [5000 + 10 * i + j for j in range(8)]
        if alloc.available_size() < len(doc):
            cache.evict(len(doc) - alloc.available_size())
        put(cache, alloc, doc)
        if i % 25 == 0:
            cache.match_prefix(hot)


@pytest.mark.parametrize("policy, survives", [("slru", True), ("lru", False)])
def test_slru_resists_a_scan(policy, survives):
    cache, alloc = make(policy, size=64)
    hot = list(range(1, 9))
    put(cache, alloc, hot)
    cache.match_prefix(hot)
    cache.match_prefix(hot)
    _scan(cache, alloc, np.random.default_rng(0), 100, [999])  # the hot prefix is not re-read
    assert (cache.match_prefix(hot).prefix_len == 8) is survives
    cache.check_invariants()


def test_slru_ghost_admits_a_recently_evicted_block_as_protected():
    cache, alloc = make("slru")
    x = list(range(100, 120))
    put(cache, alloc, x)
    assert cache.evict(1) == 20           # x leaves (probation) and enters the ghost
    put(cache, alloc, x)                  # re-inserted: admitted into the protected segment
    node = next(n for n in cache.iter_nodes() if n.key[0] == 100)
    assert node.pstate == 1 and cache.policy.ghost_admissions == 1
    put(cache, alloc, list(range(200, 220)))  # newer, but on probation
    cache.evict(1)
    assert cache.match_prefix(x).prefix_len == 20
    assert cache.match_prefix(list(range(200, 220))).prefix_len == 0
    cache.check_invariants()
    # under LRU the older block would have gone first
    cache, alloc = make("lru")
    put(cache, alloc, x)
    cache.evict(1)
    put(cache, alloc, x)
    put(cache, alloc, list(range(200, 220)))
    cache.evict(1)
    assert cache.match_prefix(x).prefix_len == 0


def test_slru_protected_segment_is_capped():
    policy = SLRUPolicy(protected_fraction=0.5, ghost_capacity=2)
    alloc = TokenToKVPoolAllocator(512, device="cpu")
    cache = RadixCache(None, alloc, eviction_policy=policy)
    seqs = [[300 + 10 * i + j for j in range(4)] for i in range(10)]
    for s in seqs:
        put(cache, alloc, s)
    for s in seqs:
        cache.match_prefix(s)  # every node promoted in turn; older ones demoted
        cache.check_invariants()
    by_first = {int(n.key[0]): n for n in cache.iter_nodes()}
    states = [by_first[s[0]].pstate for s in seqs]
    assert sum(states) * 4 <= 0.5 * 40 and states[-1] == 1 and states[0] == 0
    cache.evict(10**6)
    assert len(policy._ghost) == 2
    cache.check_invariants()
    with pytest.raises(InvalidArgumentError):
        SLRUPolicy(protected_fraction=0.0)


class LongestFirst(EvictionPolicy):
    name = "longest-first"

    def sort_key(self, node):
        return (-node.num_tokens, node.last_access)


def test_a_plugged_in_policy_is_used_by_name(monkeypatch):
    import radixkv.cache.eviction as ev

    monkeypatch.setattr(ev, "_REGISTRY", dict(ev._REGISTRY))  # the test's policies leave with it
    register_policy("test-longest-first", LongestFirst, replace=True)
    with pytest.raises(InvalidArgumentError):
        register_policy("test-longest-first", LongestFirst)
    with pytest.raises(InvalidArgumentError):
        register_policy("", LongestFirst)
    register_policy("test-bad-factory", lambda: object(), replace=True)
    with pytest.raises(InvalidArgumentError):
        make_policy("test-bad-factory")
    cache, alloc = make("test-longest-first")
    put(cache, alloc, [1, 2])
    put(cache, alloc, [5, 6, 7, 8, 9])
    put(cache, alloc, [3, 4, 4])
    assert cache.evict(1) == 5
    assert cache.evict(1) == 3
    cache.check_invariants()
    assert torch.equal(cache.all_values(), cache.match_prefix([1, 2]).device_indices)
