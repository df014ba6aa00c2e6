"""A hybrid model's KV in the host tier (issue 31, items 1 and 3): ``TieredMambaRadixCache``
demotes a device leaf's KV and state together, drops a stateless leaf, walks host-only nodes in
a match up to the deepest state in any tier, loads the path's KV then its state back, adopts an
insert's rows into host-only nodes, and host drops remove the tombstones they leave. KV values
and states name their own prefix, so a page or state put back in the wrong place shows; a
seeded stress and a Hypothesis state machine run ``check_invariants`` after every demote, load
and drop, under both write policies (``write_through``: every insert copied to the host, a
victim with a copy freed without one)."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache.hybrid.tiered_mamba_cache import TieredMambaRadixCache
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.memory import MambaPool
from radixkv.memory.host_kv_pool import HostKVPool
from radixkv.memory.host_state_pool import HostStatePool
from radixkv.memory.kv_pool import MHATokenToKVPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/cache: the tier tests' helpers
from tier_util import check_copies_hit_held_pages_once, kv_of, read_kv, record_stores, write_kv  # noqa: E402


def make(ps=1, device_tokens=32, host_tokens=64, slots=4, host_slots=6, write_policy="write_back", events=False,
         backend=None, timeout_s=5.0, state_shape=(1, 2, 2), admit="all"):
    """A tree over fresh pools; with ``backend`` a storage tier over it (tests/cache/hybrid/
    test_hybrid_state_storage.py)."""
    from radixkv.storage.tier_controller import StorageController

    kv = MHATokenToKVPool(device_tokens, ps, torch.float64, 1, 2, 2)
    alloc = (TokenToKVPoolAllocator(device_tokens, "cpu", kvcache=kv) if ps == 1
             else PagedTokenToKVPoolAllocator(device_tokens, ps, "cpu", kvcache=kv))
    mamba = MambaPool(slots, (3, 4), state_shape, 2, dtype=torch.float64)
    host = HostKVPool(kv, host_tokens // ps)
    storage = None if backend is None else StorageController(backend, host.page_bytes, timeout_s=timeout_s,
                                                             admit=admit)
    cache = TieredMambaRadixCache(None, alloc, host_pool=host, host_state_pool=HostStatePool(mamba, host_slots),
                                  page_size=ps, mamba_pool=mamba, write_policy=write_policy,
                                  enable_kv_events=events, storage=storage, layout_fingerprint="test")
    return cache, alloc, mamba


def kv(tokens):
    return kv_of(np.asarray(tokens, dtype=np.int32))


def state_of(tokens):
    return float(kv(tokens)[-1]) / 7 + len(tokens)


def serve(cache, alloc, mamba, tokens):
    """Match, load back, check the reused KV and state, insert the rest with its state.
    Returns (device hit, tokens past it loaded from the host) or None when it did not fit."""
    ps = cache.page_size
    tokens = np.asarray(tokens, dtype=np.int32)
    a = tokens.size - tokens.size % ps
    m0 = cache.match_prefix(tokens[:a])
    m = cache.load_back(m0)
    cache.check_invariants()
    pre = m.prefix_len
    assert m.device_indices.numel() == pre
    if pre:
        assert torch.equal(read_kv(cache, m.device_indices), kv(tokens[:pre]))
        slot = cache.state_slot(m.last_node)
        assert slot is not None
        assert float(mamba.temporal_state[0, slot, 0, 0, 0]) == state_of(tokens[:pre])
    cache.inc_lock_ref(m.last_node)
    need = a - pre
    if alloc.available_size() < need:
        cache.evict(need - alloc.available_size())
        cache.check_invariants()
    if mamba.available_size() == 0:
        cache.evict(0, 1)
    new = alloc.alloc(need) if need else torch.empty(0, dtype=torch.int64)
    got = mamba.alloc(1)
    if new is None or got is None or a == 0:
        if new is not None and need:
            alloc.free(new)
        if got is not None:
            mamba.free([int(got[0])])
        cache.dec_lock_ref(m.last_node)
        return None
    write_kv(cache, new, kv(tokens[:a])[pre:])
    slot = int(got[0])
    mamba.conv_state[:, slot] = 0
    mamba.temporal_state[:, slot] = state_of(tokens[:a])
    rows = torch.cat([m.device_indices, new])
    res = cache.insert_with_state(tokens[:a], rows, slot)
    held = set(cache.match_prefix(tokens[:a]).device_indices.tolist())
    dup = [r for r in new.tolist() if r not in held]
    if dup:
        alloc.free(torch.tensor(dup, dtype=torch.int64))
    cache.dec_lock_ref(m.last_node)
    assert res.node.vbuf
    cache.check_invariants()
    return m0.prefix_len, pre - m0.prefix_len


@pytest.mark.parametrize("ps", [1, 4])
def test_demote_kv_and_state_together_then_load_back(ps):
    cache, alloc, mamba = make(ps)
    a = list(range(1, 1 + 2 * ps))
    b = a + list(range(50, 50 + 2 * ps))
    assert serve(cache, alloc, mamba, a) == (0, 0)
    assert serve(cache, alloc, mamba, b) == (2 * ps, 0)
    assert cache.evict(cache.evictable_size()).num_tokens == 4 * ps  # both demoted, nothing dropped
    cache.check_invariants()
    assert cache.evictable_size() == 0 and cache.host_size() == 4 * ps and cache.mamba_total_size() == 0
    m = cache.match_prefix(np.array(b + [99] * ps, dtype=np.int32))
    assert (m.prefix_len, m.host_len, m.kv_prefix_len) == (0, 4 * ps, 4 * ps)
    got = cache.load_back(m)
    cache.check_invariants()
    assert (got.prefix_len, got.host_len) == (4 * ps, 0)
    assert torch.equal(read_kv(cache, got.device_indices), kv(b))
    assert float(mamba.temporal_state[0, cache.state_slot(got.last_node), 0, 0, 0]) == state_of(b)
    assert cache.tier_counters()["loaded_pages"] == 4 and cache.host_size() == 0  # a came along (its state stays)
    assert cache.host_state_slot(got.last_node.parent) is not None


def test_stateless_leaf_is_dropped_not_demoted():
    cache, alloc, mamba = make()
    rows = alloc.alloc(3)
    cache.insert([1, 2, 3], rows)  # KV without a state
    assert cache.evict(3).num_tokens == 3
    cache.check_invariants()
    assert cache.host_size() == 0 and cache.total_size() == 0


def test_host_drop_removes_the_tombstones_it_leaves():
    cache, alloc, mamba = make(host_tokens=8, host_slots=4)
    rows = alloc.alloc(3)
    cache.insert([1, 2, 3], rows)  # a tombstone parent
    serve(cache, alloc, mamba, [1, 2, 3, 4, 5])
    cache.evict(cache.evictable_size())  # leaf (KV + state) then its stateless parent: both demoted
    cache.check_invariants()
    assert cache.host_size() == 5
    assert cache.evict_host(8) == 5  # the leaf goes, and its tombstone parent with it
    cache.check_invariants()
    assert cache.host_size() == 0 and len(cache.root_node.children) == 0


def test_insert_adopts_rows_into_host_only_nodes():
    cache, alloc, mamba = make()
    serve(cache, alloc, mamba, [1, 2, 3, 4])
    cache.evict(4)
    assert cache.host_size() == 4
    rows = alloc.alloc(6)
    write_kv(cache, rows, kv([1, 2, 3, 4, 5, 6]))
    assert cache.insert([1, 2, 3, 4, 5, 6], rows) == 4  # the host-only node took rows[:4]
    cache.check_invariants()
    assert cache.host_size() == 0 and cache.total_size() == 6
    m = cache.match_prefix([1, 2, 3, 4, 7])
    assert m.prefix_len == 0 and m.host_len == 4  # the state is still on the host, the KV on the device
    got = cache.load_back(m)
    assert got.device_indices.tolist() == rows[:4].tolist()
    cache.check_invariants()


def test_audit_names_a_leaked_host_page_and_a_bad_config():
    cache, alloc, mamba = make()
    serve(cache, alloc, mamba, [1, 2, 3])
    cache.evict(3)
    cache.check_invariants()
    cache.host_alloc.alloc(1)  # a page no node holds
    with pytest.raises(InvariantError, match="leak"):
        cache.check_invariants()
    kv = MHATokenToKVPool(8, 1, torch.float64, 1, 2, 2)
    with pytest.raises(InvalidArgumentError, match="host state tier"):
        TieredMambaRadixCache(None, TokenToKVPoolAllocator(8, "cpu", kvcache=kv), host_pool=HostKVPool(kv, 4),
                              host_state_pool=None, mamba_pool=mamba)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("ps,seed", [(1, 0), (1, 1), (2, 2), (4, 3)])
def test_seeded_stress(ps, seed, policy):
    """Random conversations (shared prefixes, growing turns) with random evictions of KV,
    states and host pages; ``serve`` checks every reused row's KV and every reused state,
    and the audit runs after every demote, load and drop."""
    rng = np.random.default_rng(seed)
    cache, alloc, mamba = make(ps, device_tokens=24 * ps, host_tokens=48 * ps, slots=4, host_slots=6,
                               write_policy=policy)
    convs = [list(rng.integers(1, 30, size=int(rng.integers(1, 3)) * ps)) for _ in range(5)]
    loaded = 0
    for _ in range(250):
        op = rng.random()
        if op < 0.7:
            i = int(rng.integers(len(convs)))
            grow = list(rng.integers(1, 30, size=int(rng.integers(1, 4)) * ps))
            if len(convs[i]) + len(grow) > 16 * ps:
                convs[i] = convs[i][:ps]
            out = serve(cache, alloc, mamba, convs[i] + grow)
            if out is not None:
                loaded += out[1]
                convs[i] = convs[i] + grow
        elif op < 0.8:
            cache.evict(int(rng.integers(1, 8 * ps)))
        elif op < 0.9:
            cache.evict(0, int(rng.integers(1, 3)))
        else:
            cache.evict_host(int(rng.integers(1, 6)))
        cache.check_invariants()
    tc = cache.tier_counters()
    assert loaded > 0 and tc["loaded_pages"] > 0
    if policy == "write_back":  # write_through: the host pages came from the inserts' copies
        assert tc["demoted_pages"] > 0 and tc["written_through_pages"] == 0
    else:
        assert tc["written_through_pages"] > 0


class TieredHybridMachine(RuleBasedStateMachine):
    """Conversations served through the tree (``serve`` checks every reused row and state
    against its prefix) with KV, state and host drops in between, against a model of the
    prefixes given a state: a match (either tier) ends only at one of them, and the audit
    holds after every step."""

    PS = 1
    POLICY = "write_back"
    EVENTS = False

    def __init__(self):
        super().__init__()
        ps = self.PS
        self.cache, self.alloc, self.mamba = make(ps, device_tokens=16 * ps, host_tokens=24 * ps, slots=4,
                                                  host_slots=5, write_policy=self.POLICY, events=self.EVENTS)
        self.convs = [[1 + c] * ps for c in range(3)]
        self.stated: set[tuple[int, ...]] = set()

    @rule(c=st.integers(0, 2), grow=st.lists(st.integers(1, 9), min_size=1, max_size=3))
    def serve_turn(self, c, grow):
        toks = self.convs[c] + [t for t in grow for _ in range(self.PS)]
        if len(toks) > 10 * self.PS:
            toks = self.convs[c][:self.PS] + toks[-self.PS:]
        if serve(self.cache, self.alloc, self.mamba, toks) is not None:
            self.convs[c] = toks
            self.stated.add(tuple(toks))

    @rule(c=st.integers(0, 2), cut=st.integers(1, 12))
    def match_only(self, c, cut):
        toks = np.asarray(self.convs[c][:cut * self.PS], dtype=np.int32)
        m = self.cache.match_prefix(toks)
        for end in (m.prefix_len, m.prefix_len + m.host_len):
            assert end == 0 or tuple(toks[:end].tolist()) in self.stated, (end, toks)

    @rule(k=st.integers(1, 12))
    def evict_kv(self, k):
        self.cache.evict(k * self.PS)

    @rule(k=st.integers(1, 3))
    def evict_states(self, k):
        self.cache.evict(0, k)

    @rule(k=st.integers(1, 8))
    def evict_host(self, k):
        self.cache.evict_host(k)

    @invariant()
    def audit(self):
        self.cache.check_invariants()


def machine_tests(machine, name):
    """The TestCases of ``machine`` at page sizes 1 and 2 under both write policies, named
    ``name`` + ``Paged`` / ``WriteThrough`` (for the module's globals)."""
    out = {}
    for ps, policy in ((1, "write_back"), (2, "write_back"), (1, "write_through"), (2, "write_through")):
        suffix = ("WriteThrough" if policy == "write_through" else "") + ("Paged" if ps == 2 else "")
        variant = type(f"{machine.__name__}{suffix}", (machine,), {"PS": ps, "POLICY": policy})
        test = variant.TestCase
        test.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
        out[name + suffix] = test
    return out


globals().update(machine_tests(TieredHybridMachine, "TestTieredHybridMachine"))


# ---------------------------------------------------------------------- write_through
@pytest.mark.parametrize("ps", [1, 4])
def test_write_through_copies_each_insert_and_evicts_without_a_copy(ps):
    cache, alloc, mamba = make(ps, write_policy="write_through")
    a = list(range(1, 1 + 2 * ps))
    b = a + list(range(50, 50 + 2 * ps))
    serve(cache, alloc, mamba, a)
    assert cache.host_size() == 2 * ps and cache.tier_counters()["written_through_pages"] == 2
    serve(cache, alloc, mamba, b)
    assert cache.host_size() == 4 * ps and cache.tier_counters()["written_through_pages"] == 4
    assert cache.evict(cache.evictable_size()).num_tokens == 4 * ps  # both to the host, no copy
    cache.check_invariants()
    tc = cache.tier_counters()
    assert tc["demoted_pages"] == 0 and cache.host_size() == 4 * ps and cache.total_size() == 0
    assert serve(cache, alloc, mamba, b + list(range(70, 70 + ps))) == (0, 4 * ps)  # KV and states checked
    assert cache.host_size() == 5 * ps  # the loaded nodes keep their clean copies; the new leaf copied
    cache.evict(cache.evictable_size())
    cache.check_invariants()
    assert cache.tier_counters()["demoted_pages"] == 0  # the new leaf had its copy at insert
    assert serve(cache, alloc, mamba, b + list(range(70, 70 + ps))) == (0, 5 * ps)


def test_write_through_stateless_leaf_dropped_with_its_copy():
    cache, alloc, mamba = make(write_policy="write_through")
    rows = alloc.alloc(3)
    cache.insert([1, 2, 3], rows)  # KV without a state: copied, never kept as a host-only leaf
    assert cache.host_size() == 3
    assert cache.evict(3).num_tokens == 3
    cache.check_invariants()
    assert cache.host_size() == 0 and cache.total_size() == 0 and cache.host_alloc.available_size() == 64


def test_write_through_full_host_skips_the_copy():
    cache, alloc, mamba = make(write_policy="write_through", host_tokens=4)
    serve(cache, alloc, mamba, [1, 2, 3, 4])
    serve(cache, alloc, mamba, [5, 6, 7])  # no host room (the copy above is a device node's): not copied
    cache.check_invariants()
    assert cache.host_size() == 4 and cache.tier_counters()["written_through_pages"] == 4
    cache.evict(cache.evictable_size())  # [1..4] freed without a copy; [5,6,7] has no host room: dropped
    cache.check_invariants()
    assert cache.host_size() == 4 and cache.tier_counters()["demoted_pages"] == 0
    assert cache.match_prefix([1, 2, 3, 4, 9]).host_len == 4


def test_audit_names_a_copy_held_twice():
    cache, alloc, mamba = make(write_policy="write_through")
    serve(cache, alloc, mamba, [1, 2, 3])
    serve(cache, alloc, mamba, [7, 8])
    cache.check_invariants()
    x, y = (n for n in cache.iter_nodes() if n.parent is not None)
    y.hbuf = x.hbuf[:len(y.hbuf)]  # two device nodes' copies on one host page
    with pytest.raises(InvariantError, match="double-owned"):
        cache.check_invariants()


def test_the_demotion_copy_skips_nodes_dropped_later_in_the_same_evict():
    """One evict demotes the leaf a (its host pages pending the call's one copy), then drops
    its stateless parent c (too big for the host) with it; d, demoted next, is given a's
    pages: the copy writes them once, for d (twice in one copy is a race on CUDA)."""
    cache, alloc, mamba = make(device_tokens=16, host_tokens=4, slots=4, host_slots=4, events=True)
    chain = list(range(1000, 1012))
    cache.insert(chain[:8], alloc.alloc(8))  # c, without a state
    serve(cache, alloc, mamba, chain[:10])
    serve(cache, alloc, mamba, chain[:12])
    serve(cache, alloc, mamba, [5000, 5001])  # d, the most recent
    stores = record_stores(cache)
    assert cache.evict(14).num_tokens == 14
    cache.check_invariants()
    check_copies_hit_held_pages_once(cache, stores)
    assert serve(cache, alloc, mamba, [5000, 5001, 5002]) == (0, 2)  # d's KV and state, bit-equal
