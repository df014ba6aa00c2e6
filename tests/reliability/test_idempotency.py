"""Retried mutating calls never run twice: request ids (``radixkv-request-id`` metadata).

* Wire level: the same ``AllocExtend`` sent twice under one request id gets the same reply
  bytes and allocates once; without an id the retry appends the tokens again (the control:
  what the ids prevent); the same id with other bytes is INVALID_ARGUMENT and changes
  nothing; ids are per session; a retried ``Attach`` returns the same session, a retried
  ``Detach`` succeeds again.
* Client level: the server's loop is blocked so the first try runs into the client's
  deadline; the client retries with the same id and the engine allocates exactly once.
"""
from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
from radixkv.service.server.idempotency import ReplyCache
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.request_id import REQUEST_ID_KEY
from reliability_util import STATE_BOUND_S, check_law
from tooling.testing import ThreadedServer

from radixkv.engine.protocol import ExtendItem

CONFIG = dict(kv_tokens=1024, max_context_len=512, lease_ttl_s=30.0)


def _raw(srv):
    ch = grpc.insecure_channel("unix:" + srv.address[len("unix://"):])
    md = (("authorization", "Bearer " + srv.token),)

    def call(method, req, rid=None):
        m = md + (((REQUEST_ID_KEY, rid),) if rid else ())
        fn = ch.unary_unary(f"/radixkv.v1.CacheManager/{method}")
        return fn(req.SerializeToString(), metadata=m, timeout=30)

    return ch, call


def _extend(ref, rid, n):
    return wire.extend_request_to_msg(ref, [ExtendItem(rid, np.arange(1, n + 1, dtype=np.int32))])


def test_same_request_id_gets_the_kept_reply_and_allocates_once():
    with ThreadedServer(CONFIG) as srv:
        c = srv.client()
        ch, call = _raw(srv)
        try:
            att = pb.AttachRequest(worker_name="w", client_nonce=b"n" * 16)  # one client's nonce
            a1 = pb.AttachResponse.FromString(call("Attach", att, rid="att-1"))
            a2 = pb.AttachResponse.FromString(call("Attach", att, rid="att-1"))
            assert a1.session.session_id == a2.session.session_id and c.stats().sessions == 1
            ref = a1.session
            first = call("AllocExtend", _extend(ref, "r", 40), rid="x-1")
            after_first = c.stats()
            again = call("AllocExtend", _extend(ref, "r", 40), rid="x-1")  # the reply was "lost": retry
            assert again == first
            assert c.stats() == after_first and after_first.kv_held == 40
            # same id, other bytes: refused, nothing changes
            with pytest.raises(grpc.RpcError) as ei:
                call("AllocExtend", _extend(ref, "r", 41), rid="x-1")
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert c.stats() == after_first
            # ids are per session: another session may use "x-1" for its own call
            other = pb.AttachResponse.FromString(call("Attach", pb.AttachRequest(worker_name="o"))).session
            call("AllocExtend", _extend(other, "o", 8), rid="x-1")
            assert c.stats().kv_held == 48
            # control: without an id, the retry of a known rid appends its tokens again
            call("AllocExtend", _extend(other, "o", 8))
            assert c.stats().kv_held == 56
            # a retried detach succeeds again
            call("Detach", pb.DetachRequest(session=other), rid="d-1")
            call("Detach", pb.DetachRequest(session=other), rid="d-1")
            with pytest.raises(grpc.RpcError) as ei:
                call("Detach", pb.DetachRequest(session=other), rid="d-2")
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # a malformed request id is INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as ei:
                call("Heartbeat", pb.HeartbeatRequest(session=ref), rid="bad id with spaces")
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            check_law(c.stats())
            c.check_invariants()
        finally:
            ch.close()


def test_a_retry_after_a_client_timeout_allocates_once():
    with ThreadedServer(CONFIG) as srv:
        c = srv.client(timeout_s=0.3, retries=6)
        s = c.attach("slow").session
        blocked, release = threading.Event(), threading.Event()

        def block(server: object) -> None:  # holds the server's loop until the client has retried
            blocked.set()
            release.wait(STATE_BOUND_S)

        def release_after_a_retry() -> None:
            deadline = time.monotonic() + STATE_BOUND_S
            while c.retried < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            release.set()

        blocker = threading.Thread(target=lambda: srv.call(block), daemon=True)
        blocker.start()
        assert blocked.wait(STATE_BOUND_S), "the server's loop never ran the blocker"
        releaser = threading.Thread(target=release_after_a_retry, daemon=True)
        releaser.start()
        res = c.alloc_extend(s, [ExtendItem("slow", np.arange(1, 65, dtype=np.int32))])[0]
        releaser.join(STATE_BOUND_S)
        blocker.join(STATE_BOUND_S)
        assert c.retried >= 1, "the first try should have run into its deadline"
        st = c.stats()
        assert st.requests == 1 and st.kv_held == 64 == len(res.out_cache_loc), st
        check_law(st)
        c.check_invariants()
        hits = srv.call(lambda server: server.servicer.replies.hits)
        print(f"RELIABILITY idempotency retries={c.retried} reply_cache_hits={hits}")


def test_a_reply_lost_after_the_engine_ran_is_replayed_not_rerun():
    """The manager allocates, but its reply comes after the client's deadline (injected
    delay): the retry is answered from the reply cache."""
    with ThreadedServer(CONFIG) as srv:
        c = srv.client(timeout_s=0.3, retries=4)
        s = c.attach("late").session
        srv.call(lambda server: server.servicer.reply_delays.update(AllocExtend=0.6))
        res = c.alloc_extend(s, [ExtendItem("late", np.arange(1, 33, dtype=np.int32))])[0]
        hits = srv.call(lambda server: server.servicer.replies.hits)
        assert c.retried >= 1 and hits >= 1, (c.retried, hits)
        st = c.stats()
        assert st.requests == 1 and st.kv_held == 32 == len(res.out_cache_loc), st
        assert res.start == 0 and res.seq_len == 32
        c.check_invariants()
        print(f"RELIABILITY idempotency_lost_reply retries={c.retried} reply_cache_hits={hits}")


def test_reply_cache_bounds():
    cache = ReplyCache(per_scope=2, max_bytes=10)
    for i in range(3):
        cache.store("s", f"r{i}", b"k", b"abc")
    assert cache.lookup("s", "r0", b"k") is None and cache.lookup("s", "r2", b"k") == b"abc"
    cache.store("t", "r", b"k", b"abcdef")  # 6 + 6 > 10: the oldest goes
    assert cache.bytes <= 10
    cache.check_invariants()
    assert cache.retain(["t"], now=0.0, grace_s=1.0) == 0  # "s" just ended: kept for the grace
    assert cache.retain(["t"], now=2.0, grace_s=1.0) == 1
    cache.check_invariants()
