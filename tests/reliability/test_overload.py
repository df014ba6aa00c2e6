"""Overload: far more concurrent sessions and RPCs than the configured limits.

A real ``serve`` process with ``--max-sessions 8`` and ``--max-concurrent-rpcs 8``:

* 64 concurrent attaches: 8 get a session, the rest RESOURCE_EXHAUSTED (``CapacityError``);
* 1,200 concurrent heavy ``Match`` calls (40,000 tokens each) from one client: every call
  ends, each either OK or RESOURCE_EXHAUSTED, none runs into its deadline (no queue grows
  without bound, nothing hangs), some are refused, and the refusals are quick (measured and
  printed, never asserted: timing does not decide pass/fail).

Afterwards the server answers normally and its invariants hold.
"""
from __future__ import annotations

import asyncio
import json
import time

import grpc
import numpy as np
from radixkv.service.client import connect
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from reliability_util import ServerProcess, check_law, percentiles

from radixkv.errors import CapacityError

LIMIT_SESSIONS, LIMIT_RPCS = 8, 8
DEADLINE_S = 60.0


def _flood(address: str, token: str, session: pb.SessionRef, n: int, tokens: int):
    """``n`` concurrent Match calls; returns [(code name, seconds)]."""
    target = "unix:" + address[len("unix://"):]
    query = pb.MatchQuery(token_ids_i32=np.arange(tokens, dtype="<i4").tobytes())
    req = pb.MatchRequest(session=session, queries=[query]).SerializeToString()
    md = (("authorization", "Bearer " + token),)

    async def main():
        async with grpc.aio.insecure_channel(target, options=[("grpc.enable_retries", 0)]) as ch:
            call = ch.unary_unary("/radixkv.v1.CacheManager/Match")

            async def one():
                t0 = time.perf_counter()
                try:
                    await call(req, metadata=md, timeout=DEADLINE_S)
                    code = "OK"
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                return code, time.perf_counter() - t0

            await ch.channel_ready()
            return await asyncio.gather(*(one() for _ in range(n)))

    return asyncio.run(main())


def test_overload_is_refused_quickly_and_never_queues_without_bound():
    # --health-rpcs 1: gRPC's own limit (calls from their arrival) is --max-concurrent-rpcs plus
    # the health budget; keep it near the 8 this flood is sized for
    args = ["--kv-tokens", "4096", "--max-sessions", str(LIMIT_SESSIONS), "--max-concurrent-rpcs", str(LIMIT_RPCS),
            "--health-rpcs", "1", "--lease-ttl-s", "30", "--max-message-bytes", str(1 << 20),
            "--sweep-interval-s", "0.2"]
    with ServerProcess(args) as srv:
        with connect(srv.address, token=srv.token, wait_s=60) as c:
            # sessions: far more attaches than max_sessions, from threads at once
            from concurrent.futures import ThreadPoolExecutor

            def attach(i):
                t0 = time.perf_counter()
                try:
                    return "OK", time.perf_counter() - t0, c.attach(f"w{i}").session
                except CapacityError:
                    return "RESOURCE_EXHAUSTED", time.perf_counter() - t0, None

            with ThreadPoolExecutor(16) as ex:
                got = list(ex.map(attach, range(64)))
            ok = [s for code, _, s in got if code == "OK"]
            refused_attach = [t for code, t, _ in got if code != "OK"]
            assert len(ok) == LIMIT_SESSIONS and len(refused_attach) == 64 - LIMIT_SESSIONS
            for s in ok[1:]:
                c.detach(s)
            session = wire.session_to_msg(ok[0])

            t0 = time.monotonic()
            results = _flood(srv.address, srv.token, session, 1200, 40_000)
            wall = time.monotonic() - t0
            codes = {}
            for code, _ in results:
                codes[code] = codes.get(code, 0) + 1
            # never a deadline, never INTERNAL. Under a loaded CI machine a handful of the
            # 1,200 concurrent calls have come back CANCELLED (also a prompt answer, never a
            # hang); keep them rare and visible rather than unexplained.
            assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "CANCELLED"}, codes
            assert codes.get("CANCELLED", 0) <= 12, codes
            assert codes.get("RESOURCE_EXHAUSTED", 0) > 0 and codes.get("OK", 0) > 0, codes
            rejected = [t for code, t in results if code == "RESOURCE_EXHAUSTED"]
            served = [t for code, t in results if code == "OK"]
            # the server runs on, consistent
            st = c.stats()
            check_law(st)
            assert st.sessions == 1
            c.check_invariants()
            c.detach(ok[0])
            print("RELIABILITY overload " + json.dumps({
                "attach": {"calls": 64, "max_sessions": LIMIT_SESSIONS, "refused": len(refused_attach),
                           "refused_latency_ms": percentiles(refused_attach)},
                "match_flood": {"calls": len(results), "max_concurrent_rpcs": LIMIT_RPCS, "codes": codes,
                                "wall_s": round(wall, 2), "refused_latency_ms": percentiles(rejected),
                                "served_latency_ms": percentiles(served)}}))


def test_calls_beyond_the_limit_are_answered_at_once_not_queued():
    """Eight slow calls (their replies held back 3 s by fault injection) fill the limit of 8;
    100 more calls are all refused RESOURCE_EXHAUSTED, every one of them before any slow
    call has finished (so none waited in a queue), and the slow calls then succeed."""
    from radixkv.service.server.manager import ServeOptions
    from radixkv.service.wire.request_id import REQUEST_ID_KEY
    from tooling.testing import ThreadedServer

    opts = ServeOptions(sweep_interval_s=0.2, grace_s=1.0, max_concurrent_rpcs=LIMIT_RPCS)
    with ThreadedServer({"kv_tokens": 256}, options=opts) as srv:
        c = srv.client()
        s = c.attach("slow").session
        ref = wire.session_to_msg(s)
        srv.call(lambda server: server.servicer.reply_delays.update(Heartbeat=3.0))
        ch = grpc.insecure_channel("unix:" + srv.address[len("unix://"):])
        md = (("authorization", "Bearer " + srv.token),)
        beat = ch.unary_unary("/radixkv.v1.CacheManager/Heartbeat")
        stats = ch.unary_unary("/radixkv.v1.CacheManager/Stats")
        try:
            slow = [beat.future(pb.HeartbeatRequest(session=ref).SerializeToString(),
                                metadata=md + ((REQUEST_ID_KEY, f"slow-{i}"),), timeout=60)
                    for i in range(LIMIT_RPCS)]
            time.sleep(0.5)  # let them reach the server
            lat, codes = [], {}
            for _ in range(100):
                t0 = time.perf_counter()
                try:
                    stats(pb.StatsRequest().SerializeToString(), metadata=md, timeout=60)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                lat.append(time.perf_counter() - t0)
                codes[code] = codes.get(code, 0) + 1
            finished_early = [f for f in slow if f.done()]
            assert codes == {"RESOURCE_EXHAUSTED": 100}, codes
            assert not finished_early, "a refused call waited for a slot: it was queued"
            for f in slow:
                f.result()  # the slow ones complete normally
            srv.call(lambda server: server.servicer.reply_delays.clear())
            c.check_invariants()
            print("RELIABILITY overload_saturated " + json.dumps({
                "limit": LIMIT_RPCS, "refused": codes, "refused_latency_ms": percentiles(lat)}))
        finally:
            ch.close()
