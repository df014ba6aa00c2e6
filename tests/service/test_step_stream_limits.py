"""The gRPC ``Step`` stream against a raw HTTP/2 client that leaves a message unfinished
(issue 34, item 5): grpc core holds the message's bytes until it is whole, and the only
bound is ``--max-message-bytes`` (``grpc.max_receive_message_length``) per stream; nothing
the manager runs sees a partial message (docs/reliability.md). Counts decide, never timing."""
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
