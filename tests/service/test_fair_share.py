"""Round-robin turns of the manager loop's engine work across sessions
(``service/server/fair_share.py``): the order of service, never its timing."""
from __future__ import annotations

import asyncio
import os
import tempfile
from collections import deque

import numpy as np
import pytest
from radixkv.service.server.fair_share import FairShare
from radixkv.service.server.manager import CacheManagerServer, ServeOptions
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.auth import Token
from radixkv.service.wire.step import FRAME, SOCKET_VERSION

from radixkv.engine import EngineConfig
from radixkv.errors import InvariantError


async def _one_turn(share: FairShare, key: str, order: list[str]) -> None:
    async with share.turn(key):
        order.append(key)


def test_turns_go_round_robin_across_sessions_not_in_arrival_order():
    """While a turn is held, A asks for 3 turns, then B for 2, then C for 1: they are served
    A B C A B A (FIFO would serve A A A B B C)."""
    order: list[str] = []

    async def main() -> None:
        share = FairShare()

        async with share.turn("holder"):
            tasks = [asyncio.ensure_future(_one_turn(share, k, order)) for k in "AAABBC"]
            for _ in range(3):
                await asyncio.sleep(0)  # every task is queued now
            assert share.waiting() == {"A": 3, "B": 2, "C": 1}
            share.check_invariants()
        await asyncio.gather(*tasks)
        assert share.waiting() == {} and share.waited == 6
        share.check_invariants()

    asyncio.run(main())
    assert order == list("ABCABA"), order


def test_a_cancelled_waiter_leaves_its_place_and_a_cancelled_grant_passes_the_turn_on():
    order: list[str] = []

    async def main() -> None:
        share = FairShare()

        async with share.turn("holder"):
            a, b, c = (asyncio.ensure_future(_one_turn(share, k, order)) for k in "ABC")
            await asyncio.sleep(0)
            b.cancel()  # still waiting: dropped from its queue
            await asyncio.sleep(0)
            assert share.waiting() == {"A": 1, "C": 1}
        a.cancel()  # granted (the release above), cancelled before it ran: C gets the turn
        await asyncio.gather(a, b, c, return_exceptions=True)
        share.check_invariants()
        async with share.turn("D"):  # nothing held: taken at once
            assert share.waiting() == {}

    asyncio.run(main())
    assert order == ["C"], order


def test_check_invariants_names_a_settled_waiter():
    async def main() -> None:
        share = FairShare()
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        share._waiting["s1"] = deque([fut])
        share._held = "h"
        with pytest.raises(InvariantError, match="'s1'"):
            share.check_invariants()

    asyncio.run(main())


def _frame(msg: bytes) -> bytes:
    return FRAME.pack(len(msg)) + msg


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
    return await reader.readexactly(n)


def test_a_call_arriving_during_a_large_match_runs_before_the_matchs_next_slice():
    """Session A sends a Match of 300 queries (5 slices) over the Step socket; while its
    first slice runs, session B's one-query Match arrives on another connection. B is served
    right after A's first slice; before the fair share it waited for two more slices (the
    slice's continuation was queued ahead of the frame's read and its task's wake-up)."""
    order: list[str] = []
    token = Token("t" * 32)
    sock_dir = tempfile.mkdtemp(prefix="radixkv-fair-")
    opts = ServeOptions(address=f"unix://{sock_dir}/m.sock", sweep_interval_s=60.0, grace_s=0.5)

    async def main() -> None:
        server = CacheManagerServer(EngineConfig(kv_tokens=2048, page_size=1, request_rows=32), token, opts)
        await server.start()
        try:
            sv = server.servicer
            assert sv is not None and server.step_socket is not None and server.step_socket.path is not None
            refs = {}
            for name in "AB":
                info = server.engine.attach(name)
                refs[name] = sv.session_keys.ref(info.session)
            names = {refs[n].session_id: n for n in "AB"}
            conns = {}
            for name in "AB":
                reader, writer = await asyncio.open_unix_connection(server.step_socket.path)
                writer.write(_frame(pb.StepHello(token=token.reveal(), version=SOCKET_VERSION).SerializeToString()))
                assert pb.StepResponse.FromString(await _read_frame(reader)).rides_replay
                conns[name] = (reader, writer)

            def match_step(name: str, n: int) -> bytes:
                req = pb.MatchRequest(session=refs[name], queries=[
                    pb.MatchQuery(token_ids_i32=wire.pack(np.arange(i % 50), wire.I32)) for i in range(n)])
                return _frame(pb.StepRequest(method="Match", request=req.SerializeToString()).SerializeToString())

            real = server.engine.match

            def match(session, queries):  # type: ignore[no-untyped-def]
                order.append(names[session.session_id])
                if order == ["A"]:  # A's first slice: B's frame is in the socket before the next poll
                    conns["B"][1].write(match_step("B", 1))
                return real(session, queries)

            server.engine.match = match  # type: ignore[method-assign]
            conns["A"][1].write(match_step("A", 300))
            for name in "AB":
                reply = pb.StepResponse.FromString(await _read_frame(conns[name][0]))
                assert not reply.HasField("error"), reply
            for _, writer in conns.values():
                writer.close()
            sv.check_all()
        finally:
            await server.stop()

    asyncio.run(main())
    if os.path.isdir(sock_dir) and not os.listdir(sock_dir):
        os.rmdir(sock_dir)
    assert order == ["A", "B", "A", "A", "A", "A"], order


def test_a_large_requests_count_against_the_limits_lets_other_calls_in():
    """A Match over 64 KiB is counted against the limits in steps of 128 queries with turns of
    the loop between them: a call ready meanwhile runs before the count ends, and a request
    over a limit is still refused naming it."""
    import types

    from radixkv.service.server.servicer import STEPPED_CHECK_BYTES, CacheManagerServicer
    from radixkv.service.wire.errors import RequestLimitError
    from radixkv.service.wire.limits import CallLimits

    raw = pb.MatchRequest(queries=[pb.MatchQuery(token_ids_i32=wire.pack(np.arange(16), wire.I32))
                                   for _ in range(1024)]).SerializeToString()
    assert len(raw) > STEPPED_CHECK_BYTES
    order: list[str] = []

    async def main(limits: CallLimits) -> pb.MatchRequest:
        servicer = types.SimpleNamespace(limits=limits)

        async def other_call() -> None:
            order.append("other")

        ready = asyncio.ensure_future(other_call())
        try:
            req = await CacheManagerServicer.parse_request_async(servicer, pb.MatchRequest, raw, "Match")  # type: ignore[arg-type]
            order.append("parsed")
            return req
        finally:
            await ready

    assert len(asyncio.run(main(CallLimits(1024, 1 << 20, 1024))).queries) == 1024
    assert order == ["other", "parsed"], order
    with pytest.raises(RequestLimitError, match="max_items=1000"):
        asyncio.run(main(CallLimits(1000, 1 << 20, 1000)))
