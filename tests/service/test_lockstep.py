"""The remote engine agrees with the embedded one call for call.

A Hypothesis state machine drives an embedded ``CacheEngine`` and a remote one (a real gRPC
server over a Unix socket) with the same calls, and a plain Python model of which requests
run in which session. After every step: both return the same results (slot indices
included: the engines are deterministic) or raise the same error type; their stats are equal;
both pass ``check_invariants()``; the model's request count matches.
"""
import numpy as np
from engine_fixtures import comparable
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from tooling.testing import ThreadedServer

from radixkv.engine import CacheEngine, EngineConfig
from radixkv.engine.protocol import DecodeItem, ExtendItem, MatchQuery
from radixkv.errors import RadixKVError

CONFIG = dict(kv_tokens=96, page_size=1, request_rows=6, max_context_len=64, max_requests_per_session=4,
              lease_ttl_s=1e6)
PREFIXES = [np.array([1, 2, 3, 4, 5, 6], np.int32), np.array([7, 8, 9], np.int32), np.array([], np.int32)]


_norm = comparable


class Lockstep(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.local = CacheEngine(EngineConfig(**CONFIG))
        self.server = ThreadedServer(CONFIG)
        self.server.start()
        self.remote = self.server.client()
        self.sessions = [(self.local.attach(f"w{i}").session, self.remote.attach(f"w{i}").session)
                         for i in range(2)]
        self.model = {}  # rid -> session index
        self.n = 0

    def teardown(self):
        if hasattr(self, "server"):
            self.server.stop()

    def both(self, method, si, *args):
        """Call ``method`` on both engines (session ``si``); results or error types agree."""
        out = []
        for k, engine in enumerate((self.local, self.remote)):
            try:
                out.append(("ok", _norm(getattr(engine, method)(self.sessions[si][k], *args))))
            except RadixKVError as e:
                out.append(("err", type(e).__name__))
        assert out[0] == out[1], f"{method}: embedded {out[0]} != remote {out[1]}"
        return out[0]

    def rids_of(self, si):
        return sorted(r for r, s in self.model.items() if s == si)

    @rule(si=st.integers(0, 1), p=st.integers(0, 2), tail=st.lists(st.integers(0, 20), min_size=1, max_size=12))
    def extend_new(self, si, p, tail):
        self.n += 1
        rid = f"r{self.n}"
        toks = np.concatenate([PREFIXES[p], np.array(tail, np.int32)]).astype(np.int32)
        if self.both("alloc_extend", si, [ExtendItem(rid, toks)])[0] == "ok":
            self.model[rid] = si

    @precondition(lambda self: self.model)
    @rule(data=st.data(), chunk=st.lists(st.integers(0, 20), min_size=1, max_size=6))
    def extend_chunk(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        self.both("alloc_extend", self.model[rid], [ExtendItem(rid, np.array(chunk, np.int32))])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), si=st.integers(0, 1), tok=st.integers(0, 20))
    def decode(self, data, si, tok):
        rids = data.draw(st.lists(st.sampled_from(self.rids_of(si) or ["none"]), unique=True, max_size=3))
        self.both("alloc_decode", si, [DecodeItem(r, tok) for r in rids])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), how=st.sampled_from(["cache_unfinished", "cache_finished", "release"]))
    def finish(self, data, how):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        if self.both(how, self.model[rid], [rid])[0] == "ok" and how != "cache_unfinished":
            del self.model[rid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def touch_other_sessions_request(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model)))
        assert self.both("cache_finished", 1 - self.model[rid], [rid]) == ("err", "NotFoundError")  # ids per session

    @rule(si=st.integers(0, 1), bad=st.sampled_from(["int64", "list", "2d", "negative", "empty"]))
    def bad_tokens(self, si, bad):
        toks = {"int64": np.arange(3), "list": [1, 2], "2d": np.ones((2, 2), np.int32),
                "negative": np.array([1, -1], np.int32), "empty": np.array([], np.int32)}[bad]
        self.n += 1
        assert self.both("alloc_extend", si, [ExtendItem(f"r{self.n}", toks)]) == ("err", "InvalidArgumentError")

    @rule(si=st.integers(0, 1), p=st.integers(0, 2), tail=st.lists(st.integers(0, 20), max_size=5))
    def match(self, si, p, tail):
        toks = np.concatenate([PREFIXES[p], np.array(tail, np.int32)]).astype(np.int32)
        self.both("match", si, [MatchQuery(toks)])

    @rule(si=st.integers(0, 1), n=st.integers(0, 40))
    def evict(self, si, n):
        self.both("evict", si, n)

    @rule(si=st.integers(0, 1))
    def flush_and_events(self, si):
        self.both("flush", si)
        self.both("take_events", si)

    @invariant()
    def agree(self):
        if not hasattr(self, "server"):
            return
        a, b = self.local.stats(), self.remote.stats()
        assert a == b, f"stats differ: embedded {a} remote {b}"
        assert a.requests == len(self.model)
        self.local.check_invariants()
        self.remote.check_invariants()


TestLockstep = Lockstep.TestCase
TestLockstep.settings = settings(max_examples=20, stateful_step_count=30, deadline=None, derandomize=True)
