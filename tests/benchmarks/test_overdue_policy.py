"""The ``odlru`` research candidate: its bonus expires exactly when the block is overdue (lazy
re-keying), an infinite deadline is exactly ``aplru``, and its own invariant check."""
import numpy as np
import pytest
from policy_research import AdaptiveProbationLRU
from policy_research.overdue_policy import OverdueAPLRU

from radixkv.bench.blocksim import BlockSim, simulate
from radixkv.bench.workloads import random_block_trace
from radixkv.errors import InvariantError

A, S1, S0, D, S2, N1, N2, N3 = range(8)


def _evictions(overdue):
    """Single-block requests of one token each into a 5-token cache, B fixed at 1000:
    A (t=1), S1, S0, A again (reused: gap 2, bonus until t = 3 + overdue * 2), D, S2, then
    N1..N3 each evict one block. Returns the blocks evicted, in order."""
    pol = OverdueAPLRU(overdue=overdue, inherit=False, gain=0.0, b0=200.0)
    sim = BlockSim(np.ones(8, np.int64), np.full(8, -1, np.int32), 5, pol)
    order = []
    for b in (A, S1, S0, A, D, S2, N1, N2, N3):
        before = sim.cached.copy()
        sim.access(np.array([b]))
        order += [int(x) for x in np.flatnonzero(before & ~sim.cached)]
        sim.check_invariants()
    return order


def test_bonus_expires_when_overdue():
    assert _evictions(1.0) == [S1, S0, A]          # deadline t=5 passed: A is plain LRU (t=3)
    assert _evictions(10.0) == [S1, S0, D]         # still within 3 + 20: A keeps its bonus
    assert _evictions(float("inf")) == [S1, S0, D]


@pytest.mark.parametrize("seed", [0, 1])
def test_infinite_deadline_is_aplru(seed):
    bt = random_block_trace(n_requests=300, n_blocks=150, seed=seed, zipf_a=1.0)
    differ = 0
    for cap in (bt.unique_tokens // 20, bt.unique_tokens // 5):
        a = simulate(bt, cap, AdaptiveProbationLRU())
        o = simulate(bt, cap, OverdueAPLRU(overdue=float("inf"), inherit=False), check_every=50)
        assert (a.hit_tokens, a.evicted_tokens) == (o.hit_tokens, o.evicted_tokens)
        short = simulate(bt, cap, OverdueAPLRU(overdue=0.5), check_every=50)
        assert 0 <= short.hit_tokens <= bt.infinite_hit_tokens()
        differ += short.hit_tokens != a.hit_tokens
    assert differ                                   # a short deadline does change the evictions


def test_invariant_names_a_stray_deadline():
    pol = OverdueAPLRU()
    sim = BlockSim(np.ones(3, np.int64), np.full(3, -1, np.int32), 3, pol)
    sim.access(np.array([0]))
    sim.check_invariants()
    pol.dstamp[2] = 7                               # a deadline for a block never filed
    with pytest.raises(InvariantError, match="2"):
        sim.check_invariants()
