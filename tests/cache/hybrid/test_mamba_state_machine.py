"""Hypothesis state machine: MambaRadixCache against a plain Python model.

The model holds the cached page-aligned prefixes (prefix -> KV rows of its last page) and the
prefixes that end at a node holding a state (prefix -> slot, and the value written into
that slot when it was handed over). Inserts (with or without a state), matches, forks,
locks, unlocks and evictions of both kinds run in random order (a state-only eviction takes
exactly the states the order ranks first: for ``lru``, a stable sort of every candidate,
against the tree's incremental heap); after every step:
``check_invariants()`` of the cache (both conservation laws), the allocator and the Mamba
pool, the tree's content equals the model, and every cached state slot still holds the
value written at insert (nobody wrote into a tree slot).
"""
from hybrid_util import PrefixModel, tree_pages
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache
from radixkv.memory import MambaPool
from radixkv.scheduler.req import Req

POOL, SLOTS = 48, 5


def tree_content(cache):
    """{prefix tuple: rows of its last page}, {node-end prefix tuple: slot}."""
    return tree_pages(cache, cache.state_slot)


class MambaMachine(PrefixModel, RuleBasedStateMachine):
    page_size = 1
    state_policy = "lru"

    def __init__(self):
        super().__init__()
        ps = self.page_size
        self.alloc = TokenToKVPoolAllocator(POOL) if ps == 1 else PagedTokenToKVPoolAllocator(POOL, ps)
        self.mamba = MambaPool(SLOTS, (3, 4), (1, 2, 2), 2)
        self.cache = MambaRadixCache(None, self.alloc, page_size=ps, mamba_pool=self.mamba,
                                     state_eviction_policy=self.state_policy)
        self.kv, self.states, self.values = {}, {}, {}  # values: slot -> float written into it
        self.locks = []  # (node, prefix it ends at)
        self.next_value = 1.0

    # ---------------------------------------------------------------- rules
    @rule(data=st.data(), with_state=st.booleans(), lock=st.booleans())
    def insert(self, data, with_state, lock):
        tokens = self.draw_tokens(data)
        key = self.aligned(tokens)
        if not key or self.alloc.available_size() < len(key):
            return
        rows = self.alloc.alloc(len(key))
        slot = None
        if with_state and self.mamba.available_size():
            slot = int(self.mamba.alloc(1)[0])
            self.mamba.conv_state[:, slot] = self.next_value
        res = self.cache.insert_with_state(list(key), rows, slot)
        if res.prefix_len:
            self.alloc.free(rows[: res.prefix_len])
        assert res.prefix_len == max([len(p) for p in self.kv if key[: len(p)] == p] or [0])
        for i in range(res.prefix_len + self.page_size, len(key) + 1, self.page_size):
            self.kv[key[:i]] = tuple(rows[i - self.page_size:i].tolist())
        if slot is not None:
            assert res.state_kept == (key not in self.states)
            if res.state_kept:
                self.states[key] = slot
                self.values[slot] = self.next_value
            self.next_value += 1.0
        if lock:  # as cache_unfinished_req does: lock where the key ends (maybe a tombstone)
            self.cache.inc_lock_ref(res.node)
            self.locks.append((res.node, key))

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data, lock):
        tokens = self.draw_tokens(data)
        s, n, rows = self.expect_match(tokens)
        m = self.cache.match_prefix(list(tokens))
        assert (m.prefix_len, m.kv_prefix_len) == (s, n)
        assert m.device_indices.tolist() == rows
        slot = self.cache.state_slot(m.last_node)
        assert (slot == self.states[self.aligned(tokens)[:s]]) if s else slot is None
        if lock:
            self.cache.inc_lock_ref(m.last_node)
            self.locks.append((m.last_node, self.aligned(tokens)[:s]))

    @precondition(lambda self: self.mamba.available_size() > 0)
    @rule(data=st.data())
    def fork(self, data):
        tokens = self.draw_tokens(data)
        s, _, _ = self.expect_match(tokens)
        m = self.cache.match_prefix(list(tokens))
        req = Req("r", list(tokens))
        req.mamba_pool_idx = int(self.mamba.alloc(1)[0])
        self.mamba.conv_state[:, req.mamba_pool_idx] = -1.0
        assert self.cache.fork_state(m.last_node, req) == bool(s)
        want = self.values[self.states[self.aligned(tokens)[:s]]] if s else 0.0
        assert bool((self.mamba.conv_state[:, req.mamba_pool_idx] == want).all())
        self.mamba.free(req.mamba_pool_idx)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.cache.dec_lock_ref(node)

    @rule(num_tokens=st.integers(0, 60), num_states=st.integers(0, SLOTS + 1))
    def evict(self, num_tokens, num_states):
        kv_ev, st_ev = self.cache.evictable_size(), self.cache.mamba_evictable_size()
        before = self.cache._states.unpinned()
        # the victims of a state-only eviction: the first of the order ranking every candidate
        # (for lru, the stable sort the LRU heap replaced; flop ranks all of them anyway)
        expect = {before[int(i)] for i in self.cache.state_order.order(self.cache, before)[:num_states]}
        res = self.cache.evict(num_tokens, num_states)
        if num_tokens == 0:
            assert {n for n in before if self.cache.state_slot(n) is None} == expect
        kv, states = tree_content(self.cache)
        assert all(self.kv.get(p) == r for p, r in kv.items()), "evict changed or added KV"
        assert all(self.states.get(p) == s for p, s in states.items()), "evict changed or added a state"
        assert res.num_tokens == sum(len(r) for p, r in self.kv.items() if p not in kv)
        assert res.num_states == len(self.states) - len(states)
        assert res.num_tokens >= min(num_tokens, kv_ev) and res.num_states >= min(num_states, st_ev)
        for _node, prefix in self.locks:  # locked paths keep their KV, locked nodes their state
            assert all(prefix[:i] in kv for i in range(self.page_size, len(prefix) + 1, self.page_size))
            assert prefix not in self.states or prefix in states
        for p in self.states:
            if p not in states:
                del self.values[self.states[p]]
        self.kv, self.states = kv, states

    # ---------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        self.alloc.check_invariants()
        self.mamba.check_invariants()
        assert tree_content(self.cache) == (self.kv, self.states)
        assert self.alloc.available_size() + self.cache.total_size() == POOL
        assert self.mamba.available_size() + self.cache.mamba_total_size() == SLOTS
        for slot, value in self.values.items():
            assert bool((self.mamba.conv_state[:, slot] == value).all()), f"tree slot {slot} was written"


MambaMachine.TestCase.settings = settings(stateful_step_count=40)
TestMambaPage1LRU = MambaMachine.TestCase


class MambaPage2Flop(MambaMachine):
    page_size = 2
    state_policy = "flop"


MambaPage2Flop.TestCase.settings = settings(stateful_step_count=40)
TestMambaPage2Flop = MambaPage2Flop.TestCase
