"""The Step socket's transport under abuse (issue 34, items 2, 4, 5): the descriptor limit
(the accept loop backs off and logs once a period), half-closed connections with unread
replies (they hold their call-budget slot until their transport is gone, which a write
deadline bounds), and frames that never finish (a deadline by size, a cap on the bytes held
across connections). No timing decides a test: every wait is a bounded poll for a state."""
from __future__ import annotations

import socket
import time

import grpc
import pytest
from radixkv.service.client import connect
from radixkv.service.server.manager import ServeOptions
from radixkv.service.wire.step import FRAME, step_socket_path
from service_util import START_TIMEOUT_S, end_serve, popen_serve
from test_step_socket import CONFIG, error_code, hello, raw_connect, recv
from tooling.testing import ThreadedServer

WAIT_S = 60.0  # the bound of every poll below: generous, never a measure


def opts(**kw):
    return ServeOptions(sweep_interval_s=0.2, grace_s=5.0, **kw)


def until(what, predicate, wait_s=WAIT_S):
    deadline = time.monotonic() + wait_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {wait_s} s")
        time.sleep(0.02)


def gone(s, wait_s=WAIT_S) -> bool:
    """Whether the manager closed ``s`` (reads and drops whatever it still sends)."""
    s.settimeout(wait_s)
    try:
        while s.recv(1 << 16):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def accepted(srv, s):
    resp = hello(s, srv.token)
    assert resp is not None and resp.WhichOneof("result") != "error", resp


def step_stat(srv, name):
    return srv.call(lambda server: getattr(server.step_socket, name))


# ------------------------------------------------------------------ item 4: half-closed connections
GARBAGE = FRAME.pack(3) + b"\xff\xff\xff"  # answered INVALID_ARGUMENT in band, the connection kept
N_GARBAGE = 5_000  # ~0.6 MB of answers: more than the socket buffers hold, less than the high water


def test_a_half_closed_connection_keeps_its_slot_until_its_unread_replies_are_dropped():
    with ThreadedServer(CONFIG, options=opts(max_concurrent_rpcs=4, handshake_timeout_s=600.0)) as srv:
        conns = []
        for _ in range(4):
            s = raw_connect(srv)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            accepted(srv, s)
            s.sendall(GARBAGE * N_GARBAGE)
            s.shutdown(socket.SHUT_WR)  # half-closed: sends nothing more, reads nothing
            conns.append(s)
        until("every frame answered", lambda: step_stat(srv, "frames") == 4 * N_GARBAGE)
        extra = raw_connect(srv)  # their slots are still held while their replies wait
        assert error_code(hello(extra, srv.token)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert step_stat(srv, "open") == 4
        srv.call(lambda server: setattr(server.step_socket, "write_timeout_s", 0.2))  # the deadline, shortened now
        until("the unread replies dropped", lambda: step_stat(srv, "open") == 0)
        assert dict(step_stat(srv, "refused")) == {"call_limit": 1, "write_timeout": 4}
        assert all(gone(s) for s in conns)
        later = raw_connect(srv)  # the slots are back
        accepted(srv, later)
        c = srv.client()
        c.heartbeat(c.attach("w").session)


# ------------------------------------------------------------------ item 5: frames that never finish
def test_a_frame_that_stops_arriving_is_closed_at_its_deadline():
    with ThreadedServer(CONFIG, options=opts(handshake_timeout_s=0.5)) as srv:
        s = raw_connect(srv)
        accepted(srv, s)
        s.sendall(FRAME.pack(64 << 10) + b"\x0a" * 100)  # 64 KiB announced, 100 bytes sent
        until("the partial frame counted", lambda: step_stat(srv, "partial_bytes") == 64 << 10)
        assert gone(s)
        assert dict(step_stat(srv, "refused")) == {"frame_timeout": 1}
        assert step_stat(srv, "partial_bytes") == 0 and step_stat(srv, "open") == 0


def test_bytes_of_unfinished_frames_are_capped_across_connections():
    mib = 1 << 20
    with ThreadedServer(CONFIG, options=opts(max_message_bytes=mib, handshake_timeout_s=120.0)) as srv:
        assert step_stat(srv, "partial_cap") == 2 * mib
        held = []
        for i in range(2):
            s = raw_connect(srv)
            accepted(srv, s)
            s.sendall(FRAME.pack(mib) + b"\x0a" * 1000)
            held.append(s)
            until(f"frame {i} counted", lambda i=i: step_stat(srv, "partial_bytes") == (i + 1) * mib)
        third = raw_connect(srv)
        accepted(srv, third)
        third.sendall(FRAME.pack(mib) + b"\x0a" * 1000)
        resp = recv(third)
        assert error_code(resp) == grpc.StatusCode.RESOURCE_EXHAUSTED and "cap of 2097152" in resp.error.details
        assert gone(third)
        assert dict(step_stat(srv, "refused")) == {"partial_bytes": 1}
        held[0].close()  # a held frame's bytes go back when its connection ends
        until("the bytes back", lambda: step_stat(srv, "partial_bytes") == mib)
        c = srv.client()  # whole frames are unaffected
        c.heartbeat(c.attach("w").session)


# ------------------------------------------------------------------ item 2: the descriptor limit
SERVE_ARGS = ["--kv-tokens", "2048", "--handshake-timeout-s", "600", "--log-level", "INFO"]  # the silent ones stay


def test_at_the_descriptor_limit_the_step_socket_backs_off_and_logs_once_a_period(tmp_path):
    srv = popen_serve(SERVE_ARGS, ulimit="-n 64")
    address = srv.address
    flood: list[socket.socket] = []
    try:
        with connect(address, token=srv.token, wait_s=START_TIMEOUT_S, timeout_s=30) as c:
            s = c.attach("w").session  # a worker attached before the flood
            c.heartbeat(s)  # its Step socket connection is open (a new one needs a descriptor)
            path = step_socket_path(address[len("unix://"):])
            for _ in range(120):  # silent: each one the manager accepts holds a descriptor
                f = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                f.setblocking(False)
                try:
                    f.connect(path)
                except (BlockingIOError, ConnectionRefusedError, OSError):
                    f.close()
                    continue
                flood.append(f)
            def reached():
                c.heartbeat(s)  # the worker attached before goes on: its heartbeats never fail
                return "want of a file descriptor" in srv.log()

            until("the limit reached", reached)
            for _ in range(200):
                c.heartbeat(s)
            text = srv.log()
            assert "socket.accept() out of system resource" not in text, text[-3000:]
            assert text.count("want of a file descriptor") <= 2, text[-3000:]  # one per 10 s period
    finally:
        for f in flood:
            f.close()
        end_serve(srv, wait_s=0.1)


def test_serve_raises_its_soft_descriptor_limit_to_the_hard_one(tmp_path):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"the hard limit ({hard}) leaves nothing to raise to")
    srv = popen_serve(SERVE_ARGS, ulimit="-S -n 256")
    try:
        with connect(srv.address, token=srv.token, wait_s=START_TIMEOUT_S, timeout_s=30) as c:
            c.stats()
        limits = open(f"/proc/{srv.process.pid}/limits").read()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        assert line.split()[3:5] == [str(hard), str(hard)], line
        assert f"descriptor limit raised from 256 to {hard}" in srv.log()
    finally:
        end_serve(srv, wait_s=0.1)
