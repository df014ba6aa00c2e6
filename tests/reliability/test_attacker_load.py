"""Load with an attacker present (issue 17), bounded: two legitimate workers run a fixed
mixed workload while an authenticated abuser sends the largest calls the limits allow (and
calls over them), and unauthenticated clients hold health streams and idle connections.
Checked (never timing): every legitimate call succeeded, no legitimate lease expired, the
abuser's oversize calls were refused naming the limit, conservation and the invariants hold.
The latency figures with and without the abuser come from ``benchmarks/bench_attacker.py``.
"""
from __future__ import annotations

import socket
import threading

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from radixkv.service.server.manager import ServeOptions
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from reliability_util import check_law
from tooling.testing import ThreadedServer

from radixkv.engine.protocol import DecodeItem, ExtendItem, MatchQuery
from radixkv.errors import RadixKVError

CONFIG = dict(kv_tokens=8192, request_rows=64, max_context_len=512, lease_ttl_s=30.0)
STEPS = 40


def legit(c, name: str, errors: list, done: threading.Event) -> None:
    try:
        s = c.attach(name).session
        rng = np.random.default_rng(int(name[-1]))
        system = np.arange(64, dtype=np.int32)
        for k in range(STEPS):
            rids = [f"{name}-{k}-{i}" for i in range(4)]
            prompts = [np.concatenate([system, rng.integers(100, 30000, 24).astype(np.int32)]) for _ in rids]
            c.match(s, [MatchQuery(p) for p in prompts])
            c.alloc_extend(s, [ExtendItem(r, p) for r, p in zip(rids, prompts)])
            for t in range(4):
                c.alloc_decode(s, [DecodeItem(r, 7 + t) for r in rids])
            c.cache_finished(s, rids)
        c.heartbeat(s)  # still live: no lease expired meanwhile
        c.detach(s)
    except RadixKVError as e:  # every legitimate call must succeed
        errors.append(f"{name}: {type(e).__name__}: {e}")
    finally:
        done.set()


def test_legitimate_workers_are_unharmed_by_an_abuser():
    opts = ServeOptions(sweep_interval_s=0.1, grace_s=1.0, max_concurrent_rpcs=16, health_rpcs=4)
    with ThreadedServer(CONFIG, options=opts) as srv:
        limits = srv.server.servicer.limits
        path = srv.address[len("unix://"):]
        anon = [grpc.insecure_channel("unix:" + path) for _ in range(8)]
        watches = [health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest()) for ch in anon]
        idle = []
        for _ in range(20):
            sk = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sk.connect(path)
            idle.append(sk)
        abuser = srv.client()
        a = abuser.attach("abuser").session
        ref = wire.session_to_msg(a)
        per = limits.max_tokens // limits.max_items
        biggest = pb.MatchRequest(session=ref, queries=[
            pb.MatchQuery(token_ids_i32=wire.pack(np.arange(per) + i, wire.I32)) for i in range(limits.max_items)])
        over = pb.MatchRequest(session=ref, queries=[pb.MatchQuery()] * (limits.max_items + 1))
        ch = grpc.insecure_channel("unix:" + path, options=[("grpc.max_send_message_length", 64 << 20)])
        md = (("authorization", "Bearer " + srv.token),)
        match = ch.unary_unary("/radixkv.v1.CacheManager/Match")
        errors: list = []
        dones = [threading.Event(), threading.Event()]
        workers = [threading.Thread(target=legit, args=(srv.client(), f"legit{i}", errors, dones[i]))
                   for i in range(2)]
        codes: dict[str, int] = {}
        try:
            for w in workers:
                w.start()
            while not all(d.is_set() for d in dones):
                for req in (biggest, over):
                    try:
                        match(req.SerializeToString(), metadata=md, timeout=300)
                        code = "OK"
                    except grpc.RpcError as e:
                        code = e.code().name
                        if code == "RESOURCE_EXHAUSTED":
                            assert "max_items" in e.details()
                    codes[code] = codes.get(code, 0) + 1
            for w in workers:
                w.join(300)
        finally:
            for w in watches:
                w.cancel()
            for sk in idle:
                sk.close()
            for c in anon + [ch]:
                c.close()
        assert not errors, errors
        assert codes.get("OK", 0) >= 1 and codes.get("RESOURCE_EXHAUSTED", 0) >= 1 and set(codes) <= {
            "OK", "RESOURCE_EXHAUSTED"}, codes
        abuser.detach(a)
        st = abuser.stats()
        check_law(st)
        assert st.requests == 0 and st.sessions == 0
        abuser.check_invariants()
