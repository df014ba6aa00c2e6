"""MambaRadixCache unit tests: state-aware match, tombstones, splits, hand-over and fork of
state slots, both eviction orders (tombstone-first full eviction with cascades; state
eviction tombstoning internal nodes), locks/pins, the four size counters, admission and the
FLOP-aware order, validation that leaves everything unchanged, and check_invariants naming
the corrupted ids. The model-level proof (logits) is in test_hybrid_end_to_end.py."""
import numpy as np
import pytest
import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache.hybrid.mamba_policies import FlopModel, FlopStateOrder, make_admission, make_state_order
from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
from radixkv.cache.kv_conservation import check_conservation
from radixkv.cache.radix_cache import RadixCache
from radixkv.errors import (
    AlignmentError,
    CapacityError,
    InvalidArgumentError,
    InvalidIndexError,
    InvariantError,
    LengthMismatchError,
)
from radixkv.memory import HybridReqToTokenPool, MambaPool
from radixkv.scheduler.batch import Batch
from radixkv.scheduler.flow import alloc_for_extend, release_kv_cache
from radixkv.scheduler.req import Req


def make(ps=1, kv=128, slots=6, rows=4, **kw):
    mamba = MambaPool(slots, (3, 12), (2, 4, 4), 2)
    pool = HybridReqToTokenPool(rows, 64, mamba_pool=mamba)
    alloc = TokenToKVPoolAllocator(kv) if ps == 1 else PagedTokenToKVPoolAllocator(kv, ps)
    return MambaRadixCache(pool, alloc, page_size=ps, **kw), alloc, mamba


def put(tree, alloc, tokens, state=True, fill=None):
    """Insert ``tokens`` with fresh rows (and a fresh state slot filled with ``fill``)."""
    rows = alloc.alloc(len(tokens))
    slot = None
    if state:
        slot = int(tree.mamba_pool.alloc(1)[0])
        tree.mamba_pool.conv_state[:, slot] = float(slot if fill is None else fill)
    res = tree.insert_with_state(list(tokens), rows, slot)
    if res.prefix_len:
        alloc.free(rows[: res.prefix_len])
    return res


def snapshot(tree, alloc, mamba):
    return (tree.pretty_print(), alloc.available_size(), mamba.available_size(),
            mamba.conv_state.clone(), tree.mamba_evictable_size(), tree.mamba_protected_size())


def same(a, b):
    return a[:3] == b[:3] and torch.equal(a[3], b[3]) and a[4:] == b[4:]


def test_match_stops_at_deepest_state_and_tombstones_yield_nothing():
    tree, alloc, _ = make()
    put(tree, alloc, range(12), state=False)  # a tombstone leaf
    assert tree.match_prefix(list(range(12))).prefix_len == 0
    put(tree, alloc, range(8))  # splits at 8, the upper half gets the state
    m = tree.match_prefix(list(range(12)))
    assert (m.prefix_len, m.kv_prefix_len) == (8, 12) and m.device_indices.numel() == 8
    assert tree.state_slot(m.last_node) is not None and m.last_device_node is m.last_node
    m6 = tree.match_prefix(list(range(6)))
    assert (m6.prefix_len, m6.kv_prefix_len) == (0, 6) and m6.last_node is tree.root_node
    assert torch.equal(tree.match_prefix(list(range(8))).device_indices, m.device_indices)
    snap = tree.metrics.snapshot()
    assert snap.hit_tokens == 16 and snap.queried_tokens == 12 + 12 + 6 + 8  # state hits only
    tree.check_invariants()


def test_split_keeps_state_at_its_position():
    tree, alloc, _ = make(ps=2)
    res = put(tree, alloc, range(10))
    tree.match_prefix(list(range(4)) + [99, 99])  # splits the node at 4
    assert res.node.num_tokens == 6 and tree.state_positions([res.node]).tolist() == [10]
    assert "state=-" in tree.pretty_print() and tree.nearest_state_ancestor_end(res.node) == 0
    tree.check_invariants()


def test_insert_onto_existing_state_frees_the_handed_slot():
    tree, alloc, mamba = make()
    a = put(tree, alloc, range(6))
    free = mamba.available_size()
    b = put(tree, alloc, range(6))
    assert a.state_kept and not b.state_kept and b.node is a.node and b.prefix_len == 6
    assert mamba.available_size() == free  # the second slot was taken, then freed by the tree
    t = put(tree, alloc, range(4), state=False)
    assert not t.state_kept and tree.state_slot(t.node) is None  # a tombstone (split at 4)
    c = put(tree, alloc, range(4))
    assert c.state_kept and tree.state_slot(c.node) is not None  # a tombstone gets a state
    tree.check_invariants()


def test_bad_state_slots_change_nothing():
    tree, alloc, mamba = make(ps=2)
    held = put(tree, alloc, range(4))
    tree_slot = tree.state_slot(held.node)
    free_slot = int(mamba.alloc(1)[0])
    mamba.free(free_slot)
    good = int(mamba.alloc(1)[0])
    rows = alloc.alloc(6)
    before = snapshot(tree, alloc, mamba)
    for bad, err in ((0, InvalidIndexError), (99, InvalidIndexError), (free_slot, InvalidArgumentError),
                     (tree_slot, InvalidArgumentError), (True, InvalidArgumentError), (1.5, InvalidArgumentError)):
        with pytest.raises(err):
            tree.insert_with_state(list(range(10, 16)), rows, bad)
        assert same(before, snapshot(tree, alloc, mamba))
    with pytest.raises(AlignmentError):  # a valid slot with a bad key: the slot stays the caller's
        tree.insert_with_state(list(range(10, 15)), rows[:5], good)
    with pytest.raises(LengthMismatchError):
        tree.insert_with_state(list(range(10, 16)), rows[:4], good)
    assert same(before, snapshot(tree, alloc, mamba)) and not bool(mamba.free_slots.is_free(torch.tensor([good])))
    with pytest.raises(InvalidArgumentError):
        tree.evict(-1)
    with pytest.raises(InvalidArgumentError):
        tree.evict(0, -2)
    assert same(before, snapshot(tree, alloc, mamba))


def test_fork_copies_hits_zeroes_misses_and_validates_first():
    tree, alloc, mamba = make(slots=8)
    hit = put(tree, alloc, range(5), fill=7.0).node
    pool = tree.req_to_token_pool
    a, b = Req("a", list(range(9))), Req("b", [40, 41])
    assert pool.alloc([a, b]) is not None
    mamba.conv_state[:, b.mamba_pool_idx] = 3.0
    src = tree.state_slot(hit)
    assert tree.fork_states([hit, tree.root_node], [a, b]) == 1
    assert torch.equal(mamba.conv_state[:, a.mamba_pool_idx], mamba.conv_state[:, src])
    assert float(mamba.conv_state[:, b.mamba_pool_idx].abs().sum()) == 0.0
    before = snapshot(tree, alloc, mamba)
    with pytest.raises(LengthMismatchError):
        tree.fork_states([hit], [a, b])
    stray = Req("c", [1])
    stray.mamba_pool_idx = src  # a request claiming the tree's slot
    with pytest.raises(InvalidArgumentError):
        tree.fork_states([hit, hit], [a, stray])
    with pytest.raises(InvalidArgumentError):
        tree.fork_states([hit, hit], [a, a])  # one slot written twice
    tree.evict(100)
    with pytest.raises(InvalidArgumentError):
        tree.fork_state(hit, a)  # hit was evicted: a dead handle
    assert before[3][:, a.mamba_pool_idx].equal(mamba.conv_state[:, a.mamba_pool_idx])


def test_full_eviction_takes_tombstone_leaves_first_and_cascades():
    tree, alloc, mamba = make()
    x = put(tree, alloc, range(16)).node  # older leaf, with a state
    y = put(tree, alloc, list(range(8)) + list(range(100, 108)), state=False).node  # newer tombstone leaf
    res = tree.evict(1)
    assert res == (8, 0) and tree.match_prefix(list(range(16))).prefix_len == 16  # LRU alone would take x
    assert y.parent is not None and tree.state_slot(x) is not None
    free = mamba.available_size()
    res = tree.evict(1)  # x goes with its state; its parent, a childless tombstone, follows
    assert res == (16, 1) and tree.total_size() == 0 and mamba.available_size() == free + 1
    tree.check_invariants()


def test_state_eviction_leaves_tombstones_that_full_eviction_cleans_up():
    tree, alloc, mamba = make()
    inner = put(tree, alloc, range(8)).node
    leaf = put(tree, alloc, range(16)).node
    other = put(tree, alloc, range(40, 44)).node  # the most recent state
    res = tree.evict(0, 1)  # LRU: the inner state (touched before the leaf was created)
    assert res == (0, 1) and tree.state_slot(inner) is None and tree.total_size() == 20
    assert tree.match_prefix(list(range(12))).prefix_len == 0  # the tombstone yields nothing
    res = tree.evict(0, 1)  # the leaf becomes a tombstone too: its KV stays, as a hint
    assert res == (0, 1) and tree.state_slot(leaf) is None and tree.total_size() == 20
    m = tree.match_prefix(list(range(20)))
    assert (m.prefix_len, m.kv_prefix_len) == (0, 16)
    tree.check_invariants()  # the tombstone leaf was re-filed under its lower key
    res = tree.evict(1)  # the tombstone leaf goes first, then its childless tombstone parent
    assert res == (16, 0) and tree.total_size() == 4 and tree.state_slot(other) is not None
    tree.check_invariants()


def test_locks_pin_only_the_locked_node_state():
    tree, alloc, mamba = make()
    put(tree, alloc, range(8))
    leaf = put(tree, alloc, range(16)).node
    assert (tree.full_evictable_size(), tree.mamba_evictable_size(), tree.mamba_protected_size()) == (16, 2, 0)
    assert tree.inc_lock_ref(leaf) == -16
    assert (tree.full_protected_size(), tree.mamba_evictable_size(), tree.mamba_protected_size()) == (16, 1, 1)
    with pytest.raises(InvalidArgumentError):
        tree.dec_lock_ref(leaf.parent)  # locked through its child only: not a lock of its own
    assert tree.evict(100, 5) == (0, 1)  # only the ancestor's state could go (a tombstone now)
    assert tree.state_slot(leaf) is not None and tree.total_size() == 16
    tree.check_invariants()
    assert tree.dec_lock_ref(leaf) == 16
    assert (tree.full_evictable_size(), tree.mamba_evictable_size(), tree.mamba_protected_size()) == (16, 1, 0)
    tree.check_invariants()


def test_locked_tombstone_survives_the_cascade():
    tree, alloc, _ = make()
    mid = put(tree, alloc, range(8), state=False).node  # a tombstone, locked as a chunk end is
    tree.inc_lock_ref(mid)
    put(tree, alloc, range(12))
    assert tree.evict(100) == (4, 1)  # the leaf goes; its locked tombstone parent stays
    assert tree.total_size() == 8 and tree.match_prefix(list(range(8))).kv_prefix_len == 8
    tree.check_invariants()
    tree.dec_lock_ref(mid)
    assert tree.evict(100) == (8, 0) and tree.total_size() == 0


def test_flop_order_keeps_deep_states_lru_does_not():
    def build(policy):
        tree, alloc, _ = make(kv=256, state_eviction_policy=policy)
        deep = put(tree, alloc, range(64)).node  # oldest
        s1 = put(tree, alloc, range(200, 204)).node
        put(tree, alloc, range(300, 304))
        return tree, deep, s1

    tree, deep, s1 = build("lru")
    tree.evict(0, 1)
    assert tree.state_slot(deep) is None and tree.state_slot(s1) is not None
    tree, deep, s1 = build("flop")
    tree.evict(0, 1)
    assert tree.state_slot(deep) is not None and tree.state_slot(s1) is None
    tree.check_invariants()


def test_flop_utility_is_marginal_over_the_nearest_state_above():
    tree, alloc, _ = make(kv=256)
    lone = put(tree, alloc, range(64)).node
    low = put(tree, alloc, range(100, 160)).node
    high = put(tree, alloc, list(range(100, 160)) + list(range(500, 504))).node
    order = FlopStateOrder()
    u = order.utilities(tree, [lone, low, high])
    model = tree.flop_model
    want = model.prefix_flops(np.array([64, 60, 64])) - model.prefix_flops(np.array([0, 0, 60]))
    assert np.allclose(u, want / model.state_bytes) and u[2] < u[1] < u[0]
    assert FlopModel.from_pool(tree.mamba_pool).state_bytes == 2 * (3 * 12 + 2 * 4 * 4) * 4


def test_policy_names_and_constructor():
    assert make_admission("branch").name == "branch" and make_state_order("FLOP").name == "flop"
    for bad in ("never", 3):
        with pytest.raises(InvalidArgumentError):
            make_admission(bad)
        with pytest.raises(InvalidArgumentError):
            make_state_order(bad)
    with pytest.raises(InvalidArgumentError):
        FlopStateOrder(alpha=-1)
    mamba = MambaPool(4, (3, 12), (2, 4, 4), 2)
    with pytest.raises(InvalidArgumentError):
        MambaRadixCache(None, TokenToKVPoolAllocator(8))  # no MambaPool anywhere
    pool = HybridReqToTokenPool(2, 8, mamba_pool=mamba)
    with pytest.raises(InvalidArgumentError):
        MambaRadixCache(pool, None, mamba_pool=MambaPool(4, (3, 12), (2, 4, 4), 2))
    tree = MambaRadixCache(pool, TokenToKVPoolAllocator(8), page_size=1, eviction_policy="lru",
                           admission_policy="none", enable_kv_events=False)
    assert tree.disable and tree.match_prefix([1, 2]).prefix_len == 0


def test_reset_and_kv_events():
    tree, alloc, mamba = make(enable_kv_events=True)
    put(tree, alloc, range(8))
    put(tree, alloc, range(12))
    put(tree, alloc, range(50, 53), state=False)
    tree.evict(0, 1)
    tree.check_invariants()  # the event recorder agrees with the tree
    assert tree.take_events()
    free_kv, free_slots = alloc.available_size(), mamba.available_size()
    n = tree.total_size()
    tree.reset()
    assert alloc.available_size() == free_kv + n and mamba.available_size() == mamba.size
    assert free_slots < mamba.size and tree.mamba_total_size() == 0
    tree.check_invariants()


def flow_env(ps=1, slots=4, rows=4, **kw):
    tree, alloc, mamba = make(ps=ps, slots=slots, rows=rows, **kw)
    return tree, alloc, mamba, tree.req_to_token_pool


def run_req(tree, alloc, pool, rid, tokens, fill_lens=None):
    r = Req(rid, tokens)
    alloc_for_extend(Batch([r], pool, alloc, tree, fill_lens=fill_lens))
    return r


def test_finished_request_hands_its_slot_over_only_at_a_node_end():
    tree, alloc, mamba, pool = flow_env(ps=4)
    a = run_req(tree, alloc, pool, "a", list(range(12)))
    slot = a.mamba_pool_idx
    release_kv_cache(a, tree)  # state at 12, a page end: the tree takes the very slot
    assert a.mamba_pool_idx is None and tree.state_slot(tree.match_prefix(list(range(13))).last_node) == slot
    b = run_req(tree, alloc, pool, "b", list(range(12)) + [60, 61, 62])
    assert b.prefix_len == 12 and tree.mamba_protected_size() == 1
    free = mamba.available_size()
    release_kv_cache(b, tree)  # state at 15: no node ends there, the slot is freed
    assert mamba.available_size() == free + 1 and tree.mamba_total_size() == 1
    c = run_req(tree, alloc, pool, "c", list(range(12)) + [70] * 4 + [71])
    release_kv_cache(c, tree)  # state at 17, KV cached up to 16: a tombstone
    m = tree.match_prefix(list(range(12)) + [70] * 4 + [1])
    assert (m.prefix_len, m.kv_prefix_len) == (12, 16) and tree.mamba_total_size() == 1
    check_conservation(alloc, tree, [])
    tree.check_invariants([])


def test_unfinished_request_forks_aligned_chunk_ends_only():
    tree, alloc, mamba, pool = flow_env(ps=4, slots=3)
    a = run_req(tree, alloc, pool, "a", list(range(20)), fill_lens=[8])
    b = run_req(tree, alloc, pool, "b", list(range(50, 60)), fill_lens=[4])
    mamba.conv_state[:, a.mamba_pool_idx] = 5.0
    tree.cache_unfinished_req(a)  # a page end: the state is forked into the last free slot
    s = tree.state_slot(a.last_node)
    assert s not in (None, a.mamba_pool_idx) and a.cache_protected_len == 8
    assert torch.equal(mamba.conv_state[:, s], mamba.conv_state[:, a.mamba_pool_idx])
    assert tree.mamba_protected_size() == 1  # pinned: a's lock sits on it
    at8 = a.last_node
    alloc_for_extend(Batch([a], pool, alloc, tree, fill_lens=[14]))
    tree.cache_unfinished_req(a)  # 14 is not a page end: KV up to 12, no state
    assert a.cache_protected_len == 12 and tree.state_slot(a.last_node) is None
    alloc_for_extend(Batch([a], pool, alloc, tree, fill_lens=[16]))
    tree.cache_unfinished_req(a)  # no free slot: the state at 8 (unpinned now) makes room
    assert tree.state_slot(a.last_node) is not None and tree.state_slot(at8) is None
    assert mamba.available_size() == 0 and tree.mamba_evictable_size() == 0
    tree.cache_unfinished_req(b)  # no slot, nothing evictable (16 is pinned by a): a tombstone
    assert b.cache_protected_len == 4 and tree.state_slot(b.last_node) is None
    tree.check_invariants([a, b])
    check_conservation(alloc, tree, [a, b])


def test_alloc_for_extend_evicts_states_and_refuses_cleanly():
    tree, alloc, mamba, pool = flow_env(slots=3, rows=4)
    for i in range(3):
        release_kv_cache(run_req(tree, alloc, pool, f"f{i}", [10 * i + j for j in range(6)]), tree)
    assert mamba.available_size() == 0 and tree.mamba_total_size() == 3
    running = [run_req(tree, alloc, pool, "r0", [90, 91, 92])]  # needs a slot: a state goes
    assert tree.mamba_total_size() == 2
    running += [run_req(tree, alloc, pool, f"r{i}", [80 + i, 1]) for i in (1, 2)]
    assert mamba.available_size() == 0 and tree.mamba_total_size() == 0
    before = snapshot(tree, alloc, mamba)
    with pytest.raises(CapacityError):
        run_req(tree, alloc, pool, "x", [5, 6, 7])
    assert same(before, snapshot(tree, alloc, mamba)) and pool.available_size() == 1
    check_conservation(alloc, tree, running)


def test_check_invariants_names_the_corrupted_ids():
    tree, alloc, mamba = make()
    node = put(tree, alloc, range(6)).node
    slot = tree.state_slot(node)
    tree.check_invariants()
    tree._states.end[slot] = 5
    with pytest.raises(InvariantError, match=f"position.*{node.id}"):
        tree.check_invariants()
    tree._states.end[slot] = 6
    RadixCache.inc_lock_ref(tree, node)  # a lock taken around the cache
    with pytest.raises(InvariantError, match=f"lock_ref differs.*{node.id}"):
        tree.check_invariants()
    RadixCache.dec_lock_ref(tree, node)
    kv_leak = alloc.alloc(3)  # KV slots owned by nobody: the KV law names them
    with pytest.raises(InvariantError, match="leaked"):
        tree.check_invariants([])
    alloc.free(kv_leak)
    tree.check_invariants([])
    leak = int(mamba.alloc(1)[0])
    with pytest.raises(InvariantError, match=f"leaked.*{leak}"):
        tree.check_invariants()
    mamba.free(leak)
    mamba.free(slot)  # freed behind the tree's back
    with pytest.raises(InvariantError, match=f"double-freed.*{slot}"):
        tree.check_invariants()
