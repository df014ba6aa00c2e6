"""Belady's offline bound: next-use indices, optimality against exhaustive search on tiny
traces, dominance over every online policy, and the Mooncake README figures."""
from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_research import available_block_policies, make_block_policy
from policy_research.oracles import PopularityOracle, ReuseOracle
from trace_fixtures import bundled_trace

from radixkv.bench.belady import NEVER, belady, next_use
from radixkv.bench.blocksim import simulate
from radixkv.bench.traces import BlockTrace
from radixkv.bench.workloads import random_block_trace
from radixkv.errors import InvalidArgumentError


def _trace_path(name):
    return bundled_trace(name, shared_fallback=True)


HAVE_MOONCAKE = _trace_path("conversation") is not None and _trace_path("synthetic") is not None


def _requests(bt):
    return [[int(b) for b in r] for r in bt]


def brute_force_optimum(bt, cap, bypass):
    """Max hit tokens over every caching decision, by dynamic programming over cache
    contents: after each request the cache may hold any subset of (old contents + the
    request's blocks) within capacity; ``bypass=False`` forces the request's blocks in."""
    lens = {b: int(bt.block_len[b]) for b in range(bt.n_blocks)}
    states = {frozenset(): 0}
    for req in _requests(bt):
        nxt = {}
        for s, val in states.items():
            k = 0
            while k < len(req) and req[k] in s:
                k += 1
            gained = val + sum(lens[b] for b in req[:k])
            pool = sorted(s | set(req))
            must = set() if bypass else set(req)
            free = [b for b in pool if b not in must]
            base = sum(lens[b] for b in must)
            for r in range(len(free) + 1):
                for extra in combinations(free, r):
                    if base + sum(lens[b] for b in extra) <= cap:
                        key = frozenset(must) | frozenset(extra)
                        if nxt.get(key, -1) < gained:
                            nxt[key] = gained
        states = nxt
    return max(states.values())


def test_next_use_matches_a_scan():
    bt = random_block_trace(40, 12, seed=3)
    nu = next_use(bt)
    reqs = _requests(bt)
    pos = 0
    for t, req in enumerate(reqs):
        for b in req:
            later = [u for u in range(t + 1, len(reqs)) if b in reqs[u]]
            assert nu[pos] == (later[0] if later else NEVER)
            pos += 1


@settings(max_examples=40)
@given(seed=st.integers(0, 10_000), n_req=st.integers(1, 7), n_blk=st.integers(1, 6), cap=st.integers(1, 5))
def test_belady_equals_exhaustive_optimum_unit_blocks(seed, n_req, n_blk, cap):
    bt = random_block_trace(n_req, n_blk, seed=seed, block_size=1, partial=False)
    assert belady(bt, cap, bypass=True).hit_tokens == brute_force_optimum(bt, cap, bypass=True)
    if max(np.diff(bt.offsets)) <= cap:          # forced insertion needs every request to fit
        assert belady(bt, cap, bypass=False).hit_tokens == brute_force_optimum(bt, cap, bypass=False)


@settings(max_examples=30)
@given(seed=st.integers(0, 10_000), n_req=st.integers(1, 6), n_blk=st.integers(1, 6), cap=st.integers(1, 16))
def test_belady_never_exceeds_the_optimum_with_partial_blocks(seed, n_req, n_blk, cap):
    bt = random_block_trace(n_req, n_blk, seed=seed, block_size=4, partial=True)
    opt = brute_force_optimum(bt, cap, bypass=True)
    got = belady(bt, cap, bypass=True).hit_tokens
    assert got <= opt
    assert got >= 0


@settings(max_examples=25)
@given(seed=st.integers(0, 10_000), cap=st.integers(1, 40), zipf=st.sampled_from([0.0, 1.2]))
def test_belady_dominates_every_online_policy(seed, cap, zipf):
    bt = random_block_trace(120, 30, seed=seed, block_size=1, partial=False, zipf_a=zipf)
    bound = belady(bt, cap, bypass=True).hit_tokens
    forced = belady(bt, cap, bypass=False).hit_tokens
    assert forced <= bound
    for name in available_block_policies():
        online = simulate(bt, cap, make_block_policy(name)).hit_tokens
        assert online <= forced, name
    for oracle in (ReuseOracle, PopularityOracle):
        assert simulate(bt, cap, oracle(bt)).hit_tokens <= forced, oracle.name


def test_oracles_keep_the_simulator_contract():
    bt = random_block_trace(600, 120, seed=3, block_size=8, zipf_a=1.1)
    for oracle in (ReuseOracle, PopularityOracle):
        r = simulate(bt, 200, oracle(bt), check_every=17)
        assert r.policy == oracle.name and 0 < r.hit_tokens <= bt.infinite_hit_tokens()
        full = simulate(bt, bt.unique_tokens, oracle(bt))
        assert full.hit_tokens == bt.infinite_hit_tokens() and full.evicted_tokens == 0


def test_belady_accounting():
    bt = random_block_trace(300, 60, seed=5, block_size=8)
    r = belady(bt, 64)
    assert r.prompt_tokens == bt.prompt_tokens
    assert 0 <= r.hit_tokens <= bt.infinite_hit_tokens()
    big = belady(bt, bt.unique_tokens)
    assert big.hit_tokens == bt.infinite_hit_tokens() and big.evicted_tokens == 0
    assert belady(bt, 0).hit_tokens == 0
    with pytest.raises(InvalidArgumentError):
        belady(bt, -1)


def test_bypass_skips_blocks_never_reused():
    # request 0's blocks are never requested again: nothing is cached, nothing evicted
    bt = BlockTrace.from_chains([0, 1, 2, 3], [0, 2, 4], [4, 4, 4, 4], 4)
    r = belady(bt, 8)
    assert r.hit_tokens == 0 and r.bypassed_tokens == 16 and r.evicted_tokens == 0


@pytest.mark.skipif(not HAVE_MOONCAKE, reason="Mooncake traces not present")
@pytest.mark.parametrize("name,expected", [
    ("conversation", {0.01: 24.8, 0.05: 37.4, 0.10: 37.4}),
    ("synthetic", {0.01: 18.3, 0.05: 39.4, 0.10: 50.8}),
])
def test_readme_belady_figures(name, expected):
    from radixkv.bench.traces import load_mooncake

    bt = load_mooncake(_trace_path(name)).block_trace()
    for frac, pct in expected.items():
        got = belady(bt, int(frac * bt.unique_tokens)).token_hit_rate
        assert round(100 * got, 1) == pct, (frac, got)
