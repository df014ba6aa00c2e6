"""A call's cost is bounded before it is decoded (issue 17, item 1): entry and token limits
checked on the raw request, the session checked before any work, and the leases' clock
leaving out the manager's own stalls."""
import time

import grpc
import numpy as np
import pytest
from radixkv.service.server.loop_clock import LoopClock
from radixkv.service.server.manager import ServeOptions
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.errors import RequestLimitError
from radixkv.service.wire.limits import SPECS, CallLimits, check_raw, limits_for
from tooling.testing import ThreadedServer

from radixkv.engine.protocol import ExtendItem, MatchQuery, Session
from radixkv.errors import InvalidArgumentError, StaleSessionError

LIMITS = CallLimits(max_items=100, max_tokens=1000, max_replayed_items=300)
REQUEST_OF = {"Match": pb.MatchRequest, "AllocExtend": pb.AllocExtendRequest, "AllocDecode": pb.AllocDecodeRequest,
              "ApplyDecodes": pb.ApplyDecodesRequest, "CacheUnfinished": pb.CacheRequest,
              "CacheFinished": pb.CacheRequest, "Release": pb.ReleaseRequest}


def test_the_specs_name_the_proto_fields():
    for method, spec in SPECS.items():
        desc = REQUEST_OF[method].DESCRIPTOR
        if spec.items:
            items = desc.fields_by_number[spec.items]
            assert items.is_repeated, method
            if spec.sub_tokens:
                assert items.message_type.fields_by_number[spec.sub_tokens].name == "token_ids_i32"
        if spec.tokens:
            assert desc.fields_by_number[spec.tokens].name == "token_ids_i32"
        for field, _, _ in spec.packed:
            assert desc.fields_by_number[field].name.endswith("_i32"), (method, field)
    by_name = pb.ApplyDecodesRequest.DESCRIPTOR.fields_by_name
    assert [f for f, _, _ in SPECS["ApplyDecodes"].packed] == [by_name[n].number for n in
                                                              ("rid_lens_i32", "call_lens_i32", "rid_index_i32")]
    assert SPECS["AllocExtend"].packed[0][0] == pb.AllocExtendRequest.DESCRIPTOR.fields_by_name["rid_lens_i32"].number


def test_default_limits_grow_with_the_pool():
    small, big = limits_for(4096, 64), limits_for(1 << 20, 4096, decode_reserve=8)
    assert small == CallLimits(1024, 1 << 16, 1024)
    assert big == CallLimits(4 * 4096, 4 << 20, 8 * 4 * 4096)


def _match(n, tokens=0):
    return pb.MatchRequest(queries=[pb.MatchQuery(token_ids_i32=wire.pack(np.zeros(tokens), wire.I32))
                                    for _ in range(n)]).SerializeToString()


def test_entries_and_tokens_over_the_limits_are_refused_naming_the_limit():
    check_raw("Match", _match(100, 10), LIMITS)  # at the limits: fine
    with pytest.raises(RequestLimitError, match="max_items=100") as e:
        check_raw("Match", _match(101), LIMITS)
    assert (e.value.requested, e.value.available) == (101, 100)
    with pytest.raises(RequestLimitError, match="max_tokens=1000"):
        check_raw("Match", _match(2, 501), LIMITS)
    ref = pb.SessionRef(session_id="s", epoch=1)
    ext = wire.extend_request_to_msg(ref, [ExtendItem("r", np.zeros(1001, np.int32))])
    with pytest.raises(RequestLimitError, match="max_tokens"):
        check_raw("AllocExtend", ext.SerializeToString(), LIMITS)
    check_raw("AllocExtend", wire.extend_request_to_msg(ref, [ExtendItem("r", np.zeros(1, np.int32))] * 100)
              .SerializeToString(), LIMITS)
    with pytest.raises(RequestLimitError, match="101 entries|max_items=100"):
        check_raw("AllocExtend", wire.extend_request_to_msg(ref, [ExtendItem("r", np.zeros(1, np.int32))] * 101)
                  .SerializeToString(), LIMITS)
    dec = pb.AllocDecodeRequest(rids=[str(i) for i in range(101)], token_ids_i32=wire.pack(np.zeros(101), wire.I32))
    with pytest.raises(RequestLimitError, match="max_items"):
        check_raw("AllocDecode", dec.SerializeToString(), LIMITS)
    for what in ("CacheFinished", "CacheUnfinished"):
        with pytest.raises(RequestLimitError, match="max_items"):
            check_raw(what, pb.CacheRequest(rids=["x"] * 101).SerializeToString(), LIMITS)
    with pytest.raises(RequestLimitError, match="max_items"):
        check_raw("Release", pb.ReleaseRequest(rids=["x"] * 101).SerializeToString(), LIMITS)
    s1 = Session("s", 1, 1.0)
    call = ([f"a{i}" for i in range(100)], np.zeros(100, np.int32))
    check_raw("ApplyDecodes", wire.apply_decodes_to_msg(s1, [call] * 3).SerializeToString(), LIMITS)
    with pytest.raises(RequestLimitError, match="max_replayed_items=300"):
        check_raw("ApplyDecodes", wire.apply_decodes_to_msg(s1, [call] * 4).SerializeToString(), LIMITS)
    with pytest.raises(RequestLimitError, match="replayed calls"):
        check_raw("ApplyDecodes", wire.apply_decodes_to_msg(s1, [([], np.zeros(0, np.int32))] * 101)
                  .SerializeToString(), LIMITS)
    with pytest.raises(RequestLimitError, match="rids"):
        wide = [([f"b{i}" for i in range(101)], np.zeros(101, np.int32))]
        check_raw("ApplyDecodes", wire.apply_decodes_to_msg(s1, wide).SerializeToString(), LIMITS)
    # a packed field sent twice counts twice (the parser keeps the last one; the bound holds)
    twice = wire.apply_decodes_to_msg(s1, [call] * 2).SerializeToString()
    with pytest.raises(RequestLimitError, match="max_items=100"):  # 200 rids; 400 items
        check_raw("ApplyDecodes", twice + wire.apply_decodes_to_msg(s1, [call] * 2).SerializeToString(), LIMITS)
    check_raw("Stats", b"\xff" * 10, LIMITS)  # no entries to count: not looked at


def test_the_count_stops_at_the_limit_without_reading_the_rest():
    """A hostile message is refused after the limit's worth of entries: what follows (here
    broken framing, which a full walk would report) is never read."""
    raw = _match(101) + b"\x12\xff\xff\xff\xff\x0f"  # a 4 GiB query announced at the end
    with pytest.raises(RequestLimitError):
        check_raw("Match", raw, LIMITS)
    with pytest.raises(InvalidArgumentError):
        check_raw("Match", _match(3) + b"\x12\xff\xff\xff\xff\x0f", LIMITS)


def test_a_server_refuses_oversize_calls_before_decoding_and_stays_whole():
    opts = ServeOptions(sweep_interval_s=0.2, grace_s=1.0, call_limits=LIMITS)
    with ThreadedServer({"kv_tokens": 256}, options=opts) as srv:
        c = srv.client()
        s = c.attach("w").session
        with pytest.raises(RequestLimitError, match="max_items=100"):
            c.match(s, [MatchQuery(np.zeros(0, np.int32))] * 101)
        with pytest.raises(RequestLimitError, match="max_tokens=1000"):
            c.alloc_extend(s, [ExtendItem(f"r{i}", np.arange(300, dtype=np.int32)) for i in range(4)])
        assert c.stats(s).requests == 0
        assert len(c.match(s, [MatchQuery(np.arange(5, dtype=np.int32))] * 100)) == 100
        c.check_invariants()


def test_the_session_is_checked_before_the_request_is_decoded(monkeypatch):
    """A call of a stale session is answered StaleSessionError without decoding its entries."""
    with ThreadedServer({"kv_tokens": 256}) as srv:
        c = srv.client()
        s = c.attach("w").session
        c.detach(s)
        decoded = []
        for name in ("match_queries_from_msg", "extend_items_from_msg", "decode_items_from_msg"):
            real = getattr(wire, name)
            monkeypatch.setattr(wire, name, lambda *a, _real=real: decoded.append(1) or _real(*a))
        with pytest.raises(StaleSessionError):
            c.match(s, [MatchQuery(np.arange(4, dtype=np.int32))])
        with pytest.raises(StaleSessionError):
            c.alloc_extend(s, [ExtendItem("r", np.arange(4, dtype=np.int32))])
        ref = wire.session_to_msg(s)
        ch = grpc.insecure_channel("unix:" + srv.address[len("unix://"):])
        try:
            call = ch.unary_unary("/radixkv.v1.CacheManager/AllocDecode")
            with pytest.raises(grpc.RpcError) as e:
                call(pb.AllocDecodeRequest(session=ref, rids=["r"], token_ids_i32=wire.pack([1], wire.I32))
                     .SerializeToString(), metadata=(("authorization", "Bearer " + srv.token),), timeout=30)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            ch.close()
        assert decoded == []


def test_loop_clock_leaves_out_stalls():
    now = [100.0]
    clk = LoopClock(lambda: now[0], tick_s=0.05, slack_s=0.25)
    clk._task = object()  # as if its ticker ran (beats driven by hand)
    now[0] += 0.2
    assert clk() == pytest.approx(100.2)  # within tick + slack: counted
    clk.beat()
    now[0] += 10.0  # the loop is stuck: frozen at last beat + 0.3
    assert clk() == pytest.approx(100.5)
    clk.beat()
    assert clk() == pytest.approx(100.5) and clk.stalls == 1 and clk.stalled_s == pytest.approx(9.7)
    now[0] += 0.1
    assert clk() == pytest.approx(100.6)


def test_a_stall_of_the_manager_does_not_expire_a_live_lease():
    """The manager's loop is blocked for longer than the lease (the worker's keep-alive
    would wait unread meanwhile); the sweep that runs right after it expires nobody."""
    with ThreadedServer({"kv_tokens": 256, "lease_ttl_s": 1.0}) as srv:
        c = srv.client()
        s = c.attach("w").session

        def stall_then_sweep(server):
            server.engine.heartbeat(s)  # a full lease left when the stall begins
            time.sleep(2.5)  # blocks the loop: no beat, no heartbeat read
            server.sweep_once()
            return server.engine.sessions.session_ids()

        assert s.session_id in list(srv.call(stall_then_sweep))
        c.heartbeat(s)
        assert srv.call(lambda server: server.lease_clock.stalls) >= 1


def test_a_watcher_cannot_ask_for_a_poll_shorter_than_the_floor():
    from radixkv.service.server.servicer import DEFAULT_WATCH_POLL_S, MIN_WATCH_POLL_S, watch_poll_s

    assert watch_poll_s(0.001) == MIN_WATCH_POLL_S >= 0.05
    assert watch_poll_s(2.0) == 2.0
    for bad in (0.0, -1.0, float("nan"), float("inf"), 61.0):
        assert watch_poll_s(bad) == DEFAULT_WATCH_POLL_S


def test_a_large_match_runs_in_slices_that_let_other_calls_in():
    """A Match of 300 queries is matched in slices of 64 with a turn of the loop between
    them: a task ready meanwhile runs between the first and the second slice, not after the
    Match (the loop is not held for the whole call)."""
    import asyncio
    import types

    from radixkv.service.server.fair_share import FairShare
    from radixkv.service.server.sliced_match import match_in_slices, needs_slices

    from radixkv.engine import CacheEngine

    eng = CacheEngine({"kv_tokens": 256})
    session = eng.attach("w").session
    order = []
    real = eng.match
    eng.match = lambda sess, qs: order.append(len(qs)) or real(sess, qs)
    servicer = types.SimpleNamespace(engine=eng, live_session=lambda msg: session, share=FairShare())
    request = pb.MatchRequest(queries=[pb.MatchQuery(token_ids_i32=wire.pack(np.arange(i % 50), wire.I32))
                                       for i in range(300)])
    assert needs_slices(request) and not needs_slices(pb.MatchRequest(queries=[pb.MatchQuery()] * 64))

    async def main():
        async def other_call():
            order.append("other")

        ready = asyncio.ensure_future(other_call())
        resp = await match_in_slices(servicer, request)
        await ready
        return resp

    resp = asyncio.run(main())
    assert order == [64, "other", 64, 64, 64, 44], order
    assert len(wire.unpack_i64(resp.prefix_len_i64, "p")) == 300


def test_a_sliced_match_answers_as_an_unsliced_one():
    with ThreadedServer({"kv_tokens": 256}) as srv:
        c = srv.client()
        s = c.attach("big").session
        c.alloc_extend(s, [ExtendItem("r", np.arange(40, dtype=np.int32))])
        c.cache_finished(s, ["r"])
        queries = [MatchQuery(np.arange(i % 50, dtype=np.int32)) for i in range(300)]
        want = [m.prefix_len for k in range(0, 300, 60) for m in c.match(s, queries[k:k + 60])]  # unsliced
        assert [m.prefix_len for m in c.match(s, queries)] == want
        bad = queries[:200] + [MatchQuery(np.array([-5], dtype=np.int32))]
        with pytest.raises(InvalidArgumentError, match=r"queries\[200\]"):
            c.match(s, bad)
        c.check_invariants()


def test_serve_flags_set_the_limits():
    import argparse

    from radixkv.service.server.cli import add_serve_arguments, call_limits_from_args, serve_options_from_args

    from radixkv.engine.config import EngineConfig

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    o = serve_options_from_args(p.parse_args(["--health-rpcs", "3", "--handshake-timeout-s", "2.5"]))
    assert (o.health_rpcs, o.handshake_timeout_s, o.call_limits) == (3, 2.5, None)
    cfg = EngineConfig(kv_tokens=4096, request_rows=64, decode_reserve=4)
    assert call_limits_from_args(p.parse_args([]), cfg) is None
    assert call_limits_from_args(p.parse_args(["--max-call-items", "10"]), cfg) == CallLimits(10, 1 << 16, 40)


def test_an_alloc_extend_naming_more_rids_than_a_session_may_own_is_refused_before_decoding(monkeypatch):
    """1,024 one-token items against max_requests_per_session 8: CapacityError naming the
    limit, before the items are decoded or checked (issue 34: the refusal held the loop for
    milliseconds), and nothing changed."""
    from radixkv.errors import CapacityError

    with ThreadedServer({"kv_tokens": 256, "max_requests_per_session": 8}) as srv:
        c = srv.client(step_socket=False, step_stream=False)
        s = c.attach("w").session
        monkeypatch.setattr(wire, "extend_items_from_msg", lambda msg: pytest.fail("decoded"))
        items = [ExtendItem(f"r{i}", np.array([i], np.int32)) for i in range(1024)]
        with pytest.raises(CapacityError, match="1024 requests exceeds max_requests_per_session 8"):
            c.alloc_extend(s, items)
        assert c.stats().requests == 0
        c.check_invariants()
