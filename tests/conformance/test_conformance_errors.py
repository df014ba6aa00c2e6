"""Every kind of bad call raises its typed error and changes nothing (stats and the
request-to-token table compared before and after, invariants checked after)."""
import functools

import numpy as np
import pytest
import torch
from conformance_util import Checked, expect_unchanged, toks, write_token_kv

from radixkv.engine.protocol import CacheResult, DecodeItem, ExtendItem, MatchQuery
from radixkv.errors import (
    CapacityError,
    InvalidArgumentError,
    NotFoundError,
    RadixKVError,
)


@pytest.fixture(params=[1, 16])
def env(request, engine_factory, clock):
    ps = request.param
    raw = engine_factory(clock=clock, page_size=ps, kv_tokens=256, request_rows=4, max_context_len=128,
                         max_requests_per_session=8)
    e = Checked(raw)
    info = e.attach("mine")
    s = info.session
    other = e.attach("theirs").session
    buf = engine_factory.buffers(raw, info)
    p = toks(np.arange(1, 40))
    (r,) = e.alloc_extend(s, [ExtendItem("mine", p)])
    write_token_kv(buf, r.out_cache_loc, p)
    e.alloc_extend(other, [ExtendItem("theirs", p[:20])])
    e.cache_unfinished(s, ["mine"])
    return e, s, other, buf, ps


def test_another_sessions_request_is_unknown_here(env):
    """Request ids are per session (issue 17, item 7): a rid only another session holds is
    answered exactly as one nobody holds (NotFoundError, the same message), so no session can
    probe another's ids; the call changes nothing."""
    e, s, other, buf, _ = env
    calls = [
        lambda rid: e.alloc_decode(s, [DecodeItem("mine", 1), DecodeItem(rid, 1)]),
        lambda rid: e.cache_unfinished(s, [rid]),
        lambda rid: e.cache_finished(s, ["mine", rid]),
        lambda rid: e.release(s, [rid]),
    ]
    for call in calls:
        theirs = expect_unchanged(e, NotFoundError, functools.partial(call, "theirs"), buf)
        ghost = expect_unchanged(e, NotFoundError, functools.partial(call, "ghost"), buf)
        assert str(theirs).replace("theirs", "ghost") == str(ghost)


def test_two_sessions_use_the_same_request_id_independently(env):
    """A session can create a request under an id another session holds; each sees only its
    own, and ending one leaves the other as it was."""
    e, s, other, buf, _ = env
    before = e.stats()
    (mine,) = e.alloc_extend(s, [ExtendItem("theirs", toks(np.arange(200, 210)))])
    assert (mine.rid, mine.prefix_len, mine.seq_len) == ("theirs", 0, 10)
    assert e.stats().requests == before.requests + 1
    # each session's "theirs" is its own: the other's has 20 tokens, this session's 10
    assert e.alloc_decode(other, [DecodeItem("theirs", 5)]).seq_lens.tolist() == [21]
    assert e.alloc_decode(s, [DecodeItem("theirs", 5)]).seq_lens.tolist() == [11]
    e.release(s, ["theirs"])
    with pytest.raises(NotFoundError):
        e.release(s, ["theirs"])
    e.alloc_decode(other, [DecodeItem("theirs", 6)])  # still there, at 22 tokens
    e.cache_finished(other, ["theirs"])
    with pytest.raises(NotFoundError):
        e.cache_finished(other, ["theirs"])
    assert e.stats().requests == before.requests - 1


def test_unknown_request_is_not_found(env):
    e, s, other, buf, _ = env
    for call in [
        lambda: e.alloc_decode(s, [DecodeItem("mine", 1), DecodeItem("ghost", 1)]),
        lambda: e.cache_unfinished(s, ["ghost"]),
        lambda: e.cache_finished(s, ["mine", "ghost"]),
        lambda: e.release(s, ["ghost", "mine"]),
    ]:
        expect_unchanged(e, NotFoundError, call, buf)


@pytest.mark.parametrize("bad", [
    np.arange(5, dtype=np.int64),                 # int64 tokens
    np.arange(5, dtype=np.float32),               # float tokens
    [1, 2, 3],                                    # a list, not an array
    np.arange(6, dtype=np.int32).reshape(2, 3),   # 2-D
    np.empty(0, dtype=np.int32),                  # no tokens
    np.array([1, -2, 3], dtype=np.int32),         # negative id
    "123",
])
def test_bad_tokens_are_invalid_argument(env, bad):
    e, s, other, buf, _ = env
    expect_unchanged(e, InvalidArgumentError, lambda: e.alloc_extend(s, [ExtendItem("new", bad)]), buf)
    expect_unchanged(e, InvalidArgumentError,
                     lambda: e.alloc_extend(s, [ExtendItem("new2", toks([1, 2])), ExtendItem("mine", bad)]), buf)
    if not (isinstance(bad, np.ndarray) and bad.dtype == np.int32 and bad.ndim == 1 and bad.size == 0):
        expect_unchanged(e, InvalidArgumentError, lambda: e.match(s, [MatchQuery(bad)]), buf)


def test_bad_shapes_and_values_are_invalid_argument(env):
    e, s, other, buf, _ = env
    calls = [
        lambda: e.alloc_extend(s, [ExtendItem("x", toks([1])), ExtendItem("x", toks([2]))]),  # repeated rid
        lambda: e.alloc_extend(s, [ExtendItem("", toks([1]))]),
        lambda: e.alloc_extend(s, [ExtendItem(7, toks([1]))]),
        lambda: e.alloc_extend(s, [ExtendItem("x", toks([1]), extra_key=5)]),
        lambda: e.alloc_extend(s, [ExtendItem("x", toks([1]), priority="high")]),
        lambda: e.alloc_extend(s, ExtendItem("x", toks([1]))),  # not a list of items
        lambda: e.alloc_extend(s, [("x",)]),
        lambda: e.alloc_decode(s, [DecodeItem("mine", 1), DecodeItem("mine", 2)]),
        lambda: e.alloc_decode(s, [DecodeItem("mine", -1)]),
        lambda: e.alloc_decode(s, [DecodeItem("mine", 1.5)]),
        lambda: e.alloc_decode(s, [DecodeItem("mine", True)]),
        lambda: e.cache_finished(s, ["mine", "mine"]),
        lambda: e.cache_finished(s, "mine"),
        lambda: e.release(s, [None]),
        lambda: e.evict(s, -1),
        lambda: e.evict(s, 1, -1),
        lambda: e.evict(s, 2.5),
        lambda: e.take_events(s, -1),
        lambda: e.attach(123),
    ]
    for call in calls:
        expect_unchanged(e, InvalidArgumentError, call, buf)


def test_too_big_is_capacity_error(env):
    e, s, other, buf, ps = env
    err = expect_unchanged(e, CapacityError,
                           lambda: e.alloc_extend(s, [ExtendItem("big", toks(np.arange(129)))]), buf)
    assert err.requested == 129 and err.available == 128
    # over the KV pool (256 slots): two 120-token prompts fit the rows and the width, not the pool
    two = [ExtendItem("x", toks(np.arange(100, 220))), ExtendItem("y", toks(np.arange(300, 420)))]
    err = expect_unchanged(e, CapacityError, lambda: e.alloc_extend(s, two), buf)
    assert err.requested is not None and err.available is not None and err.requested > err.available
    # a known request growing past max_context_len (decode or extend)
    expect_unchanged(e, CapacityError, lambda: e.alloc_extend(s, [ExtendItem("mine", toks(np.arange(90)))]), buf)
    # out of request rows: 4 rows, 2 in use
    three = [ExtendItem(f"n{i}", toks([i + 1])) for i in range(3)]
    expect_unchanged(e, CapacityError, lambda: e.alloc_extend(s, three), buf)


def test_decode_past_context_is_capacity_error(engine_factory, clock):
    e = Checked(engine_factory(clock=clock, max_context_len=8))
    s = e.attach().session
    e.alloc_extend(s, [ExtendItem("r", toks(np.arange(7)))])
    e.alloc_decode(s, [DecodeItem("r", 1)])
    expect_unchanged(e, CapacityError, lambda: e.alloc_decode(s, [DecodeItem("r", 1)]))
    assert e.cache_finished(s, ["r"]) == [CacheResult("r", 8)]


def test_a_failed_call_leaves_the_session_usable(env):
    e, s, other, buf, ps = env
    two = [ExtendItem("x", toks(np.arange(100, 220))), ExtendItem("y", toks(np.arange(300, 420)))]
    with pytest.raises(CapacityError):
        e.alloc_extend(s, two)
    (r,) = e.alloc_extend(s, [ExtendItem("mine", toks([5, 6]))])
    assert r.start == 39 and r.seq_len == 41
    e.alloc_decode(s, [DecodeItem("mine", 1)])
    assert e.cache_finished(s, ["mine"])[0].cached_len == 42 - 42 % ps
    e.release(other, ["theirs"])
    st = e.stats()
    assert st.requests == 0 and st.kv_held == 0


def test_every_error_is_a_radixkv_error(env):
    e, s, other, buf, _ = env
    for call in (lambda: e.release(s, ["ghost"]), lambda: e.release(s, ["theirs"]),
                 lambda: e.alloc_extend(s, [ExtendItem("z", toks(np.arange(500)))])):
        with pytest.raises(RadixKVError):
            call()


def test_torch_int32_tokens_are_accepted(env):
    e, s, other, buf, _ = env
    (r,) = e.alloc_extend(s, [ExtendItem("t", torch.arange(1, 6, dtype=torch.int32))])
    assert r.seq_len == 5
    e.release(s, ["t"])
