"""The one-item fast paths of the hot calls agree with the general ones: ``FreeSlots.is_free_one``
with ``is_free``/``free_among``, ``StateTable.check_slot`` with ``check_slots`` (same result or
the same error, nothing changed), ``MambaRadixCache.fork_state`` with ``fork_states``, and the
RadixCache walk (``startswith`` bounded by the page-aligned key end) with a brute-force model on
keys whose unaligned tails and divergences fall inside nodes, and the lone-child shortcut
(``TreeNode.only``) through inserts, splits and evictions."""
import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.allocator import FreeSlots
from radixkv.cache import RadixCache, RadixKey
from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
from radixkv.errors import InvalidArgumentError, InvalidIndexError, InvariantError, RadixKVError
from radixkv.memory import MambaPool


def test_is_free_one_agrees_with_is_free_and_sees_every_change(device):
    fs = FreeSlots(9, device)
    fs.alloc(5)
    fs.free(torch.tensor([2, 4], device=device))
    for _ in range(2):  # the second pass reads the cached view after more changes
        want = fs.is_free(torch.arange(0, 10, device=device)).tolist()
        assert [fs.is_free_one(i) for i in range(10)] == want
        assert [fs.is_free_one(np.int64(i)) for i in range(10)] == want
        assert [fs.is_free_one(i) for i in range(10)] == [bool(fs.free_among([i])) for i in range(10)]
        got = fs.alloc(3)
        fs.free(got[:1])
    fs.clear()
    assert [fs.is_free_one(i) for i in range(10)] == [False] + [True] * 9
    twin = copy.deepcopy(fs)  # the copy must not keep a view of the original's mask
    twin.alloc(2)
    want = twin.is_free(torch.arange(0, 10, device=device)).tolist()
    assert [twin.is_free_one(i) for i in range(10)] == want
    assert [fs.is_free_one(i) for i in range(10)] == [False] + [True] * 9


@pytest.mark.parametrize("bad, err", [(10, InvalidIndexError), (-1, InvalidIndexError),
                                      (True, InvalidArgumentError), (1.0, InvalidArgumentError),
                                      (None, InvalidArgumentError), ("1", InvalidArgumentError)])
def test_is_free_one_rejects_bad_ids_unchanged(device, bad, err):
    fs = FreeSlots(9, device)
    fs.alloc(4)
    before = (fs.available(), fs._ring.live().tolist(), fs._free.clone())
    with pytest.raises(err):
        fs.is_free_one(bad)
    assert (fs.available(), fs._ring.live().tolist()) == before[:2] and torch.equal(fs._free, before[2])


def _mamba_tree(checks=True, slots=6):
    pool = MambaPool(slots, (3, 4), (2, 2, 2), 2)
    return MambaRadixCache(None, None, mamba_pool=pool, checks=checks), pool


def _outcome(fn):
    try:
        return "ok", fn()
    except RadixKVError as e:
        return type(e).__name__, str(e)


@pytest.mark.parametrize("checks", [True, False])
def test_check_slot_matches_check_slots(checks):
    tree, pool = _mamba_tree(checks)
    held = pool.alloc(3).tolist()
    tree.insert_with_state([1, 2, 3], torch.tensor([1, 2, 3]), held[0])  # slot held[0] is the tree's
    pool.free([held[1]])  # a free slot
    table = tree._states
    before = (dict(table.slot_of), list(table.node_of), pool.available_size())
    cases = [held[0], held[1], held[2], np.int64(held[2]), torch.tensor(held[2]), torch.tensor([held[2]]),
             0, 7, -3, True, False, None, 2.0, "2", torch.tensor(1.5)]
    for s in cases:
        one = _outcome(lambda: table.check_slot(pool, s, "slot", checks))  # noqa: B023
        many = _outcome(lambda: table.check_slots(pool, [s], "slot", checks)[0])  # noqa: B023
        assert one == many, s
    assert (dict(table.slot_of), list(table.node_of), pool.available_size()) == before


def test_fork_state_matches_fork_states():
    trees = [_mamba_tree(slots=8) for _ in range(2)]
    for tree, pool in trees:
        s = int(pool.alloc(1)[0])
        pool.conv_state[:, s] = 5.0
        pool.temporal_state[:, s] = -2.0
        tree.insert_with_state([7, 8, 9, 10], torch.tensor([1, 2, 3, 4]), s)
    results = []
    for k, (tree, pool) in enumerate(trees):
        hit = tree.match_prefix([7, 8, 9, 10, 11]).last_node
        miss = tree.root_node

        class R:
            rid = "r"
            mamba_pool_idx = None

        a, b = R(), R()
        a.mamba_pool_idx, b.mamba_pool_idx = (int(x) for x in pool.alloc(2))
        pool.conv_state[:, b.mamba_pool_idx] = 9.0
        if k == 0:
            got = (tree.fork_state(hit, a), tree.fork_state(miss, b))
        else:
            got = (tree.fork_states([hit], [a]) == 1, tree.fork_states([miss], [b]) == 1)
        results.append((got, pool.conv_state.clone(), pool.temporal_state.clone()))
        bad = R()
        bad.mamba_pool_idx = tree.state_slot(hit)  # the tree's own slot: refused, nothing written
        snap = (pool.conv_state.clone(), pool.temporal_state.clone())
        with pytest.raises(InvalidArgumentError):
            tree.fork_state(hit, bad)
        assert torch.equal(snap[0], pool.conv_state) and torch.equal(snap[1], pool.temporal_state)
        tree.check_invariants(running_reqs=[a, b])
    assert results[0][0] == results[1][0] == (True, False)
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][2], results[1][2])


def _model_match(seqs, key, ps):
    """Longest page-aligned prefix of ``key`` shared with any inserted sequence (brute force)."""
    n = len(key) - len(key) % ps
    best = 0
    for s in seqs:
        m = 0
        while m < min(n, len(s)) and s[m] == key[m]:
            m += 1
        best = max(best, m - m % ps)
    return best


@settings(max_examples=40, deadline=None)
@given(ps=st.sampled_from([1, 2, 4]), data=st.data())
def test_walk_bounds_match_a_brute_force_model(ps, data):
    """Keys with unaligned tails, divergences inside nodes and keys ending inside nodes: the
    match length, its rows (those of the first insert of each token position) and the
    inserted prefix agree with a brute-force model; the audit holds after every call."""
    tree = RadixCache(page_size=ps)
    alphabet = st.integers(0, 2)
    seqs, rows_of = [], {}
    next_row = 1
    for _ in range(data.draw(st.integers(1, 8))):
        toks = data.draw(st.lists(alphabet, min_size=0, max_size=14))
        key = RadixKey(np.asarray(toks, dtype=np.int32))
        want = _model_match(seqs, toks, ps)
        m = tree.match_prefix(key)
        assert m.prefix_len == want
        assert m.device_indices.tolist() == [rows_of[tuple(toks[:i + 1])] for i in range(want)]
        tree.check_invariants()
        aligned = toks[:len(toks) - len(toks) % ps]
        value = torch.arange(next_row, next_row + len(aligned))
        done = tree.insert(RadixKey(np.asarray(aligned, dtype=np.int32)), value)
        assert done == _model_match(seqs, aligned, ps)
        for i in range(done, len(aligned)):
            rows_of[tuple(aligned[:i + 1])] = int(value[i])
        next_row += len(aligned)
        seqs.append(aligned)
        tree.check_invariants()


@pytest.mark.parametrize("ps", [1, 2])
def test_lone_child_shortcut_follows_every_change_of_children(ps):
    """``TreeNode.only`` (the walk's way past the children dict) is the lone child through
    inserts, splits and evictions, and a lone child that differs in its first page matches
    nothing; a wrong ``only`` fails the audit with the node's id."""
    tree = RadixCache(page_size=ps)
    k = lambda *t: RadixKey(np.asarray(t, dtype=np.int32))  # noqa: E731
    tree.insert(k(1, 1, 2, 2), torch.arange(4))
    head = tree._heads[None]
    (a,) = head.children.values()
    assert head.only is a and a.only is None
    assert tree.match_prefix(k(3, 3, 2, 2)).prefix_len == 0  # lone child, first page differs
    tree.insert(k(1, 1, 3, 3), torch.arange(10, 14))  # splits a: head -> [1 1] -> {[2 2], [3 3]}
    parent = head.only
    assert parent is not None and parent.num_tokens == 2 and parent.only is None
    assert len(parent.children) == 2
    tree.check_invariants()
    m = tree.match_prefix(k(1, 1, 3, 3))
    assert m.device_indices.tolist() == [0, 1, 12, 13]
    tree.inc_lock_ref(m.last_node)
    assert tree.evict(2) == 2  # the unlocked [2 2] leaf goes; [3 3] is the lone child now
    tree.dec_lock_ref(m.last_node)
    assert parent.only is m.last_node
    tree.check_invariants()
    assert tree.match_prefix(k(1, 1, 2, 2)).prefix_len == 2
    assert tree.match_prefix(k(1, 1, 3, 3, 4, 4)).prefix_len == 4
    parent.only = None
    with pytest.raises(InvariantError, match=rf"nodes \[{parent.id}\]"):
        tree.check_invariants()
