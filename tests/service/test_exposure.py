"""Careless deployments and calls between sessions (issue 17, items 7 and 8): the operator
token, a readable token file refused, exposures warned about, rejected calls logged once a
period with a count."""
import logging
import os

import numpy as np
import pytest
from radixkv.service.server.exposure import exposure_warnings
from radixkv.service.server.manager import CacheManagerServer, ServeOptions
from radixkv.service.server.periodic_count import PeriodicCount
from radixkv.service.wire.auth import Token, resolve_token
from tooling.testing import ThreadedServer

from radixkv.engine.config import EngineConfig
from radixkv.engine.protocol import ExtendItem
from radixkv.errors import InvalidArgumentError, PermissionDeniedError, UnauthenticatedError
from radixkv.events.zmq_flags import PublisherConfig

OPERATOR = "the-operator-token-1234"


def test_with_an_operator_token_a_worker_cannot_flush_or_evict():
    opts = ServeOptions(sweep_interval_s=0.2, grace_s=1.0, operator_token=Token(OPERATOR))
    with ThreadedServer({"kv_tokens": 256}, options=opts) as srv:
        c = srv.client()
        s = c.attach("w").session
        c.alloc_extend(s, [ExtendItem("r", np.arange(8, dtype=np.int32))])
        c.cache_finished(s, ["r"])
        with pytest.raises(PermissionDeniedError, match="operator token"):
            c.flush(s)
        with pytest.raises(PermissionDeniedError, match="operator token"):
            c.evict(s, 1000)  # over the Step stream (the client's default)
        u = srv.client(step_stream=False)
        with pytest.raises(PermissionDeniedError, match="operator token"):
            u.evict(u.attach("unary").session, 1000)  # as a unary call
        with pytest.raises(PermissionDeniedError, match="operator token"):
            c.check_invariants()
        assert c.stats(s).kv_evictable == 8  # refused calls changed nothing
        from radixkv.service.client import connect

        op = connect(srv.address, token=OPERATOR, wait_s=30)
        try:
            os_ = op.attach("operator").session
            assert op.evict(os_, 4).tokens >= 4
            assert op.flush(os_) is True
            op.check_invariants()
        finally:
            op.close()
        assert c.stats(s).kv_evictable == 0


def test_the_operator_token_must_differ():
    with pytest.raises(InvalidArgumentError, match="differ"):
        CacheManagerServer(EngineConfig(kv_tokens=64), Token(OPERATOR),
                           ServeOptions(operator_token=Token(OPERATOR)))


def test_a_token_file_readable_by_others_is_refused_unless_allowed(tmp_path):
    f = tmp_path / "tok"
    f.write_text("a-token-in-a-file-123\n")
    os.chmod(f, 0o644)
    with pytest.raises(PermissionDeniedError, match="--allow-readable-token-file"):
        resolve_token(token_file=str(f), allow_readable=False)
    assert resolve_token(token_file=str(f), allow_readable=True).reveal() == "a-token-in-a-file-123"
    os.chmod(f, 0o600)
    assert resolve_token(token_file=str(f), allow_readable=False).reveal() == "a-token-in-a-file-123"


def test_serve_refuses_a_readable_token_file(tmp_path, capsys):
    from radixkv.service.server.cli import main

    f = tmp_path / "tok"
    f.write_text("a-token-in-a-file-123\n")
    os.chmod(f, 0o644)
    d = tmp_path / "sock"
    d.mkdir(mode=0o700)
    assert main(["serve", "--address", f"unix://{d}/s.sock", "--token-file", str(f), "--kv-tokens", "64"]) == 2
    assert "readable by others" in capsys.readouterr().err


def test_each_exposure_is_named():
    safe = ServeOptions(operator_token=Token(OPERATOR))
    assert exposure_warnings(safe) == []
    warned = exposure_warnings(ServeOptions(
        address="0.0.0.0:5000", allow_insecure_tcp=True, metrics_port=9100, metrics_addr="0.0.0.0",
        kv_events=PublisherConfig(endpoint="tcp://*:5557")))
    assert len(warned) == 4
    assert "plaintext TCP on '0.0.0.0'" in warned[0] and "Prometheus" in warned[1]
    assert "tcp://*:5557" in warned[2] and "operator" in warned[3]
    assert exposure_warnings(safe._replace(kv_events=PublisherConfig(endpoint="ipc:///run/x"))) == []
    assert exposure_warnings(safe._replace(address="127.0.0.1:5000", metrics_port=1)) == []


def test_rejected_calls_are_logged_once_a_period_with_a_count(caplog):
    now = [0.0]
    lines = []
    pc = PeriodicCount(lambda n, last: lines.append((n, last)), period_s=10.0, clock=lambda: now[0])
    for i in range(1000):
        pc.add(f"m{i}")
    now[0] = 10.0
    pc.add("late")
    pc.flush()
    assert lines == [(1, "m0"), (1000, "late")] and pc.total == 1001
    caplog.set_level(logging.INFO, logger="radixkv.service")
    with ThreadedServer({"kv_tokens": 64}) as srv:
        from radixkv.service.client import connect

        bad = connect(srv.address, token="not-the-right-token", wait_s=30)
        for _ in range(50):
            with pytest.raises(UnauthenticatedError):
                bad.stats()
        bad.close()
    rejected = [r.getMessage() for r in caplog.records if "missing or wrong auth token" in r.getMessage()]
    assert 1 <= len(rejected) < 50 and sum(int(m.split()[1]) for m in rejected) == 50, rejected


def test_unauthenticated_health_streams_never_take_a_workers_slot():
    """With --max-concurrent-rpcs 4, sixteen Health.Watch streams without a token: the
    health budget (2 here) refuses the rest at once, and a worker's calls are all served."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    opts = ServeOptions(sweep_interval_s=0.2, grace_s=1.0, max_concurrent_rpcs=4, health_rpcs=2)
    with ThreadedServer({"kv_tokens": 64}, options=opts) as srv:
        path = srv.address[len("unix://"):]
        chans = [grpc.insecure_channel("unix:" + path) for _ in range(16)]
        try:
            watches = [health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest()) for ch in chans]
            codes = {}
            for w in watches:
                try:
                    next(w)  # SERVING: this stream holds a health slot
                    code = "OPEN"
                except grpc.RpcError as e:
                    code = e.code().name
                codes[code] = codes.get(code, 0) + 1
            assert codes == {"OPEN": 2, "RESOURCE_EXHAUSTED": 14}, codes
            c = srv.client()
            s = c.attach("w").session
            for _ in range(4):
                c.stats(s)
            c.heartbeat(s)
            assert srv.call(lambda server: server.servicer is not None)
            for w in watches:
                w.cancel()
        finally:
            for ch in chans:
                ch.close()


def test_the_client_sends_no_token_to_a_socket_that_could_be_anyones(tmp_path):
    """A fake manager on a socket in a directory others may use (issue 17, item 3): the
    client refuses before sending anything; and a peer of another uid is refused."""
    import socket

    from radixkv.service.client import connect
    from radixkv.service.client.channel import check_socket_peer

    wide = tmp_path / "wide"
    wide.mkdir()
    os.chmod(wide, 0o755)
    fake = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fake.bind(str(wide / "s.sock"))
    fake.listen(4)
    fake.settimeout(0)
    try:
        with pytest.raises(PermissionDeniedError, match="mode 0700"):
            connect(f"unix://{wide}/s.sock", token="a-token-for-the-manager", wait_s=5)
        with pytest.raises(BlockingIOError):
            fake.accept()  # nobody connected: nothing was sent
        shared = tmp_path / "shared"
        shared.mkdir()
        os.chmod(shared, 0o777)  # world-writable, no sticky bit
        inner = shared / "mine"
        inner.mkdir(mode=0o700)
        with pytest.raises(PermissionDeniedError, match="sticky"):
            connect(f"unix://{inner}/s.sock", token="a-token-for-the-manager", wait_s=0)
        assert check_socket_peer(str(wide / "s.sock")) == os.getpid()
        with pytest.raises(PermissionDeniedError, match="runs as uid"):
            check_socket_peer(str(wide / "s.sock"), manager_uid=os.getuid() + 1)
    finally:
        fake.close()


def test_a_connection_that_never_speaks_http2_is_closed():
    """gRPC closes a connection that has not completed its handshake within
    ``handshake_timeout_s`` (its own default is 120 s); the 60 s read timeout is only a hang
    guard (issue 17, item 5)."""
    import socket

    opts = ServeOptions(sweep_interval_s=0.2, grace_s=1.0, handshake_timeout_s=1.0)
    with ThreadedServer({"kv_tokens": 64}, options=opts) as srv:
        sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sk.connect(srv.address[len("unix://"):])
        sk.settimeout(60)
        try:
            while sk.recv(4096):  # the server's SETTINGS, then EOF when it closes
                pass
        finally:
            sk.close()
        c = srv.client()
        c.heartbeat(c.attach("w").session)  # a real client is unaffected
