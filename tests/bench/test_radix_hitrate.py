"""The RadixCache replay engine (``--engine radix``): the block simulator's semantics
(infinite capacity exact, single-page requests give LRU to the token, a request larger
than the pool keeps its head), the padding of partial pages with virtual rows, the
pool/tree conservation audit under seeded stress for several policies, typed errors that
leave everything unchanged, and the Mooncake infinite-capacity figures."""

import numpy as np
import pytest
import torch
from trace_fixtures import bundled_trace

from radixkv.bench.blocksim import simulate
from radixkv.bench.hitrate import ENGINES, BlockSimAdapter, load_source, replay
from radixkv.bench.radix_engine import (
    PAD_TOKEN,
    PaddedPoolAllocator,
    RadixReplayEngine,
    default_policy_name,
    make_radix_policy,
)
from radixkv.bench.workloads import make_workload, random_block_trace
from radixkv.cache import RadixCache
from radixkv.cache.policies.aplru import AdaptiveProbationLRUPolicy
from radixkv.errors import (
    CapacityError,
    DoubleFreeError,
    InvalidArgumentError,
    InvariantError,
)


def chains_as_tokens(bt):
    """A block trace as pseudo-token prompts (block b -> b*bs .. b*bs + len - 1)."""
    bs = bt.block_size
    out = []
    for ids in bt:
        lens = bt.block_len[ids]
        toks = np.concatenate([b * bs + np.arange(n) for b, n in zip(ids.tolist(), lens.tolist())])
        out.append(toks.astype(np.int32))
    return out


def drive(eng, prompts, check=False):
    """The replay loop, auditing the engine between requests when ``check``; returns
    (hit tokens, prompt tokens, slots evicted)."""
    total = hit = evicted = 0
    for t in prompts:
        h = eng.match_prefix(t)
        short = (len(t) - h) - (eng.capacity - eng.used_tokens)
        if short > 0:
            evicted += eng.evict(short)
        eng.insert(t)
        assert eng.used_tokens <= eng.capacity
        total += len(t)
        hit += h
        if check:
            eng.check_invariants()
    return hit, total, evicted


def test_registered_as_radix_engine():
    eng = ENGINES["radix"](64, "lru", 4)
    assert isinstance(eng, RadixReplayEngine) and eng.capacity == 64 and eng.page_size == 4


def test_default_policy_is_the_radix_cache_default():
    import inspect

    assert default_policy_name() == inspect.signature(RadixCache).parameters["eviction_policy"].default
    assert type(make_radix_policy("default", 10)).name == default_policy_name()
    pol = make_radix_policy("APLRU", 1234)
    assert isinstance(pol, AdaptiveProbationLRUPolicy) and pol.capacity_tokens == 1234
    with pytest.raises(InvalidArgumentError, match="known"):
        make_radix_policy("nope", 10)


@pytest.mark.parametrize("page", [1, 4, 16])
def test_infinite_capacity_equals_the_simulator_exactly(page):
    bt = random_block_trace(400, 120, seed=3, block_size=16, partial=True, zipf_a=1.1)
    prompts = chains_as_tokens(bt)
    src_bt = bt.rechunk(page)
    eng = RadixReplayEngine(bt.unique_tokens, "lru", page)
    hit, total, _ = drive(eng, prompts)
    assert total == bt.prompt_tokens
    assert hit == bt.infinite_hit_tokens() == simulate(src_bt, bt.unique_tokens, "lru").hit_tokens
    eng.check_invariants()
    assert eng.used_tokens == bt.unique_tokens          # padding never takes pool slots


def test_single_page_requests_give_lru_to_the_token():
    """Every prompt is one page: tree nodes are blocks, so whole-node eviction is block
    eviction and the tree must reproduce the simulator's LRU exactly."""
    rng = np.random.default_rng(0)
    prompts = [np.arange(8 * k, 8 * k + int(rng.integers(1, 9)), dtype=np.int32)
               for k in rng.zipf(1.3, 3000) % 200]
    for cap in (8, 64, 300):
        eng = RadixReplayEngine(cap, "lru", 8)
        hit, _, _ = drive(eng, prompts)
        ref = replay(iter(prompts), BlockSimAdapter(cap, "lru", 8))
        assert hit == ref.hit_tokens
        eng.check_invariants()


def test_request_larger_than_the_pool_keeps_its_head():
    eng = RadixReplayEngine(10, "lru", 4)
    t = np.arange(14, dtype=np.int32)
    assert eng.match_prefix(t) == 0
    assert eng.insert(t) == 8                           # two whole pages fit, the third does not
    assert eng.used_tokens == 8
    assert eng.match_prefix(t) == 8
    eng.evict(0)
    assert eng.insert(t) == 0                           # 2 free slots: no page fits
    eng.check_invariants()


def test_partial_last_page_is_padded_and_matched_whole():
    eng = RadixReplayEngine(100, "lru", 4)
    a = np.arange(6, dtype=np.int32)                    # pages [0..3] [4, 5, PAD, PAD]
    drive(eng, [a])
    assert eng.used_tokens == 6 and eng.alloc.pad_rows_live == 2
    assert eng.cache.total_size() == 8
    assert eng.match_prefix(a) == 6                     # the whole prompt, never the padding
    eng.insert(a)
    longer = np.arange(7, dtype=np.int32)               # [4, 5, 6, PAD] differs from [4, 5, PAD, PAD]
    assert eng.match_prefix(longer) == 4
    eng.insert(longer)
    tail = next(n for n in eng.cache.iter_nodes() if int(n.key[0]) == 4 and int(n.key[2]) == 6)
    assert tail.key.tolist() == [4, 5, 6, PAD_TOKEN]
    eng.check_invariants()
    assert eng.evict(100) == 9 and eng.used_tokens == 0     # real slots: 6 + 3 and eng.alloc.pad_rows_live == 0
    eng.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "aplru", "slru", "lfu", "fifo", "priority", "default"])
def test_seeded_stress_conserves_pool_rows(policy):
    wl = make_workload("multi-turn", n_requests=150, seed=4)
    for cap, page in ((wl.unique_tokens // 20, 1), (wl.unique_tokens // 8, 16)):
        eng = RadixReplayEngine(cap, policy, page)
        hit, total, evicted = drive(eng, wl.requests, check=True)
        assert 0 <= hit <= total and evicted > 0


def test_duplicates_cached_meanwhile_are_freed():
    eng = RadixReplayEngine(100, "lru", 2)
    t = np.arange(10, dtype=np.int32)
    assert eng.match_prefix(t) == 0
    rows = eng.alloc.alloc(6)                           # another request caches t[:6] meanwhile
    eng.cache.insert(t[:6], rows)
    before = eng.alloc.available_size()
    assert eng.insert(t) == 10                          # allocates 10, 6 of them duplicates
    assert eng.alloc.available_size() == before - 4
    eng.check_invariants()


class TestErrorsLeaveStateUnchanged:
    def snapshot(self, eng):
        return eng.cache.pretty_print(), eng.alloc.available_size(), eng.alloc.pad_rows_live

    def test_protocol_misuse(self):
        eng = RadixReplayEngine(50, "lru", 2)
        drive(eng, [np.arange(5, dtype=np.int32)])
        before = self.snapshot(eng)
        with pytest.raises(InvalidArgumentError):
            eng.insert(np.arange(5, dtype=np.int32))          # no match pending
        for bad in (np.arange(5, dtype=np.int64), np.zeros((2, 2), np.int32), [1, 2, 3]):
            with pytest.raises(InvalidArgumentError):
                eng.match_prefix(bad)
        assert self.snapshot(eng) == before
        t = np.arange(5, dtype=np.int32)
        eng.match_prefix(t)
        locked = self.snapshot(eng)
        with pytest.raises(InvalidArgumentError):
            eng.match_prefix(t)                               # match pending
        with pytest.raises(InvalidArgumentError):
            eng.insert(t.copy())                              # not the matched array
        assert self.snapshot(eng) == locked
        with pytest.raises(InvariantError, match="pending"):
            eng.check_invariants()
        eng.insert(t)
        eng.check_invariants()

    def test_constructor(self):
        for kw in ({"capacity_tokens": -1}, {"capacity_tokens": 10, "page_size": 0},
                   {"capacity_tokens": 10, "policy": "nope"}):
            with pytest.raises(InvalidArgumentError):
                RadixReplayEngine(**kw)


class TestPaddedPoolAllocator:
    def test_virtual_rows_are_dropped_and_counted(self):
        a = PaddedPoolAllocator(8)
        real = a.alloc(3)
        pads = a.pad_rows(2)
        assert (pads > a.size).all() and a.pad_rows_live == 2
        assert not a.is_free(torch.from_numpy(np.concatenate([real.numpy(), pads]))).any()
        a.free(torch.cat([real, torch.from_numpy(pads)]))
        assert a.available_size() == 8 and a.pad_rows_live == 0
        a.check_invariants()

    def test_bad_real_free_raises_and_keeps_the_count(self):
        a = PaddedPoolAllocator(8)
        real = a.alloc(2)
        pads = a.pad_rows(3)
        a.free(real)
        with pytest.raises(DoubleFreeError):
            a.free(torch.cat([real, torch.from_numpy(pads)]))
        assert a.pad_rows_live == 3 and a.available_size() == 8

    def test_exhausted_virtual_ids(self):
        a = PaddedPoolAllocator(8)
        a._next_pad = (1 << 31) - 2
        with pytest.raises(CapacityError):
            a.pad_rows(3)
        assert a.pad_rows_live == 0


def test_engine_audit_catches_a_leaked_slot():
    eng = RadixReplayEngine(20, "lru", 1)
    drive(eng, [np.arange(5, dtype=np.int32)])
    eng.alloc.alloc(1)                                   # a slot nobody holds
    with pytest.raises(InvariantError, match="leaked"):
        eng.check_invariants()


@pytest.mark.skipif(bundled_trace("conversation") is None or bundled_trace("synthetic") is None,
                    reason="bundled Mooncake traces absent")
@pytest.mark.parametrize("name, pct", [("conversation", 37.36), ("synthetic", 65.12)])
def test_mooncake_infinite_capacity_matches(name, pct):
    src = load_source(trace=name, page_size=512)
    r = replay(src.tokens(), RadixReplayEngine(src.unique_tokens, "lru", 512))
    assert r.hit_tokens == src.blocks.infinite_hit_tokens()
    assert round(100 * r.token_hit_rate, 2) == pct


@pytest.mark.skipif(bundled_trace("conversation") is None, reason="bundled Mooncake trace absent")
def test_mooncake_prefix_lru_close_to_the_simulator():
    src = load_source(trace="conversation", page_size=512, limit=1500)
    cap = int(0.05 * src.unique_tokens)
    radix = replay(src.tokens(), RadixReplayEngine(cap, "lru", 512)).token_hit_rate
    sim = simulate(src.blocks, cap, "lru").token_hit_rate
    assert abs(radix - sim) < 0.02
