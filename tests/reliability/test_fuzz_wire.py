"""Bad and malicious input at the wire: Hypothesis-built messages for every RPC, raw garbage
bytes, oversize messages, missing / wrong tokens.

The server (a real one on a thread, Unix socket) must never crash or answer INTERNAL /
UNKNOWN: bad input is INVALID_ARGUMENT, a wrong session secret (or a missing operator
token) PERMISSION_DENIED, unknown requests (another session's included: ids are per session)
NOT_FOUND, stale sessions FAILED_PRECONDITION, full pools RESOURCE_EXHAUSTED; and after
every example its invariants and the conservation law hold.
"""
from __future__ import annotations

import os
import stat

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from radixkv.service.server.manager import ServeOptions
from radixkv.service.server.servicer import STREAM_METHODS, UNARY_METHODS
from radixkv.service.wire import codec
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from reliability_util import check_law
from tooling.testing import ThreadedServer

from radixkv.engine.protocol import ExtendItem

ALLOWED = {"OK", "INVALID_ARGUMENT", "PERMISSION_DENIED", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED"}
MAX_MSG = 1 << 16
CONFIG = dict(kv_tokens=1024, page_size=4, max_context_len=256, max_sessions=16, max_requests_per_session=8,
              request_rows=32, lease_ttl_s=600.0, enable_kv_events=True)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FUZZ_EACH = settings(FUZZ, max_examples=6)  # per-method runs, on top of the mixed one


class Wire:
    """A raw channel to a fuzzed server, with two sessions A and B holding requests."""

    def __init__(self):
        opts = ServeOptions(sweep_interval_s=0.2, grace_s=1.0, max_message_bytes=MAX_MSG)
        self.srv = ThreadedServer(CONFIG, options=opts)
        self.srv.start()
        self.ch = grpc.insecure_channel("unix:" + self.srv.address[len("unix://"):],
                                        options=[("grpc.max_send_message_length", 4 * MAX_MSG)])
        self.md = (("authorization", "Bearer " + self.srv.token),)
        self.a = self._attach("A")
        self.b = self._attach("B")
        for ref, rid in ((self.a, "a-1"), (self.b, "b-1")):
            items = [ExtendItem(rid, np.arange(1, 9, dtype=np.int32))]
            self.call("AllocExtend", codec.extend_request_to_msg(ref, items))

    def _attach(self, name):
        return pb.AttachResponse.FromString(self.call("Attach", pb.AttachRequest(worker_name=name))).session

    def raw(self, method, data, metadata=None):
        """Send ``data`` bytes; returns the status code name."""
        fn = self.ch.unary_unary(f"/radixkv.v1.CacheManager/{method}")
        try:
            fn(data, metadata=self.md if metadata is None else metadata, timeout=30)
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    def call(self, method, msg):
        return self.ch.unary_unary(f"/radixkv.v1.CacheManager/{method}")(msg.SerializeToString(), metadata=self.md,
                                                                          timeout=30)

    def audit(self):
        """Invariants and the conservation law, through the wire."""
        self.call("CheckInvariants", pb.CheckInvariantsRequest())
        check_law(pb.StatsResponse.FromString(self.call("Stats", pb.StatsRequest())))

    def close(self):
        self.ch.close()
        self.srv.stop()


@pytest.fixture(scope="module")
def wire():
    w = Wire()
    yield w
    w.close()


# ----------------------------------------------------------------------------- strategies


def sessions(w):
    fake = pb.SessionRef(session_id="0123456789abcdef", epoch=w.a.epoch, lease_ttl_s=1.0)
    return st.sampled_from([w.a, w.b, fake, pb.SessionRef(),
                            pb.SessionRef(session_id=w.a.session_id, epoch=w.a.epoch + 1),
                            pb.SessionRef(session_id=w.a.session_id, epoch=-(1 << 63))])


RIDS = st.sampled_from(["a-1", "b-1", "nobody", "", "x" * 300, "a-1", "new-1", "new-2", "\u00e9\u4e2d"])
TOKEN_BYTES = st.one_of(
    st.binary(max_size=64),  # often not a whole number of int32
    st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=40).map(lambda v: np.asarray(v, "<i4").tobytes()),
    st.integers(0, 300).map(lambda n: np.arange(1, n + 1, dtype="<i4").tobytes()),  # up to over max_context_len
)
EXTRA = st.one_of(st.none(), st.text(max_size=8), st.just("k" * 2000), st.just(""))


LENS = st.lists(st.integers(-2, 12), max_size=4).map(lambda v: np.asarray(v, "<i4").tobytes())
TOKENS = st.lists(st.integers(0, 30000), max_size=40).map(lambda v: np.asarray(v, np.int32))
DECODE_CALL = st.lists(st.tuples(RIDS, st.integers(-(1 << 31), (1 << 31) - 1)), max_size=4).map(
    lambda v: ([r for r, _ in v], np.asarray([t for _, t in v], np.int32)))


def _packed_extend(s, items):
    return "AllocExtend", codec.extend_request_to_msg(s, [ExtendItem(*it) for it in items])


def _packed_replay(s, calls):
    msg = codec.apply_decodes_to_msg(("x", 0), calls)
    msg.session.CopyFrom(s)
    return "ApplyDecodes", msg


def _opt(msg, field, value):
    if value is not None:
        setattr(msg, field, value)
    return msg


def by_method(w):
    """One strategy of ``(method, message)`` per unary RPC (all but CheckInvariants, which
    takes no input and runs after every example anyway)."""
    sess = sessions(w)
    rids = st.lists(RIDS, max_size=4)
    return {
        "Attach": st.builds(lambda n, pid: ("Attach", pb.AttachRequest(worker_name=n, pid=pid)),
                            st.one_of(st.text(max_size=8), st.just("w" * 300)), I64),
        "Heartbeat": st.builds(lambda s: ("Heartbeat", pb.HeartbeatRequest(session=s)), sess),
        "Match": st.builds(lambda s, q: ("Match", pb.MatchRequest(session=s, queries=q)), sess,
                           st.lists(st.builds(lambda t, ek: _opt(pb.MatchQuery(token_ids_i32=t), "extra_key", ek),
                                              TOKEN_BYTES, EXTRA), max_size=3)),
        "AllocExtend": st.one_of(  # packed well, and packed fields that may disagree
            st.builds(_packed_extend, sess, st.lists(st.tuples(RIDS, TOKENS, EXTRA, I64), max_size=3)),
            st.builds(lambda s, r, rl, t, tl, ek, ekl, pr: ("AllocExtend", pb.AllocExtendRequest(
                session=s, rids=r, rid_lens_i32=rl, token_ids_i32=t, token_lens_i32=tl, extra_keys=ek,
                extra_key_lens_i32=ekl, priorities_i64=pr)), sess, st.text(max_size=12), LENS, TOKEN_BYTES, LENS,
                st.text(max_size=8), LENS, st.binary(max_size=24))),
        "AllocDecode": st.builds(lambda s, r, t: ("AllocDecode", pb.AllocDecodeRequest(session=s, rids=r,
                                                                                       token_ids_i32=t)),
                                 sess, rids, TOKEN_BYTES),
        "ApplyDecodes": st.one_of(
            st.builds(_packed_replay, sess, st.lists(DECODE_CALL, max_size=3)),
            st.builds(lambda s, r, rl, cl, ix, t: ("ApplyDecodes", pb.ApplyDecodesRequest(
                session=s, rids=r, rid_lens_i32=rl, call_lens_i32=cl, rid_index_i32=ix, token_ids_i32=t)),
                sess, st.text(max_size=12), LENS, LENS, LENS, TOKEN_BYTES)),
        "CacheUnfinished": st.builds(lambda s, r: ("CacheUnfinished", pb.CacheRequest(session=s, rids=r)), sess, rids),
        "CacheFinished": st.builds(lambda s, r: ("CacheFinished", pb.CacheRequest(session=s, rids=r)), sess, rids),
        "Release": st.builds(lambda s, r: ("Release", pb.ReleaseRequest(session=s, rids=r)), sess, rids),
        "Evict": st.builds(lambda s, n, k: ("Evict", pb.EvictRequest(session=s, num_tokens=n, num_states=k)),
                           sess, I64, I64),
        "Stats": st.builds(lambda s: ("Stats", pb.StatsRequest(session=s)), sess),
        "Flush": st.builds(lambda s: ("Flush", pb.FlushRequest(session=s)), sess),
        "TakeEvents": st.builds(lambda s, n: ("TakeEvents", pb.TakeEventsRequest(session=s, max_events=n)), sess, I64),
        "Detach": st.builds(lambda s: ("Detach", pb.DetachRequest(session=s)),
                            st.just(pb.SessionRef(session_id="feedfacefeedface", epoch=0))),
    }


def requests(w):
    """Any unary RPC's message (mixed in one batch: cross-method interactions)."""
    return st.one_of(*by_method(w).values())


# ----------------------------------------------------------------------------- tests


def test_hypothesis_messages_for_every_rpc(wire):
    covered = set()

    def send(batch, rid):
        for method, msg in batch:
            md = wire.md + ((("radixkv-request-id", rid),) if rid else ())
            code = wire.raw(method, msg.SerializeToString(), md)
            assert code in ALLOWED, (method, msg, code)
            covered.add(method)
            wire.audit()

    @FUZZ
    @given(data=st.data())
    def mixed(data):
        batch = data.draw(st.lists(requests(wire), min_size=1, max_size=4))
        rid = data.draw(st.one_of(st.none(), st.sampled_from(["dup-1", "dup-2"])))  # duplicated request ids
        send(batch, rid)

    mixed()
    # Which methods a mixed run draws depends on Hypothesis's pool of constants, harvested
    # from whatever project modules are loaded: so every method also gets runs of its own.
    for strategy in by_method(wire).values():
        @FUZZ_EACH
        @given(item=strategy)
        def each(item):
            send([item], None)

        each()
    assert covered == set(UNARY_METHODS) - {"CheckInvariants"}, set(UNARY_METHODS) - covered
    # the seeded requests survive whatever the fuzzer did under other sessions' names
    assert wire.raw("Heartbeat", pb.HeartbeatRequest(session=wire.a).SerializeToString()) == "OK"


@FUZZ
@given(method=st.sampled_from(UNARY_METHODS), data=st.binary(max_size=256))
def test_garbage_bytes_never_crash_the_server(wire, method, data):
    code = wire.raw(method, data)
    assert code in ALLOWED, (method, data, code)
    wire.audit()


def test_garbage_on_streams_and_bad_utf8(wire):
    bad_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (a string) holding invalid UTF-8
    assert wire.raw("Attach", bad_utf8) == "INVALID_ARGUMENT"
    assert wire.raw("Heartbeat", b"\xff\xff\xff") == "INVALID_ARGUMENT"
    ka = wire.ch.stream_stream("/radixkv.v1.CacheManager/KeepAlive")
    with pytest.raises(grpc.RpcError) as ei:
        list(ka(iter([b"\xff\xff\xff"]), metadata=wire.md, timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    watch = wire.ch.unary_stream("/radixkv.v1.CacheManager/WatchEvents")
    with pytest.raises(grpc.RpcError) as ei:
        list(watch(b"\x0a\x05\xff", metadata=wire.md, timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a keep-alive stream may not switch sessions
    both = [pb.HeartbeatRequest(session=wire.a).SerializeToString(),
            pb.HeartbeatRequest(session=wire.b).SerializeToString()]
    with pytest.raises(grpc.RpcError) as ei:
        list(ka(iter(both), metadata=wire.md, timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wire.audit()


def test_oversize_messages_are_refused(wire):
    before = wire.call("Stats", pb.StatsRequest())
    big = codec.extend_request_to_msg(wire.a, [ExtendItem("big", np.ones(MAX_MSG // 4 + 16, dtype=np.int32))]) \
        .SerializeToString()
    assert len(big) > MAX_MSG
    assert wire.raw("AllocExtend", big) == "RESOURCE_EXHAUSTED"
    assert wire.raw("Attach", b"\x0a" + b"\x80\x80\x08" + b"x" * (MAX_MSG + 8)) == "RESOURCE_EXHAUSTED"
    assert wire.call("Stats", pb.StatsRequest()) == before
    wire.audit()


def test_every_rpc_but_health_needs_the_token(wire):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    methods = [m.name for m in pb.DESCRIPTOR.services_by_name["CacheManager"].methods]
    assert set(methods) == set(UNARY_METHODS) | set(STREAM_METHODS)
    for md in ((), (("authorization", "Bearer wrong-token-123"),), (("authorization", wire.srv.token),)):
        for m in methods:
            if m in UNARY_METHODS:
                code = wire.raw(m, b"", md)
            else:
                try:
                    if m == "KeepAlive":
                        list(wire.ch.stream_stream(f"/radixkv.v1.CacheManager/{m}")(
                            iter([b""]), metadata=md, timeout=30))
                    else:
                        list(wire.ch.unary_stream(f"/radixkv.v1.CacheManager/{m}")(b"", metadata=md, timeout=30))
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
            assert code == "UNAUTHENTICATED", (m, md, code)
    resp = health_pb2_grpc.HealthStub(wire.ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    directory = os.path.dirname(wire.srv.address[len("unix://"):])
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    wire.audit()


def test_hypothesis_step_messages_over_the_step_socket(wire):
    """The step calls' messages (and raw garbage) as frames of the Step socket: every answer
    comes in band with an allowed code, the connection goes on, invariants hold."""
    import socket

    from radixkv.service.wire.step import FRAME, SOCKET_VERSION, STEP_METHODS, step_socket_path

    codes = {c.value[0]: c.name for c in grpc.StatusCode}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(step_socket_path(wire.srv.address[len("unix://"):]))
    reader = sock.makefile("rb")

    def ask(frame: bytes) -> str:
        sock.sendall(FRAME.pack(len(frame)) + frame)
        (n,) = FRAME.unpack(reader.read(FRAME.size))
        resp = pb.StepResponse.FromString(reader.read(n))
        return "OK" if resp.WhichOneof("result") == "reply" else codes[resp.error.code]

    assert ask(pb.StepHello(token=wire.srv.token, version=SOCKET_VERSION).SerializeToString()) == "OK"
    methods = by_method(wire)
    covered = set()

    @FUZZ
    @given(item=st.one_of(*(methods[m] for m in STEP_METHODS if m in methods)),
           rid=st.one_of(st.none(), st.sampled_from(["dup-1", "dup-3"])),
           garbage=st.one_of(st.none(), st.binary(max_size=64)))
    def frames(item, rid, garbage):
        method, msg = item
        frame = garbage if garbage is not None else pb.StepRequest(
            method=method, request=msg.SerializeToString(), request_id=rid or "").SerializeToString()
        code = ask(frame)
        assert code in ALLOWED, (method, msg, garbage, code)
        covered.add(method)
        wire.audit()

    try:
        frames()
        assert len(covered) >= 5, covered
        assert ask(pb.StepRequest(method="Heartbeat", request=pb.HeartbeatRequest(
            session=wire.a).SerializeToString()).SerializeToString()) in ALLOWED  # the connection went on
    finally:
        reader.close()
        sock.close()
