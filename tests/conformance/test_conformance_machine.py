"""A Hypothesis state machine against a plain Python model of the protocol.

The pool is large enough that nothing is ever evicted, so the model predicts exactly:
every prefix length (the longest page-aligned prefix of ``tokens[:-1]`` among everything
cached in that namespace), every sequence length, which calls must fail and how, and the
counts in ``stats()``. After every step the engine's invariants and the conservation law
are checked, and every running request's row is read back through the worker buffers:
the KV it points at must hold exactly its tokens (K = token id, written by a fake model)."""
import numpy as np
import pytest
from conformance_util import FakeClock, assert_law, read_token_kv, settled, toks, write_token_kv
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from radixkv.engine.protocol import CacheResult, DecodeItem, ExtendItem, MatchQuery
from radixkv.errors import NotFoundError, StaleSessionError

BASES = [list(range(1, 13)), [5] * 10, [7, 3, 7, 3, 7, 3, 9, 9]]
tails = st.lists(st.integers(0, 9), min_size=0, max_size=10)
prompts = st.tuples(st.integers(0, len(BASES)), st.integers(0, 12), tails).map(
    lambda t: (BASES[t[0]][:t[1]] if t[0] < len(BASES) else []) + t[2]).filter(lambda p: len(p) >= 1)


def _lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class EngineMachine(RuleBasedStateMachine):
    """Set ``factory`` and ``ps`` on the class before running."""

    factory = None
    ps = 1

    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.e = self.factory(clock=self.clock, **self.config())
        self.sessions = {}  # name -> Session
        self.buf = None
        self.running = {}  # rid -> [session name, tokens list, row]
        self.cached = {}  # extra_key -> list of cached token tuples (page-aligned)
        self.extra = {}  # rid -> extra_key
        self.n = 0
        self.evicted = 0  # tokens evict() freed (the tiered machine's rule)

    def config(self):
        """The engine's config (EngineConfig fields)."""
        return dict(page_size=self.ps, kv_tokens=4096, request_rows=24, max_context_len=256, lease_ttl_s=100.0,
                    max_requests_per_session=32)

    # -- helpers -----------------------------------------------------------------------
    def _predict(self, tokens, extra_key):
        best = max((_lcp(c, tokens) for c in self.cached.get(extra_key, [])), default=0)
        return best - best % self.ps

    def _cache(self, rid):
        toks_ = self.running[rid][1]
        n = len(toks_) - len(toks_) % self.ps
        if n:
            self.cached.setdefault(self.extra[rid], []).append(tuple(toks_[:n]))
        return n

    def _rids_of(self, name):
        return [rid for rid, v in self.running.items() if v[0] == name]

    # -- rules -------------------------------------------------------------------------
    @initialize()
    def first_session(self):
        info = self.e.attach("w0")
        self.sessions["w0"] = info.session
        self.buf = self.factory.buffers(self.e, info)

    @precondition(lambda self: len(self.sessions) < 3)
    @rule()
    def attach(self):
        self.n += 1
        self.sessions[f"w{self.n}"] = self.e.attach(f"w{self.n}").session

    @precondition(lambda self: self.sessions and len(self.running) < 20)
    @rule(data=st.data(), prompt=prompts, ek=st.sampled_from([None, None, "ns"]))
    def new_request(self, data, prompt, ek):
        name = data.draw(st.sampled_from(sorted(self.sessions)))
        self.n += 1
        rid = f"r{self.n}"
        (r,) = self.e.alloc_extend(self.sessions[name], [ExtendItem(rid, toks(prompt), extra_key=ek)])
        want = self._predict(prompt[:-1], ek)
        assert (r.prefix_len, r.start, r.seq_len) == (want, want, len(prompt)), (r, want)
        write_token_kv(self.buf, r.out_cache_loc, toks(prompt[r.start:]))
        self.running[rid] = [name, list(prompt), r.req_pool_idx]
        self.extra[rid] = ek

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.lists(st.integers(0, 9), min_size=1, max_size=8))
    def extend_more(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        name, tokens, row = self.running[rid]
        (r,) = self.e.alloc_extend(self.sessions[name], [ExtendItem(rid, toks(chunk))])
        assert (r.prefix_len, r.start, r.seq_len, r.req_pool_idx) == (0, len(tokens), len(tokens) + len(chunk), row)
        write_token_kv(self.buf, r.out_cache_loc, toks(chunk))
        tokens.extend(chunk)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def decode(self, data):
        name = data.draw(st.sampled_from(sorted({v[0] for v in self.running.values()})))
        rids = data.draw(st.lists(st.sampled_from(self._rids_of(name)), min_size=1, unique=True))
        new = [data.draw(st.integers(0, 9)) for _ in rids]
        d = self.e.alloc_decode(self.sessions[name], [DecodeItem(r, t) for r, t in zip(rids, new)])
        for rid, t in zip(rids, new):
            self.running[rid][1].append(t)
        assert d.seq_lens.tolist() == [len(self.running[r][1]) for r in rids]
        assert d.req_pool_indices.tolist() == [self.running[r][2] for r in rids]
        write_token_kv(self.buf, d.out_cache_loc, toks(new))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cache_unfinished(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        res = self.e.cache_unfinished(self.sessions[self.running[rid][0]], [rid])
        assert res == [CacheResult(rid, self._cache(rid))]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        res = self.e.cache_finished(self.sessions[self.running[rid][0]], [rid])
        assert res == [CacheResult(rid, self._cache(rid))]
        del self.running[rid]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.e.release(self.sessions[self.running[rid][0]], [rid])
        del self.running[rid]

    @precondition(lambda self: self.sessions)
    @rule(prompt=prompts, ek=st.sampled_from([None, "ns", "other"]))
    def match(self, prompt, ek):
        s = self.sessions[sorted(self.sessions)[0]]
        (m,) = self.e.match(s, [MatchQuery(toks(prompt), ek)])
        assert m.prefix_len == m.kv_prefix_len == self._predict(prompt, ek)

    @precondition(lambda self: len(self.sessions) > 1)
    @rule(data=st.data())
    def detach(self, data):
        name = data.draw(st.sampled_from(sorted(self.sessions)))
        s = self.sessions.pop(name)
        self.e.detach(s)
        for rid in self._rids_of(name):
            del self.running[rid]
        with pytest.raises(StaleSessionError):
            self.e.heartbeat(s)

    @precondition(lambda self: len(self.sessions) > 1)
    @rule(data=st.data())
    def lease_expires(self, data):
        name = data.draw(st.sampled_from(sorted(self.sessions)))
        for _ in range(2):  # 120 s pass; every other session is renewed every 60 s
            for other, s in self.sessions.items():
                if other != name:
                    self.e.heartbeat(s)
            self.clock.advance(60)
        s = self.sessions.pop(name)
        with pytest.raises(StaleSessionError):
            self.e.heartbeat(s)
        for rid in self._rids_of(name):
            del self.running[rid]

    @precondition(lambda self: self.sessions)
    @rule()
    def flush(self):
        s = self.sessions[sorted(self.sessions)[0]]
        ok = self.e.flush(s)
        assert ok == (not self.running)
        if ok:
            self.cached.clear()

    @precondition(lambda self: len({v[0] for v in self.running.values()}) >= 1 and len(self.sessions) > 1)
    @rule(data=st.data())
    def foreign_and_unknown_rids(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        owner = self.running[rid][0]
        name = data.draw(st.sampled_from(sorted(n for n in self.sessions if n != owner)))
        before = settled(self.e.stats())
        with pytest.raises(NotFoundError):  # ids are per session: theirs is unknown here
            self.e.release(self.sessions[name], [rid])
        with pytest.raises(NotFoundError):
            self.e.cache_finished(self.sessions[name], ["never-seen"])
        assert settled(self.e.stats()) == before

    # -- after every step --------------------------------------------------------------
    @invariant()
    def engine_agrees_with_model(self):
        self.e.check_invariants()
        s = self.e.stats()
        assert_law(s)
        assert (s.sessions, s.requests, s.evicted_tokens) == (len(self.sessions), len(self.running), self.evicted)
        for _rid, (_, tokens, row) in self.running.items():
            np.testing.assert_array_equal(read_token_kv(self.buf, row, len(tokens)), tokens)


@pytest.mark.parametrize("ps", [1, 4])
def test_engine_state_machine(engine_factory, ps):
    machine = type("Machine", (EngineMachine,), {"factory": engine_factory, "ps": ps})
    run_state_machine_as_test(machine, settings=settings(max_examples=20, stateful_step_count=25,
                                                         deadline=None))
