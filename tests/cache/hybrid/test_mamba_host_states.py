"""The host state tier of MambaRadixCache (issue 31, item 3): evicted states are demoted to
host slots, a match that reaches one reports it (``host_len``) and ``load_back`` brings it
back bit-equal, a full host tier drops its oldest state, and the audit names leaked and
double-owned host slots. A Hypothesis state machine against a plain model (insert, match +
load back, fork, lock, unlock, evict of both kinds) and a seeded stress check the invariants
after every operation."""
import numpy as np
import pytest
import torch
from hybrid_util import PrefixModel, tree_pages
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
from radixkv.cache.hybrid.state_events import StateRemoved, StateStored
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.events.state_index import StateIndex
from radixkv.memory import MambaPool
from radixkv.memory.host_state_pool import HostStatePool
from radixkv.scheduler.req import Req

POOL, SLOTS, HOST = 48, 4, 3


def make(ps=1, slots=SLOTS, host=HOST, policy="lru", pool=POOL, events=False):
    alloc = TokenToKVPoolAllocator(pool) if ps == 1 else PagedTokenToKVPoolAllocator(pool, ps)
    mamba = MambaPool(slots, (3, 4), (1, 2, 2), 2, dtype=torch.float64)
    cache = MambaRadixCache(None, alloc, page_size=ps, mamba_pool=mamba, state_eviction_policy=policy,
                            host_state_pool=HostStatePool(mamba, host), enable_kv_events=events)
    return cache, alloc, mamba


def write_state(mamba, slot, value):
    """A state no arithmetic reproduces by accident: value, value / 3 (not a short binary fraction)."""
    mamba.conv_state[:, slot] = value
    mamba.temporal_state[:, slot] = value / 3


def read_state(cache, node):
    """(conv, temporal) of ``node``'s state from whichever tier holds it, else None."""
    slot = cache.state_slot(node)
    if slot is not None:
        return cache.mamba_pool.conv_state[:, slot].clone(), cache.mamba_pool.temporal_state[:, slot].clone()
    h = cache.host_state_slot(node)
    if h is not None:
        return cache.host_state_pool.conv[:, h].clone(), cache.host_state_pool.temporal[:, h].clone()
    return None


def insert(cache, alloc, mamba, tokens, value):
    rows = alloc.alloc(len(tokens))
    slot = int(mamba.alloc(1)[0])
    write_state(mamba, slot, value)
    res = cache.insert_with_state(tokens, rows, slot)
    if res.prefix_len:
        alloc.free(rows[:res.prefix_len])
    return res


def test_demote_then_load_back_is_bit_equal():
    cache, alloc, mamba = make()
    a = insert(cache, alloc, mamba, [1, 2, 3], 1.1).node
    b = insert(cache, alloc, mamba, [1, 2, 3, 4, 5], 2.2).node
    before = read_state(cache, b)
    assert cache.evict(0, 2).num_states == 2
    cache.check_invariants()
    assert cache.state_slot(b) is None and cache.host_state_slot(b) is not None
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.prefix_len, m.host_len, m.kv_prefix_len, m.host_node) == (0, 5, 5, b)
    got = cache.load_back(m)
    cache.check_invariants()
    assert (got.prefix_len, got.host_len, got.last_node) == (5, 0, b)
    assert got.device_indices.tolist() == cache.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist()
    after = read_state(cache, b)
    assert cache.state_slot(b) is not None and cache.host_state_slot(b) is None
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    req = Req("r", [1, 2, 3, 4, 5, 6])
    req.mamba_pool_idx = int(mamba.alloc(1)[0])
    assert cache.fork_state(got.last_node, req)
    assert torch.equal(mamba.temporal_state[:, req.mamba_pool_idx], before[1])
    assert cache.host_state_slot(a) is not None
    counters = cache.host_state_counters()
    assert (counters["host_states_demoted"], counters["host_states_loaded"], counters["host_state_used"]) == (2, 1, 1)


def test_state_events_carry_the_tier_and_counters_count_host_hits():
    """Demote: ``StateStored`` on CPU, then ``StateRemoved`` from GPU; load back: the reverse;
    a host drop and a reset: ``StateRemoved`` on CPU. Counters: hits and their tokens."""
    cache, alloc, mamba = make(host=1, events=True)
    a = insert(cache, alloc, mamba, [1, 2, 3], 1.1).node
    b = insert(cache, alloc, mamba, [1, 2, 3, 4, 5], 2.2).node
    ha, hb = a.block_hashes[-1], b.block_hashes[-1]
    cache.kv_events.take_events()
    cache.evict(0, 1)  # lru: a's state goes first
    assert cache.kv_events.take_events() == [StateStored(ha, 3, "CPU"), StateRemoved((ha,), "GPU")]
    cache.evict(0, 1)  # b's: the full host tier (1 slot) drops a's
    assert cache.kv_events.take_events() == [StateStored(hb, 5, "CPU"), StateRemoved((ha,), "CPU"),
                                             StateRemoved((hb,), "GPU")]
    cache.check_invariants()
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert (m.prefix_len, m.host_len) == (0, 5)
    assert cache.load_back(m).prefix_len == 5
    assert cache.kv_events.take_events() == [StateStored(hb, 5, "GPU"), StateRemoved((hb,), "CPU")]
    counters = cache.host_state_counters()
    assert (counters["host_states_hits"], counters["host_states_hit_tokens"]) == (1, 5)
    assert [counters[f"host_states_{k}"] for k in ("demoted", "loaded", "dropped")] == [2, 1, 1]
    cache.evict(0, 1)
    cache.kv_events.take_events()
    cache.reset()
    assert cache.kv_events.take_events()[0] == StateRemoved((hb,), "CPU")
    cache.check_invariants()


def test_audit_names_a_host_state_the_recorder_does_not_hold():
    cache, alloc, mamba = make(events=True)
    b = insert(cache, alloc, mamba, [1, 2, 3], 1.1).node
    cache.evict(0, 1)
    cache.kv_events._states["CPU"].clear()  # the recorder lost it
    with pytest.raises(InvariantError, match=str(b.block_hashes[-1])):
        cache.check_invariants()


def test_full_host_tier_drops_the_oldest_and_hits_stop_at_a_held_state():
    cache, alloc, mamba = make(host=1)
    insert(cache, alloc, mamba, [1, 2], 1.0)
    b = insert(cache, alloc, mamba, [1, 2, 3, 4], 2.0).node
    cache.evict(0, 1)  # lru: [1, 2] goes first
    cache.evict(0, 1)  # [1, 2, 3, 4] takes the only host slot: [1, 2] is dropped
    cache.check_invariants()
    assert cache.host_state_counters()["host_states_dropped"] == 1
    m = cache.match_prefix([1, 2, 3])  # KV of 3 tokens cached, no state at or above 3 in any tier
    assert (m.prefix_len, m.host_len, m.kv_prefix_len) == (0, 0, 3)
    m = cache.match_prefix([1, 2, 3, 4])
    assert (m.host_len, m.host_node) == (4, b)


def test_kv_eviction_drops_host_states_with_their_nodes():
    cache, alloc, mamba = make()
    insert(cache, alloc, mamba, [5, 6, 7], 3.0)
    cache.evict(0, 1)
    assert cache.host_state_counters()["host_state_used"] == 1
    assert cache.evict(3).num_tokens == 3
    cache.check_invariants()
    assert cache.host_state_counters()["host_state_used"] == 0 and cache.total_size() == 0


def test_load_back_without_a_device_slot_leaves_the_host_state():
    cache, alloc, mamba = make(slots=2)
    b = insert(cache, alloc, mamba, [1, 2], 1.0).node
    cache.evict(0, 1)
    held = mamba.alloc(2)  # every device slot taken by requests
    m = cache.match_prefix([1, 2])
    assert cache.load_back(m) is m
    assert cache.host_state_slot(b) is not None
    mamba.free(held)
    cache.check_invariants()
    assert cache.load_back(m).prefix_len == 2


def test_a_fresh_state_on_a_demoted_node_replaces_its_host_copy():
    cache, alloc, mamba = make()
    b = insert(cache, alloc, mamba, [1, 2], 1.0).node
    cache.evict(0, 1)
    rows = alloc.alloc(2)
    slot = int(mamba.alloc(1)[0])
    res = cache.insert_with_state([1, 2], rows, slot)
    alloc.free(rows)
    assert res.state_kept and cache.state_slot(b) == slot and cache.host_state_slot(b) is None
    cache.check_invariants()


def test_reset_frees_every_host_slot():
    cache, alloc, mamba = make()
    insert(cache, alloc, mamba, [1, 2], 1.0)
    insert(cache, alloc, mamba, [3, 4], 2.0)
    cache.evict(0, 2)
    cache.reset()
    cache.check_invariants()
    assert cache.host_state_counters()["host_state_used"] == 0


def test_audit_names_leaked_and_double_owned_host_slots():
    cache, alloc, mamba = make()
    a = insert(cache, alloc, mamba, [1, 2], 1.0).node
    b = insert(cache, alloc, mamba, [3, 4], 2.0).node
    cache.evict(0, 2)
    host = cache._host
    mine = host.slot_of[b]
    host.slot_of[b] = host.slot_of[a]  # two nodes own one slot
    with pytest.raises(InvariantError, match=rf"host state slots \[{host.slot_of[a]}\] owned twice"):
        cache.check_invariants()
    host.slot_of[b] = mine
    cache.check_invariants()
    stray = int(host.alloc.alloc(1)[0])  # taken behind the table's back: leaked
    with pytest.raises(InvariantError, match=rf"host state slots \[{stray}\] leaked \(in use, owned by no node\)"):
        cache.check_invariants()


def test_audit_names_host_states_on_dead_or_doubly_held_nodes():
    cache, alloc, mamba = make()
    a = insert(cache, alloc, mamba, [1, 2], 1.0).node
    c = insert(cache, alloc, mamba, [3, 4], 2.0).node
    cache.evict(0, 1)  # a's state to the host
    host = cache._host
    slot = host.slot_of[a]
    host.slot_of[c] = slot  # c also holds a device state
    with pytest.raises(InvariantError, match=rf"nodes \[{c.id}\] hold a state on the device and on the host"):
        cache.check_invariants()
    del host.slot_of[c]
    host.end[slot] = 7
    with pytest.raises(InvariantError, match=rf"position other than their node's end: nodes \[{a.id}\]"):
        cache.check_invariants()
    host.end[slot] = 2
    cache.check_invariants()
    cache.evict(4)  # both leaves leave the tree; the host state with its node
    host.slot_of[a] = slot
    host.alloc.alloc(1)
    with pytest.raises(InvariantError, match=rf"not in the tree \(leaked\): nodes \[{a.id}\]"):
        cache.check_invariants()


def test_bad_host_pool_is_refused():
    mamba = MambaPool(2, (3, 4), (1, 2, 2), 2)
    other = MambaPool(2, (3, 4), (1, 2, 2), 2)
    with pytest.raises(InvalidArgumentError):
        MambaRadixCache(None, TokenToKVPoolAllocator(8), mamba_pool=mamba, host_state_pool=HostStatePool(other, 2))


# ---------------------------------------------------------------------- state machine
def state_values(cache, node):
    """(conv, temporal) first elements of ``node``'s state in either tier, or None."""
    s = read_state(cache, node)
    return None if s is None else (float(s[0].flatten()[0]), float(s[1].flatten()[0]))


def tree_content(cache):
    """{prefix: rows of its last page}, {node-end prefix: state values in any tier}."""
    return tree_pages(cache, lambda node: state_values(cache, node))


class HostStateMachine(PrefixModel, RuleBasedStateMachine):
    page_size = 1
    state_policy = "lru"
    events = False

    def __init__(self):
        super().__init__()
        self.cache, self.alloc, self.mamba = make(self.page_size, policy=self.state_policy, events=self.events)
        self.index = StateIndex()  # a router fed the tree's events (events on)
        self.kv, self.states = {}, {}  # states: prefix -> (conv, temporal) written at insert
        self.locks = []
        self.next_value = 1.0

    def matched(self, tokens):
        """match + load_back as the scheduler does; checks the hit against the model."""
        s, n, rows = self.expect_match(tokens)
        m = self.cache.match_prefix(list(tokens))
        assert (m.prefix_len + m.host_len, m.kv_prefix_len) == (s, n)
        self.kv = tree_content(self.cache)[0]  # a match may split a node: the same pages
        m = self.moved(lambda: self.cache.load_back(m))
        if m.host_len:  # no device slot could be had (every one held): the hit stops short
            assert self.mamba.available_size() == 0 and self.cache.mamba_evictable_size() == 0
            return m, m.prefix_len
        assert m.prefix_len == s and m.device_indices.tolist() == rows
        return m, s

    @rule(data=st.data(), lock=st.booleans())
    def insert(self, data, lock):
        key = self.aligned(self.draw_tokens(data))
        if not key or self.alloc.available_size() < len(key) or not self.mamba.available_size():
            return
        value = self.next_value + 1 / 7
        self.next_value += 1.0
        res = insert(self.cache, self.alloc, self.mamba, list(key), value)
        kv = tree_content(self.cache)[0]
        assert all(kv[p] == r for p, r in self.kv.items()), "insert changed cached KV"
        assert set(kv) - set(self.kv) == {key[:i] for i in range(res.prefix_len + self.page_size, len(key) + 1,
                                                                  self.page_size)}
        self.kv = kv
        if res.state_kept:
            self.states[key] = (value, value / 3)
        if lock:
            self.cache.inc_lock_ref(res.node)
            self.locks.append(res.node)

    @rule(data=st.data(), lock=st.booleans())
    def match_and_load(self, data, lock):
        tokens = self.draw_tokens(data)
        m, s = self.matched(tokens)
        if s:
            conv, temporal = read_state(self.cache, m.last_node)
            assert self.cache.state_slot(m.last_node) is not None
            assert (float(conv.flatten()[0]), float(temporal.flatten()[0])) == self.states[self.aligned(tokens)[:s]]
        if lock:
            self.cache.inc_lock_ref(m.last_node)
            self.locks.append(m.last_node)

    @precondition(lambda self: self.mamba.available_size() > 0)
    @rule(data=st.data())
    def fork(self, data):
        tokens = self.draw_tokens(data)
        m, s = self.matched(tokens)
        if not self.mamba.available_size():  # the load took the last free slot
            return
        req = Req("r", list(tokens))
        req.mamba_pool_idx = int(self.mamba.alloc(1)[0])
        assert self.cache.fork_state(m.last_node, req) == bool(s)
        want = self.states[self.aligned(tokens)[:s]] if s else (0.0, 0.0)
        got = (self.mamba.conv_state[:, req.mamba_pool_idx], self.mamba.temporal_state[:, req.mamba_pool_idx])
        assert bool((got[0] == want[0]).all()) and bool((got[1] == want[1]).all())
        self.mamba.free(req.mamba_pool_idx)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        self.cache.dec_lock_ref(self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1))))

    def moved(self, op):
        """Run ``op`` (an eviction, or a load that may evict): no KV or state is changed or
        added, and a state lost while its KV stays is one the full host tier dropped. With
        events, a router fed them one at a time never misses a state that was in the tree
        before and after ``op`` (a tier move stores it on the new tier first)."""
        dropped = self.cache.host_state_counters()["host_states_dropped"]
        before = self.hashed_states()
        out = op()
        self.feed(before & self.hashed_states())
        kv, states = tree_content(self.cache)
        assert all(self.kv.get(p) == r for p, r in kv.items()), "KV changed or added"
        assert all(self.states.get(p) == v for p, v in states.items()), "a state changed in a tier move"
        lost = [p for p in self.states if p not in states and p in kv]  # states gone, their KV kept
        assert len(lost) <= self.cache.host_state_counters()["host_states_dropped"] - dropped
        self.kv, self.states = kv, states
        return out

    @rule(num_tokens=st.integers(0, 30), num_states=st.integers(0, SLOTS + 1))
    def evict(self, num_tokens, num_states):
        self.moved(lambda: self.cache.evict(num_tokens, num_states))

    def hashed_states(self):
        """Block hash of the last page of every node holding a state in some tier (events on)."""
        if not self.events:
            return set()
        cache = self.cache
        return {n.block_hashes[-1] for n in cache.iter_nodes()
                if n.parent is not None and (cache.state_slot(n) is not None or cache.host_state_slot(n) is not None)}

    def feed(self, kept):
        """Apply the pending events to the router one at a time: ``kept`` live throughout."""
        if not self.events:
            return
        for e in self.cache.kv_events.take_events():
            self.index.apply("w", e)
            assert kept <= set(self.index.live("w")), f"{type(e).__name__}: a router lost a kept state"

    @invariant()
    def consistent(self):
        self.feed(set())
        if self.events:  # the router's view per tier is the tree's
            cache = self.cache
            for medium, where in (("GPU", cache.state_slot), ("CPU", cache.host_state_slot)):
                want = {n.block_hashes[-1] for n in cache.iter_nodes() if n.parent is not None and where(n) is not None}
                assert set(self.index.live("w", medium)) == want, medium
        self.cache.check_invariants()
        self.alloc.check_invariants()
        self.mamba.check_invariants()
        assert tree_content(self.cache) == (self.kv, self.states)
        assert self.mamba.available_size() + self.cache.mamba_total_size() == SLOTS
        assert self.cache.host_state_counters()["host_state_used"] <= HOST


HostStateMachine.TestCase.settings = settings(stateful_step_count=40, deadline=None)
TestHostStatesPage1LRU = HostStateMachine.TestCase


class HostStatesPage2Flop(HostStateMachine):
    page_size = 2
    state_policy = "flop"


HostStatesPage2Flop.TestCase.settings = settings(stateful_step_count=40, deadline=None)
TestHostStatesPage2Flop = HostStatesPage2Flop.TestCase


class HostStatesPage2Events(HostStateMachine):
    """With events: the recorder's states per tier are the tables' (``check_invariants``), and
    a router fed the events agrees, never losing a state during a tier move."""

    page_size = 2
    events = True


HostStatesPage2Events.TestCase.settings = settings(stateful_step_count=40, deadline=None)
TestHostStatesPage2Events = HostStatesPage2Events.TestCase


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seeded_stress_demote_promote_drop(seed):
    """Long random runs (insert with a state, match + load back + lock, unlock, evict): the
    invariants after every operation, and every state in either tier equal to the one written."""
    rng = np.random.default_rng(seed)
    cache, alloc, mamba = make(ps=2, slots=5, host=4, pool=256)  # KV to spare: states move, nodes stay
    written, locks = {}, []
    for step in range(400):
        op = rng.integers(0, 4)
        tokens = rng.integers(0, 3, int(rng.integers(2, 12))).tolist()
        tokens = tokens[: len(tokens) // 2 * 2]
        if op == 0 and mamba.available_size() and alloc.available_size() >= len(tokens):
            res = insert(cache, alloc, mamba, tokens, float(step) + 1 / 7)
            if res.state_kept:
                written[tuple(tokens)] = (float(step) + 1 / 7, (float(step) + 1 / 7) / 3)
        elif op == 1:
            if written and rng.integers(0, 4):  # mostly a prompt that was cached, and more
                keys = sorted(written)
                tokens = list(keys[int(rng.integers(0, len(keys)))]) + tokens[:2]
            m = cache.load_back(cache.match_prefix(tokens))
            if m.prefix_len and rng.integers(0, 2):
                cache.inc_lock_ref(m.last_node)
                locks.append(m.last_node)
        elif op == 2 and locks:
            cache.dec_lock_ref(locks.pop(int(rng.integers(0, len(locks)))))
        else:
            cache.evict(int(rng.integers(0, 8)) * int(rng.integers(0, 2)), int(rng.integers(0, 3)))
        cache.check_invariants()
        for p, v in tree_content(cache)[1].items():
            assert written[p] == v, f"step {step}: state at {p} is {v}, written {written[p]}"
    counters = cache.host_state_counters()
    assert counters["host_states_demoted"] and counters["host_states_loaded"] and counters["host_states_dropped"]
