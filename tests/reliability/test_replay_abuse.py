"""The unauthenticated ZMQ replay endpoint under abuse (issue 34, item 6): answers go out in
bounded slices (the publisher's thread never holds the GIL for a whole flood), and malformed
requests are counted and logged once per period, not once each."""
from __future__ import annotations

import logging

import pytest

zmq = pytest.importorskip("zmq")

from radixkv.cache.kv_events import AllBlocksCleared  # noqa: E402
from radixkv.events import zmq_publisher  # noqa: E402
from radixkv.events.zmq_publisher import ZmqEventPublisher  # noqa: E402
from radixkv.events.zmq_replay import END_SEQ, ReplayBuffer  # noqa: E402

TIMEOUT_MS = 10_000


class FakeRouter:
    """A ROUTER socket's two calls: requests queued in, messages sent recorded."""

    def __init__(self, requests):
        self.requests = list(requests)
        self.sent = []

    def recv_multipart(self):
        return self.requests.pop(0)

    def send_multipart(self, frames):
        self.sent.append(tuple(frames))


def seq(n):
    return n.to_bytes(8, "big")


def publisher_with(batches: int, buffer_steps: int) -> ZmqEventPublisher:
    """A publisher (replay on) that has sent ``batches`` batches; and a DEALER on its replay."""
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=buffer_steps)
    for _ in range(batches):
        pub.publish([AllBlocksCleared()])
    assert pub.flush()
    return pub


def dealer(pub: ZmqEventPublisher):
    d = zmq.Context.instance().socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(pub.replay_endpoint)
    return d


def test_answers_go_out_in_slices_of_the_budget_in_order():
    kept = ReplayBuffer(10)
    for i in range(10):
        kept.record(i, b"p%d" % i)
    router = FakeRouter([[b"a", b"", seq(0)], [b"b", b"", seq(7)], [b"c", b"", seq(20)]])
    for _ in range(3):
        kept.accept(router)
    assert kept.pending == 3 and router.sent == []  # nothing sent while accepting
    slices = []
    while kept.pending:
        before = len(router.sent)
        assert kept.pump(router, 4) == len(router.sent) - before <= 4
        slices.append(len(router.sent) - before)
    # a: 10 batches + end; b: 3 + end; c: the end alone -- 16 messages in slices of at most 4
    assert slices == [4, 4, 4, 4]
    by = {}
    for ident, empty, s, p in router.sent:
        assert empty == b""
        by.setdefault(ident, []).append((s, p))
    assert by[b"a"] == [(seq(i), b"p%d" % i) for i in range(10)] + [(END_SEQ, b"")]
    assert by[b"b"] == [(seq(i), b"p%d" % i) for i in range(7, 10)] + [(END_SEQ, b"")]
    assert by[b"c"] == [(END_SEQ, b"")]
    assert kept.pump(router, 4) == 0


def test_a_flood_of_malformed_requests_is_answered_counted_and_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="radixkv.events.zmq_publisher")
    with publisher_with(1, buffer_steps=4) as pub:
        d = dealer(pub)
        try:
            for _ in range(200):
                d.send_multipart([b"", b"\x00\x01"])  # not 8 bytes
            for _ in range(200):
                assert d.poll(TIMEOUT_MS)
                assert d.recv_multipart() == [b"", END_SEQ, b""]
            d.send_multipart([b"", seq(0)])  # a good request is still served
            got = []
            while d.poll(TIMEOUT_MS):
                _, s, p = d.recv_multipart()
                got.append(s)
                if s == END_SEQ:
                    break
            assert got == [seq(0), END_SEQ]
            st = pub.stats()
            assert (st.replay_requests, st.bad_replay_requests) == (201, 200)
        finally:
            d.close()
    lines = [r for r in caplog.records if "malformed KV event replay" in r.getMessage()]
    assert len(lines) == 1 and "1 malformed" in lines[0].getMessage()


def test_the_publisher_thread_sends_at_most_a_slice_per_turn(monkeypatch):
    budgets = []
    real = ReplayBuffer.pump

    def spy(self, router, budget):
        n = real(self, router, budget)
        budgets.append((budget, n))
        return n

    monkeypatch.setattr(ReplayBuffer, "pump", spy)
    with publisher_with(1000, buffer_steps=1000) as pub:
        d = dealer(pub)
        try:
            for _ in range(3):
                d.send_multipart([b"", seq(0)])
            n = 0
            while n < 3 * 1001 and d.poll(TIMEOUT_MS):
                d.recv_multipart()
                n += 1
            assert n == 3 * 1001
        finally:
            d.close()
    turns = [(b, n) for b, n in budgets if n]
    assert all(b == zmq_publisher.REPLAY_MESSAGES_PER_TURN and n <= b for b, n in turns)
    assert len(turns) >= 3 * 1001 // zmq_publisher.REPLAY_MESSAGES_PER_TURN
