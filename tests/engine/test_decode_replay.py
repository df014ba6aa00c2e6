"""``replay_decodes``: a replay's leading calls that need no allocator call, applied in one
batched update, leave the engine exactly as ``alloc_decode`` one call at a time does; the
calls it declines (and only those) are left to ``alloc_decode``."""
import numpy as np
import pytest
from engine_fixtures import toks

from radixkv.engine import CacheEngine, EngineConfig
from radixkv.engine.protocol import DecodeItem, ExtendItem
from radixkv.errors import RadixKVError


def _pair(**kw):
    cfg = dict(kv_tokens=512, decode_reserve=4, request_rows=8, max_context_len=24)
    cfg.update(kw)
    out = []
    for _ in range(2):
        e = CacheEngine(EngineConfig(**cfg))
        s = e.attach().session
        e.alloc_extend(s, [ExtendItem("a", toks(range(10))), ExtendItem("b", toks(range(20))),
                           ExtendItem("c", toks(range(5)))])
        out.append((e, s))
    return out


def _state(e):
    reqs = e._reqs
    rows = e.pools.req_to_token_pool.req_to_token
    return ({rid: (r.seq_len, r.kv_committed_len, r.fill_ids.tolist(), r.decode_reserve.tolist(),
                   rows[r.req_pool_idx, :r.seq_len].tolist()) for (_sid, rid), r in reqs.items()},  # one session each
            e.stats())


def _one_by_one(e, s, calls):
    for k, (rids, tids) in enumerate(calls):
        try:
            e.alloc_decode(s, [DecodeItem(r, int(t)) for r, t in zip(rids, tids)])
        except RadixKVError as err:
            return k, type(err)
    return len(calls), None


def _packed(calls):
    index = {}
    idx = [index.setdefault(r, len(index)) for rids, _ in calls for r in rids]
    tids = np.concatenate([np.asarray(t, np.int32) for _, t in calls]) if calls else np.zeros(0, np.int32)
    return list(index), np.array([len(r) for r, _ in calls], np.int32), np.array(idx, np.int32), tids


CASES = {
    "all": ([(["a", "b", "c"], [1, 2, 3])] * 2 + [(["c", "a"], [4, 5])], 3, {}),
    # reserves of 4, 3, 2 before calls 0-2; call 3 takes the last slot and tops up
    "a reserve runs short at call 3": ([(["a"], [1]), (["a"], [2]), (["a", "c"], [3, 4]), (["a"], [5]),
                                        (["a"], [6])], 3, {}),
    # b (20 tokens) gets a reserve of 2 under max_context_len 22, and call 2 is over the limit
    "max_context_len": ([(["b"], [1]), (["b", "a"], [1, 2]), (["b"], [3])], 1, {"max_context_len": 22}),
    "an unknown rid": ([(["a"], [1]), (["zz"], [2])], 0, {}),
    "a rid twice in call 1": ([(["a"], [1]), (["c", "c"], [2, 3]), (["a"], [4])], 1, {}),
    "a negative token": ([(["a"], [1]), (["c"], [-3])], 1, {}),
    "empty calls": ([([], []), ([], [])], 2, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bulk_replay_equals_alloc_decode_one_call_at_a_time(case):
    calls, bulk, kw = CASES[case]
    (e1, s1), (e2, s2) = _pair(**kw)
    want = _one_by_one(e1, s1, calls)
    done = e2.replay_decodes(s2, *_packed(calls))
    assert done == bulk
    got = _one_by_one(e2, s2, calls[done:])
    assert (got[0] + done, got[1]) == want
    assert _state(e2) == _state(e1)
    e1.check_invariants()
    e2.check_invariants()


def test_nothing_in_bulk_without_reserves():
    (e, s), _ = _pair(decode_reserve=0)
    assert e.replay_decodes(s, *_packed([(["a"], [1])])) == 0
