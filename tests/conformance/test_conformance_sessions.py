"""Sessions through the protocol: detach and lease expiry reclaim everything a session's
requests hold (driven by an injected clock), heartbeats keep a lease, stale sessions are
refused, limits hold."""
import numpy as np
import pytest
from conformance_util import Checked, assert_law, expect_unchanged, toks

from radixkv.engine.protocol import DecodeItem, ExtendItem, MatchQuery, Session
from radixkv.errors import CapacityError, StaleSessionError


def _busy(e, s, rid_prefix, n=3, ps=1):
    """Start ``n`` requests in session ``s``: one finished (cached), the rest running,
    one of those with a chunk cached (locks in the tree)."""
    p = toks(np.arange(1, 41))
    e.alloc_extend(s, [ExtendItem(f"{rid_prefix}0", p)])
    e.cache_finished(s, [f"{rid_prefix}0"])
    for i in range(1, n):
        e.alloc_extend(s, [ExtendItem(f"{rid_prefix}{i}", np.concatenate([p, toks([i] * 9)]))])
        e.alloc_decode(s, [DecodeItem(f"{rid_prefix}{i}", 5)])
    e.cache_unfinished(s, [f"{rid_prefix}1"])


@pytest.mark.parametrize("ps", [1, 16])
def test_detach_reclaims_everything(engine_factory, clock, ps):
    e = Checked(engine_factory(clock=clock, page_size=ps, kv_tokens=512))
    s1 = e.attach("w1").session
    s2 = e.attach("w2").session
    _busy(e, s1, "a", ps=ps)
    e.alloc_extend(s2, [ExtendItem("b", toks(np.arange(1, 30)))])
    held_by_s2 = e.stats().kv_held
    e.detach(s1)
    st = e.stats()
    assert st.sessions == 1 and st.requests == 1
    assert_law(st)
    with pytest.raises(StaleSessionError):
        e.heartbeat(s1)
    with pytest.raises(StaleSessionError):
        e.alloc_extend(s1, [ExtendItem("a9", toks([1, 2]))])
    with pytest.raises(StaleSessionError):
        e.detach(s1)
    # the rids of the detached session are free to reuse
    e.alloc_extend(s2, [ExtendItem("a1", toks([1, 2, 3]))])
    e.release(s2, ["a1", "b"])
    st = e.stats()
    assert st.requests == 0 and st.kv_held == 0 and st.kv_protected == 0 and held_by_s2 > 0
    e.detach(s2)
    assert e.stats().sessions == 0


@pytest.mark.parametrize("ps", [1, 16])
def test_lease_expiry_reclaims_everything(engine_factory, clock, ps):
    e = Checked(engine_factory(clock=clock, page_size=ps, kv_tokens=512, lease_ttl_s=10.0))
    s1 = e.attach("w1").session
    assert s1.lease_ttl_s == 10.0
    _busy(e, s1, "a", ps=ps)
    s2 = e.attach("w2").session
    clock.advance(6)
    assert e.heartbeat(s2) == pytest.approx(10.0)
    clock.advance(4.5)  # s1: 10.5 s without a call -> expired; s2 renewed 4.5 s ago
    st = e.stats()
    assert st.sessions == 1 and st.requests == 0 and st.kv_held == 0 and st.kv_protected == 0
    with pytest.raises(StaleSessionError):
        e.alloc_decode(s1, [DecodeItem("a1", 1)])
    assert e.heartbeat(s2) == pytest.approx(10.0)
    # the cached prefix survived (it belongs to the tree, not to the session)
    assert e.match(s2, [MatchQuery(toks(np.arange(1, 41)))])[0].prefix_len == 40 - 40 % ps


def test_calls_keep_the_lease(engine_factory, clock):
    e = Checked(engine_factory(clock=clock, lease_ttl_s=5.0))
    s = e.attach().session
    e.alloc_extend(s, [ExtendItem("r", toks([1, 2, 3]))])
    for _ in range(5):
        clock.advance(4)
        e.alloc_decode(s, [DecodeItem("r", 1)])
    clock.advance(4.9)
    assert e.stats().requests == 1
    clock.advance(0.2)
    assert e.stats().requests == 0


def test_stale_and_unknown_sessions(engine_factory, clock):
    e = Checked(engine_factory(clock=clock))
    s = e.attach().session
    e.alloc_extend(s, [ExtendItem("r", toks([1, 2, 3]))])
    bad = [Session("no-such-session", s.epoch, s.lease_ttl_s),
           Session(s.session_id, s.epoch + 1, s.lease_ttl_s)]
    for b in bad:
        expect_unchanged(e, StaleSessionError, lambda: e.heartbeat(b))  # noqa: B023
        expect_unchanged(e, StaleSessionError, lambda: e.alloc_decode(b, [DecodeItem("r", 1)]))  # noqa: B023
        expect_unchanged(e, StaleSessionError, lambda: e.release(b, ["r"]))  # noqa: B023
        expect_unchanged(e, StaleSessionError, lambda: e.detach(b))  # noqa: B023
        expect_unchanged(e, StaleSessionError, lambda: e.flush(b))  # noqa: B023
    e.release(s, ["r"])


def test_session_limits(engine_factory, clock):
    e = Checked(engine_factory(clock=clock, max_sessions=2, max_requests_per_session=3))
    s1 = e.attach().session
    e.attach()
    expect_unchanged(e, CapacityError, lambda: e.attach())
    e.alloc_extend(s1, [ExtendItem(f"r{i}", toks([1, 2])) for i in range(3)])
    expect_unchanged(e, CapacityError, lambda: e.alloc_extend(s1, [ExtendItem("r3", toks([1, 2]))]))
    # an existing request may still grow
    e.alloc_extend(s1, [ExtendItem("r0", toks([3]))])
    e.detach(s1)
    e.attach()  # a slot is free again


def test_expired_sessions_free_their_place(engine_factory, clock):
    e = Checked(engine_factory(clock=clock, max_sessions=1, lease_ttl_s=1.0))
    e.attach()
    expect_unchanged(e, CapacityError, lambda: e.attach())
    clock.advance(1.0)
    s = e.attach().session
    assert e.stats().sessions == 1
    assert e.heartbeat(s) == pytest.approx(1.0)
