"""``aplru`` on the RadixCache: its key ordering, B = 0 is exactly LRU (a Hypothesis machine
against the LRU cache), the evicted leaf is always the minimum key (a machine against a
brute-force scan), ghost restoration and the direction of the B update, expiry and the
ghost bound, typed errors, and the generic model-based RadixCache machine with aplru."""
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from test_radix_state_machine import _variant, tree_content  # the generic model-based machine

from radixkv.bench.radix_engine import PAD_TOKEN, RadixReplayEngine
from radixkv.cache import RadixCache, RadixKey, available_policies, make_policy
from radixkv.cache.policies.aplru import AdaptiveProbationLRUPolicy
from radixkv.errors import InvalidArgumentError, InvariantError


def seq(first, n=4):
    return np.arange(first, first + n, dtype=np.int32)


def request(eng, tokens):
    """One request through the scheduler's cycle (the replay's semantics); returns the hit."""
    h = eng.match_prefix(tokens)
    short = (len(tokens) - h) - (eng.capacity - eng.used_tokens)
    if short > 0:
        eng.evict(short)
    eng.insert(tokens)
    return h


def eviction_order(eng):
    """Evict one node at a time; the first token of each evicted node, in order."""
    order = []
    cache = eng.cache
    while cache.evictable_size():
        before = {n.id: int(n.key[0]) for n in cache.iter_nodes()}
        assert cache.evict(1) >= 1
        after = {n.id for n in cache.iter_nodes()}
        order.extend(sorted(t for i, t in before.items() if i not in after))
        eng.check_invariants()
    return order


def aplru(cap=100, **kw):
    return AdaptiveProbationLRUPolicy(capacity_tokens=cap, **kw)


def test_registered_and_builds_without_capacity():
    assert "aplru" in available_policies()
    pol = make_policy("aplru")
    assert isinstance(pol, AdaptiveProbationLRUPolicy) and pol.capacity_tokens is None
    cache = RadixCache(None, None, eviction_policy="aplru")
    for i, t in enumerate((seq(0), seq(10), seq(0, 6))):
        cache.match_prefix(RadixKey(t))
        cache.insert(RadixKey(t), np.arange(1, len(t) + 1) + 100 * i)
    cache.check_invariants()
    assert cache.policy.capacity == 10           # the high-water mark of cached tokens (4 + 4 + 2)
    assert cache.evict(100) == 10 and cache.total_size() == 0
    cache.check_invariants()


@pytest.mark.parametrize("b0, expected", [
    (0.0, [10, 20, 0, 30]),     # no bonus: LRU
    (0.03, [10, 20, 0, 30]),    # A's key 12 + 3 = 15 < D's 16
    (0.05, [10, 20, 30, 0]),    # A's key 12 + 5 = 17 > D's 16
    (10.0, [10, 20, 30, 0]),    # reused nodes after every unreused one
])
def test_key_is_last_touch_vclock_plus_bonus_for_reused_nodes(b0, expected):
    eng = RadixReplayEngine(100, aplru(100, b0=b0, gain=0.0), page_size=1)
    for first in (0, 10, 20):
        request(eng, seq(first))                 # vclock 4, 8, 12
    assert request(eng, seq(0)) == 4             # A reused: f = 2, key = 12 + B
    request(eng, seq(30))                        # D: vclock 16, key 16
    pol = eng.policy
    keys = {int(n.key[0]): n.pstate[0] for n in eng.cache.iter_nodes()}
    assert keys == {0: 12 + 100 * b0, 10: 8, 20: 12, 30: 16}
    assert {int(n.key[0]): n.pstate[1] for n in eng.cache.iter_nodes()} == {0: 2, 10: 1, 20: 1, 30: 1}
    assert pol.vclock == 16 and pol.bonus == pytest.approx(100 * b0)
    assert eviction_order(eng) == expected


def test_a_key_that_drops_is_refiled_at_once():
    """B falls while a reused leaf waits: its next hit lowers its key below the one it was
    filed under, so the cache must re-file it at once (``monotonic = False``; with lazy
    re-keying A would be evicted last)."""
    pol = aplru(100, b0=0.5, gain=10.0)                       # B = 50
    eng = RadixReplayEngine(100, pol, page_size=1)
    cache = eng.cache
    request(eng, seq(0))
    request(eng, seq(0))                                      # A: f = 2, key 4 + 50
    request(eng, seq(20))
    request(eng, seq(40))
    a = cache.match_prefix(RadixKey(seq(0))).last_node        # (a hit: key 12 + 50)
    cache.inc_lock_ref(a)
    assert cache.evict(100) == 8                              # the two unreused leaves go
    request(eng, seq(40))                                     # class-0 ghost hit: B 50 -> 10
    assert pol.B == pytest.approx(10.0)                       # (X is back with f = 2: key 16 + 10)
    cache.dec_lock_ref(a)
    request(eng, seq(60))                                     # vclock 20
    # a bare match (no lock / unlock around it, which would re-file A anyway)
    assert cache.match_prefix(RadixKey(seq(0))).prefix_len == 4   # A's key: 20 + 10 = 30 < 62
    for first in (80, 100, 120, 140):                         # keys 24, 28, 32, 36
        request(eng, seq(first))
    assert eviction_order(eng) == [60, 80, 40, 100, 0, 120, 140]


def test_split_copies_state_and_offsets_follow():
    eng = RadixReplayEngine(100, aplru(), page_size=2)
    request(eng, seq(0, 8))
    request(eng, np.array([0, 1, 2, 3, 50, 51], np.int32))     # splits [0..8) at 4
    by_first = {int(n.key[0]): n.pstate for n in eng.cache.iter_nodes()}
    assert by_first[0][2] == 0 and by_first[4][2] == 4 and by_first[50][2] == 4
    assert by_first[0][1] == 2 and by_first[4][1] == 1        # the hit counted on the parent only
    eng.check_invariants()


class TestGhost:
    def test_reused_node_comes_back_with_f_and_raises_b(self):
        pol = aplru(100, b0=0.25, gain=1.0)
        eng = RadixReplayEngine(100, pol, page_size=1)
        request(eng, seq(0, 10))
        request(eng, seq(0, 10))                       # f = 2: class 1
        assert eng.cache.evict(1) == 10                # A leaves: ghost (class 1, f 2)
        assert pol.ghost_tokens == [0, 10] and pol.ghost_size() == 1
        b = pol.B
        assert request(eng, seq(0, 10)) == 0           # a miss a longer stay would have saved
        (node,) = eng.cache.iter_nodes()
        assert node.pstate[1] == 3 and pol.ghost_hits == 1 and pol.ghost_size() == 0
        # B += lost x max(1, g0 / g1) with g0 = max(0, 1) = 1, g1 = 10
        assert pol.B == pytest.approx(b + 10)
        eng.check_invariants()

    def test_unreused_node_comes_back_and_lowers_b(self):
        pol = aplru(100, b0=0.25, gain=1.0)
        eng = RadixReplayEngine(100, pol, page_size=1)
        request(eng, seq(0, 10))
        request(eng, seq(50, 5))
        request(eng, seq(50, 5))                       # a class-1 eviction to weigh against
        assert eng.cache.evict(1) == 10 and eng.cache.evict(1) == 5
        assert pol.ghost_tokens == [10, 5]
        b = pol.B
        request(eng, seq(0, 10))
        (node,) = eng.cache.iter_nodes()
        assert node.pstate[1] == 2
        assert pol.B == pytest.approx(b - 10 * max(1.0, 5 / 10))
        eng.check_invariants()

    def test_b_stays_within_bounds(self):
        pol = aplru(20, b0=0.25, gain=100.0, b_max=2.0)
        eng = RadixReplayEngine(20, pol, page_size=1)
        for _ in range(3):
            request(eng, seq(0, 10))
            request(eng, seq(0, 10))
            eng.cache.evict(100)
        assert pol.B == 40.0                           # clamped at b_max x capacity
        for i in range(3):                             # unreused nodes coming back
            request(eng, seq(100 + 10 * i, 10))
            eng.cache.evict(100)
            request(eng, seq(100 + 10 * i, 10))
            eng.cache.evict(100)
        assert pol.B == 0.0
        eng.check_invariants()

    def test_entries_expire_after_the_window(self):
        pol = aplru(10, window=2.0)
        eng = RadixReplayEngine(10, pol, page_size=1)
        request(eng, seq(0, 4))
        eng.cache.evict(4)
        for i in range(6):                             # 24 tokens > 2 x 10 inserted since
            request(eng, seq(100 + 10 * i, 4))
        request(eng, seq(0, 4))
        node = eng.cache.match_prefix(RadixKey(seq(0, 4))).last_node
        assert node.pstate[1] == 2                     # f = 1 at insert, +1 for this match
        assert pol.ghost_hits == 0 and pol.ghost_tokens[0] <= 20
        eng.check_invariants()

    def test_ghost_is_bounded_and_keyed_by_namespace(self):
        pol = aplru(1000, max_ghost_entries=3)
        cache = RadixCache(None, None, eviction_policy=pol)
        for i in range(6):
            cache.insert(RadixKey(seq(10 * i)), np.arange(1, 5) + 10 * i)
        cache.insert(RadixKey(seq(0), "tenant"), np.arange(100, 104))
        cache.evict(1000)
        assert pol.ghost_size() == 3
        cache.insert(RadixKey(seq(0)), np.arange(1, 5))          # evicted from the ghost already
        (node,) = [n for n in cache.iter_nodes()]
        assert node.pstate[1] == 1
        cache.check_invariants()

    def test_zero_ghost_entries_keeps_no_history(self):
        pol = aplru(100, max_ghost_entries=0)
        cache = RadixCache(None, None, eviction_policy=pol)
        cache.insert(RadixKey(seq(0)), np.arange(1, 5))
        cache.evict(4)
        cache.insert(RadixKey(seq(0)), np.arange(1, 5))
        assert pol.ghost_size() == 0 and next(cache.iter_nodes()).pstate[1] == 1
        cache.check_invariants()


def test_reset_forgets_everything():
    pol = aplru(100)
    eng = RadixReplayEngine(100, pol, page_size=1)
    request(eng, seq(0))
    eng.cache.evict(4)
    eng.cache.reset()
    assert pol.vclock == 0 and pol.ghost_size() == 0 and pol.ghost_tokens == [0, 0]
    eng.check_invariants()


@pytest.mark.parametrize("kw", [
    {"capacity_tokens": 0}, {"capacity_tokens": True}, {"window": 0}, {"gain": -1},
    {"b0": -0.1}, {"b0": 2.0, "b_max": 1.0}, {"max_ghost_entries": -1},
])
def test_bad_parameters_raise(kw):
    with pytest.raises(InvalidArgumentError):
        AdaptiveProbationLRUPolicy(**kw)


def test_check_invariants_names_the_bad_node():
    eng = RadixReplayEngine(100, aplru(), page_size=1)
    request(eng, seq(0, 8))
    request(eng, np.array([0, 1, 2, 3, 9], np.int32))
    child = next(n for n in eng.cache.iter_nodes() if int(n.key[0]) == 4)
    child.pstate[2] = 7                               # wrong offset
    with pytest.raises(InvariantError, match=f"#?{child.id}"):
        eng.check_invariants()
    child.pstate[2] = 4
    child.pstate[1] = 0                               # f below 1
    with pytest.raises(InvariantError, match="valid state"):
        eng.check_invariants()
    child.pstate[1] = 1
    eng.policy._tokens += 1                           # token count off
    with pytest.raises(InvariantError, match="cached tokens"):
        eng.check_invariants()


# ---------------------------------------------------------------------- state machines
TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=9)


class ZeroBonusIsLRU(RuleBasedStateMachine):
    """aplru with B = 0 (and no adaptation) and LRU, driven by the same requests, hold the
    same tree (same nodes, rows, locks) after every step."""

    @initialize(page=st.sampled_from([1, 2]), cap=st.integers(2, 24))
    def setup(self, page, cap):
        self.lru = RadixReplayEngine(cap, "lru", page_size=page)
        self.apl = RadixReplayEngine(cap, aplru(cap, b0=0.0, gain=0.0), page_size=page)

    @rule(tokens=TOKENS)
    def req(self, tokens):
        t = np.asarray(tokens, np.int32)
        assert request(self.lru, t) == request(self.apl, t)

    @rule(k=st.integers(1, 8))
    def evict(self, k):
        assert self.lru.evict(k) == self.apl.evict(k)

    @invariant()
    def same_tree(self):
        if hasattr(self, "lru"):
            self.lru.check_invariants()
            self.apl.check_invariants()
            assert self.lru.cache.pretty_print(64) == self.apl.cache.pretty_print(64)


TestZeroBonusIsLRU = ZeroBonusIsLRU.TestCase
TestZeroBonusIsLRU.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


class MinKeyVictim(RuleBasedStateMachine):
    """Adaptive aplru on a small pool: every single eviction removes the unlocked leaf
    with the smallest sort key (a brute-force scan of the tree), every hit is the longest
    cached page-aligned prefix of the padded prompt (a brute-force prefix set), and the
    cache, pool and policy audits pass."""

    @initialize(page=st.sampled_from([1, 2]), cap=st.integers(4, 24), b0=st.sampled_from([0.0, 0.25, 2.0]))
    def setup(self, page, cap, b0):
        self.eng = RadixReplayEngine(cap, aplru(cap, b0=b0, window=1.0, gain=1.0), page_size=page)
        self.page = page

    @rule(tokens=TOKENS)
    def req(self, tokens):
        t = np.asarray(tokens, np.int32)
        model = tree_content(self.eng.cache)            # {(ns, cached page-aligned prefix): rows}
        padded = list(tokens) + [PAD_TOKEN] * (-len(tokens) % self.page)
        n = 0
        while n < len(padded) and (None, tuple(padded[:n + self.page])) in model:
            n += self.page
        assert request(self.eng, t) == min(n, len(t))

    @rule()
    def evict_one(self):
        cache = self.eng.cache
        leaves = [n for n in cache.iter_nodes() if not n.children and n.lock_ref == 0]
        if not leaves:
            assert cache.evict(1) == 0
            return
        want = min(leaves, key=cache.policy.sort_key)
        ids_before = {n.id for n in cache.iter_nodes()}
        cache.evict(1)
        gone = ids_before - {n.id for n in cache.iter_nodes()}
        assert gone == {want.id}

    @invariant()
    def audits(self):
        if hasattr(self, "eng"):
            self.eng.check_invariants()


TestMinKeyVictim = MinKeyVictim.TestCase
TestMinKeyVictim.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)

# The generic model-based RadixCache machine (content, rows, locks, typed errors) with aplru.
TestRadixAPLRU = _variant("APLRUMachine", policy="aplru", events=True)
TestRadixPagedAPLRU = _variant("PagedAPLRUMachine", page_size=2, policy="aplru")
