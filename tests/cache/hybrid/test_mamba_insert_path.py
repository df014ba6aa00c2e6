"""MambaRadixCache's hot insert / fork paths against their general forms: the slot check
reading the pool's kept free mask (``StateTable.free_host``) and the leaf filed under its key
with the state (``_presort``) give the same trees, hits, victims, errors and messages as the
general paths, and leave nothing behind when they raise."""
import numpy as np
import pytest
import torch

from radixkv.allocator import TokenToKVPoolAllocator
from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError
from radixkv.memory import MambaPool


def make(slots=6, kv=256, checks=True, general=False, **kw):
    mamba = MambaPool(slots, (3, 12), (2, 4, 4), 2)
    alloc = TokenToKVPoolAllocator(kv)
    tree = MambaRadixCache(None, alloc, mamba_pool=mamba, checks=checks, **kw)
    if general:  # every hot path off: the general check, filing and attach
        tree._presort = False
        tree._states.free_host = None
    return tree, alloc, mamba


class _Req:
    def __init__(self, slot):
        self.mamba_pool_idx, self.rid = slot, "r"


def test_fast_paths_are_on_for_the_default_cache_only():
    tree, _, mamba = make()
    assert tree._presort and tree._states.free_host is not None
    flop, _, _ = make(state_eviction_policy="flop")  # ancestor positions to keep: attach() does it
    assert flop._presort
    events, _, _ = make(enable_kv_events=True)  # the recorder may refuse an attach: filed after it
    assert not events._presort
    mru, _, _ = make(eviction_policy="mru")  # eagerly re-filed keys
    assert not mru._presort


def put(tree, alloc, mamba, toks):
    """Insert ``toks`` on top of their cached prefix, with a fresh state slot."""
    toks = list(toks)
    m = tree.match_prefix(toks)
    value = torch.cat([m.device_indices, alloc.alloc(len(toks) - m.kv_prefix_len)]) if m.kv_prefix_len == \
        m.prefix_len else None
    assert value is not None
    return tree.insert_with_state(toks, value, mamba.alloc_one())


def test_new_leaf_is_filed_under_its_key_with_the_state():
    tree, alloc, mamba = make()
    for toks in (range(8), range(16), range(40, 44)):
        res = put(tree, alloc, mamba, toks)
        assert res.state_kept and tree._sort_key is tree._key_any
        assert res.node.skey == tree._sort_key(res.node) and res.node.skey[0] is True
    tree.check_invariants()
    tomb = tree.insert_with_state(list(range(60, 66)), alloc.alloc(6)).node  # newest, but no state
    assert tree.evict(1) == (6, 0) and tomb.parent is not None and tree.total_size() == 20  # it goes first
    tree.check_invariants()


def test_sort_key_and_slot_survive_a_raising_insert():
    tree, alloc, mamba = make()
    good = mamba.alloc_one()
    rows = alloc.alloc(6)
    before = (tree.pretty_print(), mamba.available_size(), alloc.available_size())
    with pytest.raises(LengthMismatchError):
        tree.insert_with_state(list(range(5)), rows[:4], good)  # 5 tokens, 4 rows
    assert tree._sort_key is tree._key_any
    assert before == (tree.pretty_print(), mamba.available_size(), alloc.available_size())
    assert not mamba.free_slots.is_free_one(good)  # still the caller's
    mamba.free(good)
    tree.check_invariants()


@pytest.mark.parametrize("checks", [True, False])
def test_slot_errors_and_messages_match_the_general_check(checks):
    results = []
    for general in (False, True):
        tree, alloc, mamba = make(checks=checks, general=general)
        held = tree.insert_with_state(list(range(4)), alloc.alloc(4), mamba.alloc_one())
        tree_slot = tree.state_slot(held.node)
        free_slot = mamba.alloc_one()
        mamba.free(free_slot)
        rows = alloc.alloc(6)
        out = []
        bads = [0, 99, -1, tree_slot, True, 1.5, "x", torch.tensor(tree_slot), np.int64(tree_slot)]
        if checks:  # (without checks a free slot goes in, as the pools' own checks=False)
            bads += [free_slot, np.int64(free_slot)]
        for bad in bads:
            for call in (lambda s: tree.insert_with_state(list(range(10, 16)), rows, s),  # noqa: B023
                         lambda s: tree.fork_state(tree.root_node, _Req(s))):  # noqa: B023
                try:
                    call(bad)
                    out.append("ok")
                except (InvalidArgumentError, InvalidIndexError) as exc:
                    out.append(f"{type(exc).__name__}: {exc}")
        tree.check_invariants()
        results.append(out)
    assert results[0] == results[1]
    assert any("not allocated" in r for r in results[0]) == checks
    assert any("is the state of tree node" in r for r in results[0])


def test_int_like_slots_take_the_general_check_and_work():
    tree, alloc, mamba = make()
    a, b = mamba.alloc_one(), mamba.alloc_one()
    assert tree.insert_with_state(list(range(4)), alloc.alloc(4), np.int64(a)).state_kept
    m = tree.match_prefix(list(range(8)))
    assert tree.insert_with_state(list(range(8)), torch.cat([m.device_indices, alloc.alloc(4)]),
                                  torch.tensor(b)).state_kept
    req = _Req(np.int64(mamba.alloc_one()))
    assert tree.fork_state(tree.match_prefix(list(range(8))).last_node, req)
    mamba.free(int(req.mamba_pool_idx))  # the request's slot, back before the slot audit
    tree.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "flop"])
def test_random_workload_same_as_the_general_paths(policy):
    """The same requests on the hot paths and on the general ones: identical hits, trees,
    victims and counters after every step, invariants throughout."""
    rng = np.random.default_rng(7)
    trees = [make(slots=8, kv=160, general=g, state_eviction_policy=policy) for g in (False, True)]
    prefixes = [rng.integers(0, 50, size=int(n)).tolist() for n in rng.integers(4, 30, size=6)]
    for step in range(300):
        toks = prefixes[int(rng.integers(len(prefixes)))] + rng.integers(0, 50, size=int(rng.integers(1, 12))).tolist()
        seen = []
        for tree, alloc, mamba in trees:
            m = tree.match_prefix(toks)
            tree.inc_lock_ref(m.last_node)
            if mamba.available_size() == 0:
                tree.evict(0, 1)
            slot = mamba.alloc_one()
            hit = tree.fork_state(m.last_node, _Req(slot))
            need = len(toks) - m.prefix_len
            if alloc.available_size() < need:
                tree.evict(need - alloc.available_size())
            rows = alloc.alloc(need)
            if rows is None or slot is None:
                tree.dec_lock_ref(m.last_node)
                if slot is not None:
                    mamba.free(slot)
                seen.append(("full", m.prefix_len))
                continue
            res = tree.insert_with_state(toks, torch.cat([m.device_indices, rows]), slot)
            if res.prefix_len > m.prefix_len:
                alloc.free(rows[: res.prefix_len - m.prefix_len])
            tree.dec_lock_ref(m.last_node)
            seen.append((m.prefix_len, m.kv_prefix_len, hit, res.prefix_len, res.state_kept,
                         tree.full_evictable_size(), tree.mamba_total_size()))
        assert seen[0] == seen[1], step
        if step % 25 == 0:
            for tree, _, _ in trees:
                tree.check_invariants()
            assert trees[0][0].pretty_print() == trees[1][0].pretty_print()
    for tree, _, _ in trees:
        tree.check_invariants()
