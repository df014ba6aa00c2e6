"""The gRPC ``Step`` stream against a raw HTTP/2 client that leaves a message unfinished
(issue 34, item 5): grpc core holds the message's bytes until it is whole, and the only
bound is ``--max-message-bytes`` (``grpc.max_receive_message_length``) per stream, and
``--max-concurrent-rpcs`` streams across connections; nothing the manager runs sees a partial
message (docs/reliability.md). Counts decide, never timing."""
from __future__ import annotations

from radixkv.service.server.manager import ServeOptions
from test_step_socket import CONFIG
from tooling.raw_h2 import PartialStep
from tooling.testing import ThreadedServer

MIB = 1 << 20
BUDGET_S = 60.0  # how long the client may push a body: generous, never a measure
RESOURCE_EXHAUSTED = "8"


def step(srv: ThreadedServer, announce: int) -> PartialStep:
    return PartialStep(srv.options.address[len("unix://"):], srv.token, announce, BUDGET_S)


def test_a_message_announced_over_max_message_bytes_is_refused():
    # 2 MiB is under grpc's 4 MiB default: refused only because --max-message-bytes applies
    with ThreadedServer(CONFIG, options=ServeOptions(max_message_bytes=MIB)) as srv:
        p = step(srv, 2 * MIB)
        try:
            assert p.wait_end(BUDGET_S) and p.status() == RESOURCE_EXHAUSTED, [type(e).__name__ for e in p.events]
        finally:
            p.close()


def test_an_unfinished_message_within_max_message_bytes_is_held_whole_and_open():
    with ThreadedServer(CONFIG, options=ServeOptions(max_message_bytes=8 * MIB)) as srv:
        p = step(srv, 6 * MIB)
        try:
            assert p.sent == 6 * MIB - 1 and not p.ended()  # the open item: held, no deadline
            c = srv.client()  # a worker's calls are unaffected
            c.heartbeat(c.attach("w").session)
        finally:
            p.close()


def test_streams_holding_unfinished_messages_are_capped_by_max_concurrent_rpcs():
    # the cap across connections: each held stream takes a call slot; one past them is
    # refused after at most the initial HTTP/2 window (64 KiB), not its announced size
    with ThreadedServer(CONFIG, options=ServeOptions(max_message_bytes=2 * MIB, max_concurrent_rpcs=3)) as srv:
        held = [step(srv, MIB) for _ in range(3)]
        extra = step(srv, MIB)
        try:
            assert [p.sent for p in held] == [MIB - 1] * 3 and not any(p.ended() for p in held)
            assert extra.wait_end(BUDGET_S) and extra.status() == RESOURCE_EXHAUSTED
            assert extra.sent < 64 * 1024
        finally:
            for p in held + [extra]:
                p.close()
