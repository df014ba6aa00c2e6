"""Issue 17, item 7: what one authenticated worker can do to another's session.

A session is bound to the secret its Attach returned (the id alone is no credential), and
Attach's idempotency keys are scoped per client (its ``client_nonce``)."""
from __future__ import annotations

import grpc
import numpy as np
import pytest
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire._gen import cache_manager_pb2_grpc as pb_grpc
from radixkv.service.wire.errors import SessionSecretError
from radixkv.service.wire.request_id import REQUEST_ID_KEY
from tooling.testing import ThreadedServer

from radixkv.engine.protocol import DecodeItem, ExtendItem, MatchQuery, Session
from radixkv.errors import NotFoundError, PermissionDeniedError, StaleSessionError


def _toks(n: int) -> np.ndarray:
    return np.arange(1, n + 1, dtype=np.int32)


def test_a_session_id_alone_cannot_end_detach_or_act_in_a_session():
    with ThreadedServer({"kv_tokens": 256}) as srv:
        victim, abuser = srv.client(), srv.client()
        s = victim.attach("victim").session
        assert len(s.secret) == 32 and s.secret.hex() not in repr(s)
        victim.alloc_extend(s, [ExtendItem("r1", _toks(8))])
        known = Session(s.session_id, s.epoch, s.lease_ttl_s)  # what a log or a stats line shows
        own = abuser.attach("abuser").session

        # a KeepAlive opened and closed for the victim's id: refused, the victim's session lives on
        ka = abuser.start_keepalive(known, interval_s=0.05)
        ka._thread.join(10)
        assert isinstance(ka.error, SessionSecretError) and isinstance(ka.error, PermissionDeniedError)
        ka.stop()
        with pytest.raises(SessionSecretError):
            abuser.detach(known)
        with pytest.raises(SessionSecretError):
            abuser.release(known, ["r1"])
        with pytest.raises(SessionSecretError):
            abuser.cache_finished(known, ["r1"])
        with pytest.raises(SessionSecretError):
            abuser.alloc_extend(known, [ExtendItem("r2", _toks(4))])
        with pytest.raises(SessionSecretError):
            abuser.alloc_decode(known, [DecodeItem("r1", 7)])
        with pytest.raises(SessionSecretError):
            abuser.match(known, [MatchQuery(_toks(4))])
        with pytest.raises(SessionSecretError):  # another session's secret is no better
            abuser.heartbeat(known._replace(secret=own.secret))
        with pytest.raises(SessionSecretError):
            list(abuser.watch_events(known))

        # nothing happened to the victim: its request and lease are intact, it carries on
        st = victim.stats(s)
        assert st.requests == 1, st
        assert victim.heartbeat(s) > 0
        victim.cache_finished(s, ["r1"])
        victim.detach(s)
        # a stale session is still FAILED_PRECONDITION, secret or not (workers re-attach on it)
        with pytest.raises(StaleSessionError):
            abuser.heartbeat(known)
        abuser.detach(own)
        victim.check_invariants()
        victim.close()
        abuser.close()


def _attach_raw(stub, token: str, rid: str, nonce: bytes, name: str = "w") -> pb.AttachResponse:
    md = (("authorization", f"Bearer {token}"), (REQUEST_ID_KEY, rid))
    return stub.Attach(pb.AttachRequest(worker_name=name, pid=0, client_nonce=nonce), metadata=md, timeout=10)


def test_attach_idempotency_keys_are_scoped_per_client():
    with ThreadedServer({"kv_tokens": 256}) as srv:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.CacheManagerStub(ch)
            a = _attach_raw(stub, srv.token, "same-id", b"a" * 16)
            assert _attach_raw(stub, srv.token, "same-id", b"a" * 16) == a  # a retry: the kept reply
            b = _attach_raw(stub, srv.token, "same-id", b"b" * 16)  # another client, same request bytes
            assert b.session.session_id != a.session.session_id and b.session.secret != a.session.secret
            with pytest.raises(grpc.RpcError) as e:  # without a nonce an Attach cannot be retried safely
                _attach_raw(stub, srv.token, "other-id", b"")
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        c = srv.client()
        st = c.stats()
        assert st.sessions == 2, st
        for ref in (a.session, b.session):
            c.detach(wire.session_from_msg(ref))
        c.close()



def test_request_ids_are_per_session_over_the_wire():
    """Another worker's rid is NOT_FOUND, worded as one nobody holds (no probing), and free to
    use for its own request; the victim's request is untouched."""
    with ThreadedServer({"kv_tokens": 256}) as srv:
        victim, abuser = srv.client(), srv.client()
        s = victim.attach("victim").session
        (v,) = victim.alloc_extend(s, [ExtendItem("r1", _toks(8))])
        own = abuser.attach("abuser").session
        probes = {}
        for rid in ("r1", "never-used"):
            with pytest.raises(NotFoundError) as e:
                abuser.cache_finished(own, [rid])
            probes[rid] = e.value
        assert type(probes["r1"]) is type(probes["never-used"])
        assert str(probes["r1"]).replace("r1", "never-used") == str(probes["never-used"])
        (a,) = abuser.alloc_extend(own, [ExtendItem("r1", _toks(3))])  # the same id, its own request
        assert a.req_pool_idx != v.req_pool_idx and a.seq_len == 3
        abuser.release(own, ["r1"])
        assert victim.stats(s).requests == 1
        assert victim.alloc_decode(s, [DecodeItem("r1", 9)]).seq_lens.tolist() == [9]
        victim.cache_finished(s, ["r1"])
        victim.detach(s)
        abuser.detach(own)
        victim.check_invariants()
        victim.close()
        abuser.close()
