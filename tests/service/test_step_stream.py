"""The Step stream (``connect()``'s default, ``step_stream=True``): step calls as messages of one
persistent stream, run exactly as the unary calls (same errors, same reply cache), with
deadlines, fallback to unary calls when the stream breaks, and a prompt end at shutdown.

The protocol behaviour of a stream client is also covered call for call by the conformance
suite (``tests/conformance/test_conformance_stream.py``)."""
from __future__ import annotations

import queue
import threading
import time

import grpc
import numpy as np
import pytest
from radixkv.service.client import connect
from radixkv.service.client.step_lane import StepLane
from radixkv.service.server.manager import ServeOptions
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.errors import ServiceUnavailableError
from radixkv.service.wire.step import StepRpcError, error_to_msg
from tooling.testing import ThreadedServer

from radixkv import errors as E
from radixkv.engine.protocol import DecodeItem, ExtendItem, MatchQuery

CONFIG = {"kv_tokens": 2048, "page_size": 1, "request_rows": 32, "max_context_len": 256}


def toks(n, start=1):
    return np.arange(start, start + n, dtype=np.int32)


@pytest.fixture
def srv():
    s = ThreadedServer(CONFIG, options=ServeOptions(sweep_interval_s=0.2, grace_s=5.0))
    s.start()
    yield s
    s.stop()


def stream_client(srv, **kw):
    """A client whose step calls go over the gRPC Step stream (not the Step socket, which
    ``tests/service/test_step_socket.py`` covers)."""
    c = srv.client(step_stream=True, step_socket=False, **kw)
    return c, c.attach("w").session


def _sequence(eng):
    """Every step call once; returns what they answered (plain values)."""
    sess = eng.attach("w").session
    out = []
    res = eng.alloc_extend(sess, [ExtendItem("a", toks(40)), ExtendItem("b", toks(20, 500))])
    out.append([(r.rid, r.req_pool_idx, r.prefix_len, r.start, r.seq_len, r.out_cache_loc.tolist()) for r in res])
    d = eng.alloc_decode(sess, [DecodeItem("a", 7), DecodeItem("b", 8)])
    out.append([x.tolist() for x in d])
    out.append(eng.cache_unfinished(sess, ["b"]))
    out.append(eng.cache_finished(sess, ["a"]))
    out.append(eng.match(sess, [MatchQuery(toks(41)), MatchQuery(toks(3, 900))]))
    res = eng.alloc_extend(sess, [ExtendItem("c", toks(30))])
    out.append([(r.prefix_len, r.start, r.seq_len) for r in res])
    eng.release(sess, ["c", "b"])
    out.append(eng.evict(sess, 10))
    out.append(eng.heartbeat(sess) > 0)
    eng.check_invariants()
    return out


def test_step_calls_go_over_one_stream_and_answer_as_unary_calls(srv):
    c = srv.client(step_stream=True, step_socket=False)
    got = _sequence(c)
    assert c.steps.stream is not None and c.steps.stream.calls == 9 and c.steps.fallbacks == 0
    with ThreadedServer(CONFIG) as other:  # the same calls as unary calls on a fresh manager
        u = other.client(step_stream=False)
        assert _sequence(u) == got
        assert u.steps is None
    d = srv.client()  # the default client sends its step calls over the stream too
    d.heartbeat(d.attach("default").session)
    assert d.steps is not None and d.steps.stream.calls == 1


def test_errors_arrive_in_the_stream_as_the_same_types(srv):
    c, s = stream_client(srv)
    other, so = stream_client(srv)
    other.alloc_extend(so, [ExtendItem("theirs", toks(8))])
    with pytest.raises(E.NotFoundError, match="nope"):
        c.alloc_decode(s, [DecodeItem("nope", 1)])
    step = c.steps.stream
    with pytest.raises(E.NotFoundError, match="theirs"):  # request ids are per session
        c.cache_finished(s, ["theirs"])
    with pytest.raises(E.CapacityError) as ei:
        c.alloc_extend(s, [ExtendItem("big", toks(300))])
    assert (ei.value.requested, ei.value.available) == (300, 256)
    with pytest.raises(E.CapacityError) as ei:
        c.alloc_extend(s, [ExtendItem(f"m{i}", toks(200)) for i in range(12)])  # 2400 > 2048 KV slots
    assert ei.value.requested is not None and ei.value.available is not None
    assert c.steps.stream is step and step.calls == 4 and not step.broken  # failed calls keep the stream
    c.detach(s)
    with pytest.raises(E.StaleSessionError):
        c.heartbeat(s)
    assert c.steps.fallbacks == 0
    c.check_invariants()


def test_a_request_id_means_the_same_call_on_both_paths(srv):
    c, s = stream_client(srv)
    u = srv.client()
    req = wire.extend_request_to_msg(pb.SessionRef(session_id=s.session_id, epoch=s.epoch, secret=s.secret),
                                     [ExtendItem("once", toks(16))])
    first = c._call("AllocExtend", req, request_id="req-1")  # over the stream
    assert c.steps.stream.calls == 1
    held = c.stats().kv_held
    again = u._call("AllocExtend", req, request_id="req-1")  # a unary retry: the kept reply
    assert again == first and c.stats().kv_held == held == 16
    # and a stream retry of a unary call
    req2 = pb.CacheRequest(session=req.session, rids=["once"])
    done = u._call("CacheFinished", req2, request_id="req-2")
    assert c._call("CacheFinished", req2, request_id="req-2") == done
    # the same id with other bytes is refused, in the stream as over unary
    with pytest.raises(E.InvalidArgumentError):
        c._call("CacheFinished", pb.CacheRequest(session=req.session, rids=["x"]), request_id="req-2")
    assert c.steps.stream.calls == 3 and c.steps.fallbacks == 0
    c.check_invariants()


def raw_stream(srv, messages):
    ch = grpc.insecure_channel(f"unix:{srv.address[len('unix://'):]}")
    try:
        call = ch.stream_stream("/radixkv.v1.CacheManager/Step")
        md = (("authorization", f"Bearer {srv.token}"),)
        return [pb.StepResponse.FromString(r) for r in call(iter(messages), metadata=md, timeout=30)]
    finally:
        ch.close()


def test_hostile_stream_messages_are_answered_invalid_argument_in_the_stream(srv):
    c, s = stream_client(srv)
    ref = pb.SessionRef(session_id=s.session_id, epoch=s.epoch, secret=s.secret)
    ok = pb.StepRequest(method="Heartbeat", request=pb.HeartbeatRequest(session=ref).SerializeToString())
    msgs = [b"\xff\xff\xff",  # not a StepRequest
            pb.StepRequest(method="Attach", request=pb.AttachRequest().SerializeToString()).SerializeToString(),
            pb.StepRequest(method="Stats", request=b"").SerializeToString(),
            pb.StepRequest(method="AllocDecode", request=b"\x0a\x05\xff").SerializeToString(),  # bad inner bytes
            pb.StepRequest(method="Heartbeat", request=ok.request, request_id="bad id\x01").SerializeToString(),
            pb.StepRequest(method="AllocDecode", request=pb.AllocDecodeRequest(
                session=ref, rids=["a", "b"], token_ids_i32=toks(1).tobytes()).SerializeToString()).SerializeToString(),
            ok.SerializeToString()]
    out = raw_stream(srv, msgs)
    assert len(out) == len(msgs)
    for r in out[:-1]:
        assert r.WhichOneof("result") == "error" and r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], r
    assert pb.HeartbeatResponse.FromString(out[-1].reply).lease_left_s > 0  # the stream went on
    c.check_invariants()


def test_the_stream_needs_the_token(srv):
    ch = grpc.insecure_channel(f"unix:{srv.address[len('unix://'):]}")
    try:
        call = ch.stream_stream("/radixkv.v1.CacheManager/Step")
        with pytest.raises(grpc.RpcError) as ei:
            list(call(iter([b""]), metadata=(("authorization", "Bearer wrong-token-123"),), timeout=30))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        ch.close()


@pytest.mark.parametrize("socket", [False, True], ids=["grpc-stream", "step-socket"])
def test_a_late_reply_is_a_deadline_and_the_retry_gets_the_kept_reply(srv, socket):
    c = srv.client(step_stream=True, step_socket=socket, timeout_s=0.3)
    s = c.attach("w").session
    c.alloc_extend(s, [ExtendItem("a", toks(8))])
    assert type(c.steps.stream).__name__ == ("StepSocket" if socket else "StepStream")
    srv.call(lambda server: server.servicer.reply_delays.update(AllocDecode=5.0))
    t = time.monotonic()
    with pytest.raises(ServiceUnavailableError, match="Deadline"):
        c.alloc_decode(s, [DecodeItem("a", 3)])  # it ran (9 tokens), but the reply is late
    assert time.monotonic() - t < 4.0  # the watchdog / socket timeout ended the wait, not the late reply
    assert c.steps.stream is None  # the timed-out lane is dropped
    r = srv.client(retries=1, timeout_s=0.3, step_stream=True, step_socket=socket)
    d = r.alloc_decode(s, [DecodeItem("a", 4)])  # the lane's try times out; the unary retry
    assert d.seq_lens.tolist() == [10] and r.retried == 1  # (same id) gets the kept reply
    srv.call(lambda server: server.servicer.reply_delays.clear())
    assert c.stats(s).kv_held == 10
    c.check_invariants()


def test_a_broken_stream_falls_back_to_unary_calls(srv):
    c, s = stream_client(srv)
    c.alloc_extend(s, [ExtendItem("a", toks(8))])
    c.steps.stream._call.cancel()  # the stream breaks (as when a connection drops)
    d = c.alloc_decode(s, [DecodeItem("a", 3)])  # sent again over a unary call
    assert d.seq_lens.tolist() == [9] and c.steps.fallbacks == 1 and c.steps.stream is None
    c.steps.reopen_at = 0.0
    c.heartbeat(s)
    assert c.steps.stream is not None and c.steps.stream.calls == 1  # a fresh stream
    c.check_invariants()


def test_concurrent_callers_share_the_client(srv):
    c, s = stream_client(srv)
    errors = []

    def worker(k):
        try:
            for i in range(20):
                rid = f"t{k}-{i}"
                c.alloc_extend(s, [ExtendItem(rid, toks(4, 100 * k + i))])
                c.cache_finished(s, [rid])
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert c.stats(s).requests == 0 and c.steps.fallbacks == 0
    c.check_invariants()


def test_shutdown_ends_idle_streams_promptly():
    """An idle open Step stream is ended (OK) when the shutdown begins, not held until the
    grace runs out (then it would end CANCELLED): the stream's own status says which."""
    srv = ThreadedServer(CONFIG, options=ServeOptions(sweep_interval_s=0.2, grace_s=120.0), timeout_s=300)
    srv.start()
    c = connect(srv.address, token=srv.token, step_stream=True, timeout_s=30)
    ch = grpc.insecure_channel("unix:" + srv.address[len("unix://"):])
    sent: queue.SimpleQueue = queue.SimpleQueue()
    try:
        s = c.attach("w").session
        c.heartbeat(s)
        assert c.steps.stream is not None
        raw = ch.stream_stream("/radixkv.v1.CacheManager/Step")(
            iter(sent.get, None), metadata=(("authorization", "Bearer " + srv.token),))
        ref = pb.SessionRef(session_id=s.session_id, epoch=s.epoch, secret=s.secret)
        sent.put(pb.StepRequest(method="Heartbeat", request=pb.HeartbeatRequest(
            session=ref).SerializeToString()).SerializeToString())
        assert pb.StepResponse.FromString(next(raw)).WhichOneof("result") == "reply"  # open, now idle
        srv.stop()
        assert raw.code() == grpc.StatusCode.OK  # ended by the shutdown, not cancelled after the grace
        with pytest.raises(ServiceUnavailableError):
            c.heartbeat(s)
    finally:
        sent.put(None)
        ch.close()
        c.close()
        srv.stop()


def test_step_error_round_trips_the_status():
    from radixkv.service.wire.errors import error_from_rpc, status_of

    exc = E.CapacityError("no room", requested=5, available=2)
    msg = pb.StepResponse.FromString(error_to_msg(status_of(exc)).SerializeToString())
    back = error_from_rpc(StepRpcError.from_msg(msg.error))
    assert type(back) is E.CapacityError and (back.requested, back.available) == (5, 2) and "no room" in str(back)
    odd = error_from_rpc(StepRpcError.from_msg(pb.StepError(code=999, details="?")))
    assert isinstance(odd, E.RadixKVError)
    with pytest.raises(E.InvalidArgumentError):
        connect("unix:///nonexistent/x.sock", token="t" * 24, wait_s=0, step_stream="yes")


def test_a_manager_without_the_step_method_gets_unary_calls(tmp_path):
    """An older manager answers the stream UNIMPLEMENTED: the lane gives up on it."""
    from concurrent import futures

    from radixkv.service.wire._gen import cache_manager_pb2_grpc as pb_grpc

    old = grpc.server(futures.ThreadPoolExecutor(max_workers=2))  # serves no method at all
    sock = tmp_path / "old.sock"
    old.add_insecure_port(f"unix:{sock}")
    old.start()
    ch = grpc.insecure_channel(f"unix:{sock}")
    try:
        lane = StepLane(pb_grpc.CacheManagerStub(ch), (), 5.0)
        req = pb.HeartbeatRequest(session=pb.SessionRef(session_id="s", epoch=1))
        assert lane.call("Heartbeat", req, "id-1") is None  # send it as a unary call
        assert not lane.enabled and lane.fallbacks == 1 and lane.stream is None
        assert lane.call("Heartbeat", req, "id-2") is None and lane.fallbacks == 1  # no new stream
        lane.close()
    finally:
        ch.close()
        old.stop(0)


def test_open_streams_count_against_the_concurrent_rpc_limit():
    """Each open stream holds one of ``max_concurrent_rpcs`` (gRPC's limiter counts RPCs in
    flight, idle streams included); a Step stream the limit refuses falls back to the unary
    call, which the limit refuses the same way (``CapacityError``, at once); a closed stream
    frees its slot and the next step call opens a fresh stream."""
    opts = ServeOptions(sweep_interval_s=0.2, grace_s=1.0, max_concurrent_rpcs=2)
    with ThreadedServer(CONFIG, options=opts) as srv:
        a, sa = stream_client(srv)
        a.heartbeat(sa)  # a's Step stream: one slot, held while idle
        b, sb = stream_client(srv)
        ka = b.start_keepalive(sb)  # the second slot
        deadline = time.monotonic() + 10
        while ka.lease_left_s is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ka.lease_left_s is not None
        t = time.monotonic()
        with pytest.raises(E.CapacityError):
            b.heartbeat(sb)  # b's stream is refused, then its unary retry of the call too
        assert time.monotonic() - t < 5.0  # refused, not queued
        assert b.steps.fallbacks == 1 and b.steps.stream is None
        a.close()  # a's stream ends: its slot is free again
        while True:  # until the manager has seen a's stream end
            b.steps.reopen_at = 0.0
            try:
                left = b.heartbeat(sb)
                if b.steps.stream is not None:
                    break
            except E.CapacityError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert left > 0 and b.steps.stream.calls == 1
