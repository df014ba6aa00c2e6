"""Hybrid state events end to end, in-process: real hybrid ``CacheEngine`` managers (KDA +
full attention) record ``StateStored`` / ``StateRemoved`` in their tree's one event queue, and
a :class:`~radixkv.bench.state_router.StateAwareIndex` fed with those streams scores each
manager exactly as that manager's own hybrid ``match`` (``prefix_len``, which stops at the
deepest state), while the plain KV index keeps crediting the longer KV prefix
(``kv_prefix_len``) after mamba evictions. Also: the cache-level hooks (order, reset, audit,
events off), and a Hypothesis state machine over two managers with state and KV evictions,
flushes and lost events, the engines being the model."""
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixkv.bench.state_router import StateAwareIndex, StateAwareScore
from radixkv.cache.block_hash import block_hashes
from radixkv.cache.hybrid.state_events import StateRemoved, StateStored
from radixkv.cache.hybrid.state_table import StateTable
from radixkv.engine import CacheEngine, EngineConfig, ExtendItem, MatchQuery
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.events.sources import drain_events

PS = 2


def hybrid_engine(events=True, kv_tokens=256, state_slots=12):
    cfg = EngineConfig(layer_types="FKF", page_size=PS, kv_tokens=kv_tokens, head_num=1, head_dim=4,
                       kda_num_heads=1, kda_head_dim=4, state_slots=state_slots, request_rows=8,
                       max_context_len=128, enable_kv_events=events)
    eng = CacheEngine(cfg)
    return eng, eng.attach("w").session


def serve(eng, session, rid, tokens):
    """One request: prefill ``tokens`` (the worker runs the forward), then cache it."""
    eng.alloc_extend(session, [ExtendItem(rid, np.asarray(tokens, dtype=np.int32))])
    eng.cache_finished(session, [rid])


def truth(eng, session, q):
    m = eng.match(session, [MatchQuery(np.asarray(q, dtype=np.int32))])[0]
    return StateAwareScore(m.kv_prefix_len // PS, m.prefix_len // PS)


def test_cache_records_state_events_in_order_with_the_kv_events():
    eng, s = hybrid_engine()
    a = np.arange(1, 9, dtype=np.int32)  # 4 pages
    serve(eng, s, "a", a)
    serve(eng, s, "b", a[:4])  # splits a's node: the state of b sits at position 4
    ev = eng.drain_events()
    chain = block_hashes(a, PS)
    assert [type(e).__name__ for e in ev] == ["BlockStored", "StateStored", "StateStored"]
    assert (ev[1].block_hash, ev[1].position) == (chain[3], 8)
    assert (ev[2].block_hash, ev[2].position) == (chain[1], 4)
    assert eng.tree.kv_events.live_states() == {chain[3]: 8, chain[1]: 4}
    assert eng.evict(s, 0, 1).states == 1  # LRU: a's state goes, a's KV stays (tombstone)
    assert eng.drain_events() == [StateRemoved((chain[3],), "GPU")]
    eng.evict(s, 100)  # full eviction: each node's state goes before its blocks
    kinds = [(type(e).__name__, e.block_hashes) for e in eng.drain_events()]
    assert kinds[0] == ("BlockRemoved", tuple(chain[2:]))  # the tombstone leaf: no state left
    i = kinds.index(("StateRemoved", (chain[1],)))
    assert ("BlockRemoved", (chain[1],)) == kinds[i + 1]  # the state, then its node's blocks
    assert sorted(h for k, hs in kinds if k == "BlockRemoved" for h in hs) == sorted(chain)
    serve(eng, s, "c", a)
    eng.drain_events()
    assert eng.flush(s)
    ev = eng.drain_events()  # reset: every state named, then the clear
    assert [type(e).__name__ for e in ev] == ["StateRemoved", "AllBlocksCleared"]
    assert ev[0].block_hashes == (chain[3],)
    eng.check_invariants()
    assert eng.pending_events() == 0 and drain_events(eng) == []


def test_events_off_means_no_recorder_and_no_event_work():
    eng, s = hybrid_engine(events=False)
    serve(eng, s, "a", np.arange(8))
    eng.evict(s, 0, 1)
    assert eng.tree.kv_events is None and type(eng.tree._states) is StateTable  # no event hooks at all
    assert not eng.events_enabled and eng.pending_events() == 0 and eng.drain_events() == []
    assert eng.take_events(s) == []


def test_audit_names_the_blocks_where_recorder_and_tree_disagree():
    eng, s = hybrid_engine()
    serve(eng, s, "a", np.arange(8))
    rec = eng.tree.kv_events
    h = next(iter(rec.live_states()))
    rec._states["GPU"][h] = 6  # the recorder believes another position
    with pytest.raises(InvariantError, match=str(h)):
        eng.check_invariants()
    rec._states["GPU"][h] = 8
    eng.check_invariants()


def test_state_aware_score_equals_match_after_mamba_evictions_while_kv_index_overcredits():
    engines = [hybrid_engine() for _ in range(2)]
    index = StateAwareIndex(PS, index="python")
    base = np.arange(10, 26, dtype=np.int32)  # 8 pages
    for _w, (eng, s) in enumerate(engines):
        serve(eng, s, "p", base[:8])
        serve(eng, s, "q", base)
        serve(eng, s, "r", np.concatenate([base[:4], [99, 98]]))
    e0, s0 = engines[0]
    assert e0.evict(s0, 0, 10).states == 3  # manager 0: every state gone, its KV stays
    index.apply_all(0, e0.drain_events())  # objects
    e1, s1 = engines[1]
    index.apply_all(1, e1.take_events(s1))  # to_dict() dicts
    index.check_invariants()
    sc = index.scores(base)
    assert sc == {0: truth(e0, s0, base), 1: truth(e1, s1, base)}
    assert sc[0] == StateAwareScore(8, 0) and sc[1] == StateAwareScore(8, 8)
    assert index.kv_index.scores(index_hashes(base)) == {0: 8, 1: 8}  # a plain KV router: a tie
    assert index.best(base) == 1
    # a prefix whose state manager 1 still holds mid-path; manager 0 has only KV
    q = np.concatenate([base[:12], [7, 7, 7]])
    assert index.scores(q) == {0: truth(e0, s0, q), 1: truth(e1, s1, q)} == {
        0: StateAwareScore(6, 0), 1: StateAwareScore(6, 4)}
    index.remove_worker(1)
    assert index.best(q) is None and set(index.scores(q)) == {0}


def index_hashes(tokens):
    from radixkv.events.dynamo import tokens_hashes

    return tokens_hashes(tokens, PS)


def test_lost_events_drop_the_manager_until_its_next_clear():
    eng, s = hybrid_engine()
    index = StateAwareIndex(PS, index="python")
    toks = np.arange(8)
    serve(eng, s, "a", toks)
    index.apply_all(3, eng.drain_events())
    assert index.scores(toks)[3] == StateAwareScore(4, 4)
    index.apply(3, {"type": "EventsLost", "first_seq": 9, "count": 4})
    assert index.desynced(3) and index.scores(toks) == {} and index.workers() == []
    serve(eng, s, "b", np.arange(20, 24))
    index.apply_all(3, eng.drain_events())  # ignored: the mirror is incomplete
    assert index.scores(np.arange(20, 24)) == {}
    index.check_invariants()
    assert eng.flush(s)
    serve(eng, s, "c", toks)
    index.apply_all(3, eng.drain_events())  # the clear resynchronizes
    assert not index.desynced(3) and index.scores(toks)[3] == truth(eng, s, toks)
    index.check_invariants()


def test_bad_input_is_refused_with_typed_errors():
    with pytest.raises(InvalidArgumentError):
        StateAwareIndex(0)
    with pytest.raises(InvalidArgumentError):
        StateAwareIndex(PS, index=object())
    index = StateAwareIndex(PS, index="python")
    for w in (-1, True, 2 ** 64, "w"):
        with pytest.raises(InvalidArgumentError):
            index.apply(w, StateRemoved((1,)))
    with pytest.raises(InvalidArgumentError):
        index.apply(0, {"type": "Nope"})
    with pytest.raises(InvalidArgumentError):
        index.scores(np.zeros((2, 2), dtype=np.int32))
    assert index.scores(np.arange(1)) == {}  # no full page


class TwoManagers(RuleBasedStateMachine):
    """Two hybrid managers under random requests, evictions (KV and states), flushes and lost
    events; after every step the index's score of random queries equals each manager's own
    ``match`` (state-aware and KV), except for a manager that lost events (not scored)."""

    @initialize()
    def setup(self):
        self.engines = [hybrid_engine(kv_tokens=96, state_slots=6) for _ in range(2)]
        self.index = StateAwareIndex(PS, index="python")
        self.prefixes = [np.arange(k * 40, k * 40 + 24, dtype=np.int32) for k in range(3)]
        self.lost = set()
        self.n = 0

    def feed(self):
        for w, (eng, s) in enumerate(self.engines):
            evs = eng.drain_events() if w == 0 else eng.take_events(s)
            self.index.apply_all(w, evs)
            if any((e["type"] if isinstance(e, dict) else type(e).__name__) == "AllBlocksCleared" for e in evs):
                self.lost.discard(w)

    def tokens(self, p, pages, tail):
        return np.concatenate([self.prefixes[p][:pages * PS], np.arange(200, 200 + tail, dtype=np.int32)])

    @rule(w=st.integers(0, 1), p=st.integers(0, 2), pages=st.integers(1, 12), tail=st.integers(0, 5))
    def request(self, w, p, pages, tail):
        eng, s = self.engines[w]
        self.n += 1
        serve(eng, s, f"r{self.n}", self.tokens(p, pages, tail))
        self.feed()

    @rule(w=st.integers(0, 1), k=st.integers(1, 4))
    def evict_states(self, w, k):
        eng, s = self.engines[w]
        eng.evict(s, 0, k)
        self.feed()

    @rule(w=st.integers(0, 1), n=st.integers(1, 30))
    def evict_tokens(self, w, n):
        eng, s = self.engines[w]
        eng.evict(s, n)
        self.feed()

    @rule(w=st.integers(0, 1))
    def flush(self, w):
        eng, s = self.engines[w]
        assert eng.flush(s)
        self.feed()

    @rule(w=st.integers(0, 1))
    def lose_events(self, w):
        self.feed()
        self.index.apply(w, {"type": "EventsLost", "first_seq": 0, "count": 1})
        self.lost.add(w)

    @invariant()
    def scores_match_the_managers(self):
        if not hasattr(self, "index"):
            return
        self.index.check_invariants()
        for eng, _ in self.engines:
            eng.check_invariants()
        for p in range(3):
            for pages, tail in ((12, 0), (7, 1), (3, 0)):
                q = self.tokens(p, pages, tail)
                got = self.index.scores(q)
                for w, (eng, s) in enumerate(self.engines):
                    if w in self.lost:
                        assert w not in got
                        continue
                    want = truth(eng, s, q)
                    assert got.get(w, StateAwareScore(0, 0)) == want, (w, q.tolist())


TestTwoManagers = TwoManagers.TestCase
TestTwoManagers.settings = settings(max_examples=25, stateful_step_count=20, deadline=None)


def test_seeded_stress_states_stored_and_removed_balance():
    """Seeded: a long random run on one manager; the recorder's live states always equal the
    tree's, and StateStored minus StateRemoved (and clears) counts what the tree holds."""
    eng, s = hybrid_engine(kv_tokens=128, state_slots=8)
    rng = np.random.default_rng(5)
    live = set()
    for i in range(150):
        op = rng.random()
        if op < 0.6:
            k = int(rng.integers(0, 3))
            toks = np.concatenate([np.arange(k * 50, k * 50 + 2 * int(rng.integers(1, 10))),
                                   rng.integers(300, 303, int(rng.integers(0, 3)))]).astype(np.int32)
            serve(eng, s, f"r{i}", toks)
        elif op < 0.85:
            eng.evict(s, int(rng.integers(0, 20)), int(rng.integers(0, 3)))
        else:
            eng.flush(s)
        for e in eng.drain_events():
            if isinstance(e, StateStored):
                assert e.block_hash not in live
                live.add(e.block_hash)
            elif isinstance(e, StateRemoved):
                assert set(e.block_hashes) <= live
                live -= set(e.block_hashes)
            elif type(e).__name__ == "AllBlocksCleared":
                assert not live  # the reset named every state first
        assert live == set(eng.tree.kv_events.live_states())
        assert len(live) == eng.tree.mamba_total_size()
        eng.check_invariants()
