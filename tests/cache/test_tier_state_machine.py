"""Hypothesis state machine: the tiered cache (device + host, with and without storage) under
requests, device and host evictions, locks, storage restarts and resets.

After every step: ``check_invariants()`` (both tiers, leaf index, rows and host pages owned
once, nothing leaked), device conservation (free + evictable + protected == pool), and the
tree holds only prefixes that were inserted. Every request checks the KV it reuses against
the from-scratch KV (``tier_util.serve``), so a page demoted, promoted or read back into the
wrong place fails the run.
"""
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from storage_double import DictStorage, ScatterDictStorage
from tier_util import make_cache, serve

from radixkv.cache.radix_key import RadixKey
from radixkv.storage.tier_controller import StorageController

POOL = 24


def tokens_of(words):
    return np.array([w * 10 + i for w in words for i in range(4)], dtype=np.int32)


class TierMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.inserted = set()
        self.locks = []
        self.store = None
        self.ctl = None

    @rule(ps=st.sampled_from([1, 2, 4]), host=st.sampled_from([8, 16, 48]),
          policy=st.sampled_from(["write_back", "write_through"]),
          storage=st.sampled_from([None, DictStorage, ScatterDictStorage]),
          events=st.booleans())
    @precondition(lambda self: self.cache is None)
    def build(self, ps, host, policy, storage, events):
        self.cache = make_cache(ps=ps, device_tokens=POOL, host_tokens=host, write_policy=policy, events=events)
        if storage is not None:  # ScatterDictStorage: reads land straight in host rows
            self.store = storage()
            self._attach()

    def _attach(self):
        self.ctl = StorageController(self.store, self.cache.host_pool.page_bytes, timeout_s=5.0)
        self.cache.storage = self.ctl

    @rule(words=st.lists(st.integers(0, 5), min_size=1, max_size=4))
    @precondition(lambda self: self.cache is not None)
    def request(self, words):
        t = tokens_of(words)
        serve(self.cache, t)  # checks the reused KV bit for bit
        if self.ctl is not None:
            self.ctl.drain(5.0)
        ps = self.cache.page_size
        for i in range(ps, t.size - t.size % ps + 1, ps):
            self.inserted.add(tuple(t[:i].tolist()))

    @rule(n=st.integers(1, POOL))
    @precondition(lambda self: self.cache is not None)
    def evict_device(self, n):
        self.cache.evict(n)

    @rule(n=st.integers(1, 16))
    @precondition(lambda self: self.cache is not None)
    def evict_host(self, n):
        self.cache.evict_host(n)

    @rule(words=st.lists(st.integers(0, 5), min_size=1, max_size=3))
    @precondition(lambda self: self.cache is not None and len(self.locks) < 3)
    def lock(self, words):
        m = self.cache.load_back(self.cache.match_prefix(RadixKey(tokens_of(words))))
        self.cache.inc_lock_ref(m.last_node)
        self.locks.append(m.last_node)

    @rule()
    @precondition(lambda self: self.locks)
    def unlock(self):
        self.cache.dec_lock_ref(self.locks.pop())

    @rule()
    @precondition(lambda self: self.cache is not None and not self.locks)
    def reset(self):
        self.cache.reset()
        if self.store is None:
            self.inserted.clear()

    @rule()
    @precondition(lambda self: self.store is not None and not self.locks)
    def restart(self):
        """A new manager over the same storage: an empty tree that storage refills."""
        self.ctl.close(5.0)
        c = self.cache
        self.cache = make_cache(ps=c.page_size, device_tokens=POOL, host_tokens=c.host_capacity(),
                                write_policy=c.write_policy, events=c.kv_events is not None)
        self._attach()

    @invariant()
    def consistent(self):
        c = self.cache
        if c is None:
            return
        c.check_invariants()  # with events: the recorder's live blocks are exactly the tree's
        c.take_events()
        alloc = c.token_to_kv_pool_allocator
        assert alloc.available_size() + c.evictable_size() + c.protected_size() == POOL
        for node in c.iter_nodes():
            path, x = [], node
            while x.parent is not None:
                path.append(x)
                x = x.parent
            toks = np.concatenate([p.key for p in reversed(path)])
            if x.extra_key is None:
                assert tuple(toks.tolist()) in self.inserted

    def teardown(self):
        if self.ctl is not None:
            self.ctl.close(1.0)


TierMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestTierMachine = TierMachine.TestCase
