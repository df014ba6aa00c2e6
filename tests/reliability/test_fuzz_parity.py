"""The same bad inputs against the embedded engine and the remote client raise the same typed
errors, and change nothing in either.

Hypothesis picks a call and exactly ONE defect for it (a stale or foreign session, a bad
token array, a bad rid, another session's rid (an unknown one: ids are per session), an
unknown rid, repeated rids, a token id or
count out of range, too many tokens, ...). Both engines start from the same state (sessions
A and B, each running one request) and must raise the same ``radixkv.errors`` type; stats
are unchanged and invariants hold afterwards.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tooling.testing import ThreadedServer

from radixkv.engine import CacheEngine, EngineConfig
from radixkv.engine.protocol import DecodeItem, ExtendItem, MatchQuery
from radixkv.errors import (
    CapacityError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    RadixKVError,
    StaleSessionError,
)

CONFIG = dict(kv_tokens=512, max_context_len=128, lease_ttl_s=600.0)
GOOD = np.arange(1, 9, dtype=np.int32)


class Pair:
    def __init__(self):
        self.emb = CacheEngine(EngineConfig(**CONFIG))
        self.srv = ThreadedServer(CONFIG)
        self.srv.start()
        self.rem = self.srv.client()
        self.sess = {}
        for name, eng in (("emb", self.emb), ("rem", self.rem)):
            a, b = eng.attach("A").session, eng.attach("B").session
            eng.alloc_extend(a, [ExtendItem("a-1", GOOD)])
            eng.alloc_extend(b, [ExtendItem("b-1", GOOD)])
            self.sess[name] = (a, b)

    def close(self):
        self.srv.stop()


@pytest.fixture(scope="module")
def pair():
    p = Pair()
    yield p
    p.close()


BAD_TOKENS = [np.arange(1, 5, dtype=np.int64), np.array([1, -2, 3], dtype=np.int32), np.empty(0, np.int32),
              np.ones((2, 2), np.int32), [1, 2, 3], np.ones(4, np.float32)]
BAD_RIDS = ["", "r" * 300, 5, None, b"bytes"]


def calls():
    """(method, defect, build(session_a) -> args)"""
    sess_defects = st.sampled_from(["stale_epoch", "unknown", "not_a_session"])
    return st.one_of(
        st.tuples(st.just("match"), st.sampled_from(["tokens", "extra_key", "not_a_list"]),
                  st.sampled_from([t for t in BAD_TOKENS if len(t)])),  # an empty query is allowed
        st.tuples(st.just("alloc_extend"),
                  # no "foreign": ids are per session, so another session's rid is a new one here
                  st.sampled_from(["tokens", "rid", "dup", "too_long", "priority", "extra_key"]),
                  st.one_of(st.sampled_from(BAD_TOKENS), st.sampled_from(BAD_RIDS))),
        st.tuples(st.just("alloc_decode"), st.sampled_from(["unknown_rid", "foreign", "token_id", "dup"]),
                  st.sampled_from([-1, 1 << 31, 1.5, True, "7"])),
        st.tuples(st.sampled_from(["cache_unfinished", "cache_finished", "release"]),
                  st.sampled_from(["unknown_rid", "foreign", "dup", "rid", "str_not_list"]),
                  st.sampled_from(BAD_RIDS)),
        st.tuples(st.sampled_from(["evict", "take_events"]), st.sampled_from(["negative", "bool"]), st.just(None)),
        st.tuples(st.sampled_from(["heartbeat", "match", "alloc_decode", "release", "flush", "evict"]),
                  sess_defects.map(lambda d: "session:" + d), st.just(None)),
    )


def build(method, defect, v, a):
    s = a
    if defect.startswith("session:"):
        kind = defect.split(":")[1]
        s = {"stale_epoch": a._replace(epoch=a.epoch + 1), "unknown": a._replace(session_id="0" * 16),
             "not_a_session": "not-a-session"}[kind]
        return s, {"heartbeat": (), "match": ([MatchQuery(GOOD)],), "alloc_decode": ([DecodeItem("a-1", 3)],),
                   "release": (["a-1"],), "flush": (), "evict": (1,)}[method]
    if method == "match":
        if defect == "tokens":
            return s, ([MatchQuery(v)],)
        if defect == "extra_key":
            return s, ([MatchQuery(GOOD, "k" * 5000)],)
        return s, ({"q": GOOD},)
    if method == "alloc_extend":
        item = {"tokens": lambda: ExtendItem("new", v if not isinstance(v, (str, type(None), bytes, int)) else [1]),
                "rid": lambda: ExtendItem(v if not isinstance(v, (np.ndarray, list)) else "", GOOD),
                "dup": lambda: [ExtendItem("n", GOOD), ExtendItem("n", GOOD)],
                "too_long": lambda: ExtendItem("long", np.ones(CONFIG["max_context_len"] + 1, np.int32)),
                "priority": lambda: ExtendItem("p", GOOD, None, 1 << 70),
                "extra_key": lambda: ExtendItem("e", GOOD, 12345)}[defect]()
        return s, (item if isinstance(item, list) else [item],)
    if method == "alloc_decode":
        items = {"unknown_rid": [DecodeItem("nobody", 1)], "foreign": [DecodeItem("b-1", 1)],
                 "token_id": [DecodeItem("a-1", v)], "dup": [DecodeItem("a-1", 1), DecodeItem("a-1", 2)]}[defect]
        return s, (items,)
    if method in ("cache_unfinished", "cache_finished", "release"):
        rids = {"unknown_rid": ["nobody"], "foreign": ["b-1"], "dup": ["a-1", "a-1"], "rid": [v],
                "str_not_list": "a-1"}[defect]
        return s, (rids,)
    return s, ((-3 if defect == "negative" else True),)


def outcome(eng, method, args):
    try:
        getattr(eng, method)(*args)
        return "ok"
    except RadixKVError as e:
        return type(e).__name__


FUZZ = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(call=calls())
def test_same_bad_input_same_typed_error_on_both_engines(pair, call):
    method, defect, v = call
    got = {}
    for name, eng in (("emb", pair.emb), ("rem", pair.rem)):
        a = pair.sess[name][0]
        s, args = build(method, defect, v, a)
        before = eng.stats()
        got[name] = outcome(eng, method, (s,) + tuple(args))
        assert eng.stats() == before, (name, method, defect)
        eng.check_invariants()
    assert got["emb"] == got["rem"], (method, defect, v, got)
    assert got["emb"] != "ok", (method, defect, v)
    assert got["emb"] in {t.__name__ for t in (InvalidArgumentError, CapacityError, NotFoundError,
                                               PermissionDeniedError, StaleSessionError)} | {
        "LengthMismatchError", "InvalidIndexError"}, got
