"""The Step socket (``connect()``'s default for a ``unix:`` address): the Step stream's messages
as frames of a plain Unix socket beside the gRPC socket. Its calls answer as the unary calls
do (the conformance suite runs every scenario over it: ``tests/conformance/test_conformance_stream.py``);
here: the file, the hello, every limit that closes a connection (each counted and logged),
fallback to the gRPC path, the call budget and shutdown (deadlines: ``test_step_stream.py``,
run over both lanes)."""
from __future__ import annotations

import logging
import os
import socket
import stat
import time

import grpc
import numpy as np
import pytest
from radixkv.service.client import connect
from radixkv.service.client.step_lane import StepStream
from radixkv.service.client.step_socket import StepSocket
from radixkv.service.server.manager import ServeOptions
from radixkv.service.server.step_socket import MAX_PENDING
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.auth import Token
from radixkv.service.wire.errors import ServiceUnavailableError
from radixkv.service.wire.step import FRAME, HELLO_MAX_BYTES, SOCKET_VERSION, step_socket_path
from test_step_stream import _sequence
from tooling.testing import ThreadedServer

from radixkv import errors as E
from radixkv.engine.protocol import DecodeItem, ExtendItem

CONFIG = {"kv_tokens": 2048, "page_size": 1, "request_rows": 32, "max_context_len": 256}
CODE = {c.value[0]: c for c in grpc.StatusCode}


def toks(n, start=1):
    return np.arange(start, start + n, dtype=np.int32)


def opts(**kw):
    return ServeOptions(sweep_interval_s=0.2, grace_s=5.0, **kw)


@pytest.fixture
def srv():
    s = ThreadedServer(CONFIG, options=opts())
    s.start()
    yield s
    s.stop()


def sock_path(srv):
    return step_socket_path(srv.address[len("unix://"):])


def refused(srv):
    return dict(srv.call(lambda server: server.step_socket.refused))


# ------------------------------------------------------------------ raw frames
def raw_connect(srv):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(sock_path(srv))
    return s


def send(s, data: bytes):
    s.sendall(FRAME.pack(len(data)) + data)


def recv(s) -> pb.StepResponse | None:
    """The next answer, or None when the manager closed the socket."""
    f = s.makefile("rb")
    head = f.read(FRAME.size)
    if len(head) < FRAME.size:
        return None
    (n,) = FRAME.unpack(head)
    return pb.StepResponse.FromString(f.read(n))


def closed(s, within_s=10.0) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def hello(s, token, version=SOCKET_VERSION):
    send(s, pb.StepHello(token=token, version=version).SerializeToString())
    return recv(s)


def error_code(resp):
    assert resp is not None and resp.WhichOneof("result") == "error", resp
    return CODE[resp.error.code]


# ------------------------------------------------------------------ the client's lane
def test_the_default_client_sends_its_step_calls_over_the_socket(srv):
    c = srv.client()
    got = _sequence(c)
    lane = c.steps
    assert isinstance(lane.stream, StepSocket) and lane.stream.calls == 9
    assert lane.fallbacks == 0 and lane.socket_misses == 0
    assert srv.call(lambda server: server.step_socket.frames) == 9
    with ThreadedServer(CONFIG) as other:  # the same calls as unary calls on a fresh manager
        assert _sequence(other.client(step_stream=False)) == got
    seen = srv.call(lambda server: server.metrics.rpc_latency.collect()[0].samples)
    counted = {s.labels["method"] for s in seen if s.name.endswith("_count")}
    assert {"AllocExtend", "AllocDecode", "CacheFinished", "Evict"} <= counted  # same metrics as the stream


def test_the_socket_file_is_private_and_removed_at_stop():
    s = ThreadedServer(CONFIG, options=opts())
    s.start()
    path = sock_path(s)
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and st.st_mode & 0o777 == 0o600
    assert os.path.dirname(path) == os.path.dirname(s.address[len("unix://"):])
    s.stop()
    assert not os.path.exists(path)


def test_without_the_socket_the_client_uses_the_grpc_stream():
    with ThreadedServer(CONFIG, options=opts(step_socket=False)) as srv:
        assert not os.path.exists(sock_path(srv))
        c = srv.client()
        c.heartbeat(c.attach("w").session)
        assert isinstance(c.steps.stream, StepStream) and c.steps.socket_misses == 1


def test_errors_arrive_as_the_same_types_and_keep_the_connection(srv):
    c = srv.client()
    s = c.attach("w").session
    c.alloc_extend(s, [ExtendItem("a", toks(8))])
    lane = c.steps.stream
    with pytest.raises(E.NotFoundError, match="nope"):
        c.alloc_decode(s, [DecodeItem("nope", 1)])
    with pytest.raises(E.CapacityError) as ei:
        c.alloc_extend(s, [ExtendItem("big", toks(300))])
    assert (ei.value.requested, ei.value.available) == (300, 256)
    assert c.steps.stream is lane and not lane.broken and c.steps.fallbacks == 0
    c.check_invariants()


# ------------------------------------------------------------------ the hello
def test_a_wrong_token_is_unauthenticated_counted_and_the_client_error_is_the_same(srv):
    s = raw_connect(srv)
    assert error_code(hello(s, "wrong-token-1234")) == grpc.StatusCode.UNAUTHENTICATED
    assert closed(s)
    assert refused(srv) == {"auth": 1}
    failures = srv.call(lambda server: server.metrics.auth_failures.labels("Step")._value.get())
    assert failures == 1
    bad = connect(srv.address, token="wrong-token-1234", wait_s=10)
    with pytest.raises(E.UnauthenticatedError):  # the gRPC path answers as it always did
        bad.heartbeat(srv.client().attach("w").session)
    assert bad.steps.socket_misses == 1
    bad.close()


@pytest.mark.parametrize("frame", [b"\xff\xff\xff", pb.StepHello(token="x" * 16, version=99).SerializeToString()])
def test_a_bad_hello_is_refused(srv, frame):
    s = raw_connect(srv)
    send(s, frame)
    assert error_code(recv(s)) == grpc.StatusCode.INVALID_ARGUMENT and closed(s)
    assert refused(srv) == {"bad_hello": 1}


def test_an_oversize_hello_is_refused_unread(srv):
    s = raw_connect(srv)
    s.sendall(FRAME.pack(HELLO_MAX_BYTES + 1))
    assert error_code(recv(s)) == grpc.StatusCode.INVALID_ARGUMENT and closed(s)
    assert refused(srv) == {"bad_hello": 1}


def test_a_silent_connection_is_closed_after_the_handshake_timeout_counted_and_logged(caplog):
    with ThreadedServer(CONFIG, options=opts(handshake_timeout_s=0.3)) as srv:
        caplog.set_level(logging.INFO, logger="radixkv.service")
        s = raw_connect(srv)
        t = time.monotonic()
        assert closed(s, within_s=10)
        assert 0.2 < time.monotonic() - t < 5
        half = raw_connect(srv)  # half a hello: the same
        half.sendall(FRAME.pack(40) + b"\x0a")
        assert closed(half)
        assert refused(srv) == {"handshake_timeout": 2}
        assert "Step socket: closed 1 connection(s) by its limits (the last: handshake_timeout)" in caplog.text
        sample = srv.call(lambda server: server.metrics.step_socket_refusals.labels("handshake_timeout")._value.get())
        assert sample == 2
        c = srv.client()  # workers are unaffected
        c.heartbeat(c.attach("w").session)
        assert isinstance(c.steps.stream, StepSocket)


def test_connections_waiting_for_their_hello_are_bounded():
    with ThreadedServer(CONFIG, options=opts(handshake_timeout_s=120.0)) as srv:  # none times out meanwhile
        _fill_the_waiting_room(srv)


def _fill_the_waiting_room(srv):
    waiting = [raw_connect(srv) for _ in range(MAX_PENDING)]
    deadline = time.monotonic() + 10
    while srv.call(lambda server: server.step_socket.pending) < MAX_PENDING:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    extra = raw_connect(srv)
    assert closed(extra, within_s=5)  # at once, not after the handshake timeout
    assert refused(srv) == {"pending_limit": 1}
    c = srv.client()  # a worker whose socket is refused still works, over the gRPC stream
    c.heartbeat(c.attach("w").session)
    assert c.steps.socket_misses == 1 and isinstance(c.steps.stream, StepStream)
    for w in waiting:
        w.close()


# ------------------------------------------------------------------ frames after the hello
def test_hostile_frames_are_answered_in_band_and_the_connection_goes_on(srv):
    c = srv.client(step_stream=False)
    sess = c.attach("w").session
    ref = pb.SessionRef(session_id=sess.session_id, epoch=sess.epoch, secret=sess.secret)
    s = raw_connect(srv)
    assert hello(s, srv.token).WhichOneof("result") == "reply"
    for frame in (b"\xff\xff\xff", b"",
                  pb.StepRequest(method="Attach", request=b"").SerializeToString(),
                  pb.StepRequest(method="AllocDecode", request=b"\x0a\x05\xff").SerializeToString()):
        send(s, frame)
        assert error_code(recv(s)) == grpc.StatusCode.INVALID_ARGUMENT
    send(s, pb.StepRequest(method="Heartbeat", request=pb.HeartbeatRequest(session=ref).SerializeToString(),
                           request_id="r1").SerializeToString())
    assert pb.HeartbeatResponse.FromString(recv(s).reply).lease_left_s > 0
    assert refused(srv) == {}
    c.check_invariants()


def test_a_frame_over_the_message_limit_ends_the_connection_unread():
    with ThreadedServer(CONFIG, options=opts(max_message_bytes=4096)) as srv:
        s = raw_connect(srv)
        assert hello(s, srv.token).WhichOneof("result") == "reply"
        s.sendall(FRAME.pack(1 << 30))  # announces 1 GiB, sends none of it
        resp = recv(s)
        assert error_code(resp) == grpc.StatusCode.RESOURCE_EXHAUSTED and "4096" in resp.error.details
        assert closed(s) and refused(srv) == {"oversize": 1}
        deadline = time.monotonic() + 10  # its budget slot is given back
        while srv.call(lambda server: server.step_socket.open):
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_the_operator_calls_need_the_operator_token():
    op = Token("operator-token-5678")
    with ThreadedServer(CONFIG, options=opts(operator_token=op)) as srv:
        w = srv.client()
        s = w.attach("w").session
        with pytest.raises(E.PermissionDeniedError):
            w.evict(s, 1)
        assert isinstance(w.steps.stream, StepSocket) and w.steps.fallbacks == 0
        o = connect(srv.address, token=op.reveal(), wait_s=10)
        assert o.evict(s, 1).tokens == 0 and isinstance(o.steps.stream, StepSocket)
        o.close()


def test_an_open_connection_holds_a_slot_of_the_call_budget():
    with ThreadedServer(CONFIG, options=opts(max_concurrent_rpcs=1)) as srv:
        a = raw_connect(srv)
        assert hello(a, srv.token).WhichOneof("result") == "reply"
        b = raw_connect(srv)
        assert error_code(hello(b, srv.token)) == grpc.StatusCode.RESOURCE_EXHAUSTED and closed(b)
        assert refused(srv) == {"call_limit": 1}
        a.close()
        deadline = time.monotonic() + 10
        while True:  # until the manager has seen a end
            c = raw_connect(srv)
            if hello(c, srv.token).WhichOneof("result") == "reply":
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)


# ------------------------------------------------------------------ deadlines, breaks, shutdown
def test_a_broken_connection_falls_back_to_unary_calls(srv):
    c = srv.client()
    s = c.attach("w").session
    c.alloc_extend(s, [ExtendItem("a", toks(8))])
    c.steps.stream._sock.shutdown(socket.SHUT_RDWR)  # the connection drops
    d = c.alloc_decode(s, [DecodeItem("a", 3)])  # sent again over a unary call
    assert d.seq_lens.tolist() == [9] and c.steps.fallbacks == 1 and c.steps.stream is None
    c.steps.reopen_at = 0.0
    c.heartbeat(s)
    assert isinstance(c.steps.stream, StepSocket) and c.steps.stream.calls == 1  # a fresh one
    c.check_invariants()


def test_shutdown_ends_connections_promptly():
    srv = ThreadedServer(CONFIG, options=ServeOptions(sweep_interval_s=0.2, grace_s=120.0), timeout_s=300)
    srv.start()
    c = connect(srv.address, token=srv.token, timeout_s=30)
    try:
        s = c.attach("w").session
        c.heartbeat(s)
        raw = raw_connect(srv)
        assert hello(raw, srv.token).WhichOneof("result") == "reply"
        t = time.monotonic()
        srv.stop()
        assert closed(raw, within_s=5) and time.monotonic() - t < 60  # not held for the 120 s grace
        with pytest.raises(ServiceUnavailableError):
            c.heartbeat(s)
    finally:
        c.close()
        srv.stop()


def test_options_are_checked_and_the_socket_is_in_the_startup_line(srv):
    with pytest.raises(E.InvalidArgumentError):
        connect("unix:///nonexistent/x.sock", token="t" * 24, wait_s=0, step_socket="yes")
    with pytest.raises(E.InvalidArgumentError, match="step_socket"):
        ThreadedServer(CONFIG, options=opts(step_socket="yes")).start()
    assert f"(Step socket {sock_path(srv)})" in srv.call(lambda server: server.startup_line())
