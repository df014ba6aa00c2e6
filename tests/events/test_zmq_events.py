"""The ZMQ outlet: vLLM's [topic, seq, payload] PUB messages, decoded the way vLLM's
subscriber decodes them, sequence numbers, the replay ROUTER (late joiners, lagging
subscribers, the bounded buffer), the synchronous mode, flags and the lifecycle."""
import argparse
import threading
import time

import numpy as np
import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from test_vllm_wire import vllm_structs  # noqa: E402  (tests/ is on sys.path under pytest)

from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from radixkv.cache.radix_cache import RadixCache  # noqa: E402
from radixkv.errors import CapacityError, InvalidArgumentError, InvariantError  # noqa: E402
from radixkv.events.sources import drain_events  # noqa: E402
from radixkv.events.vllm_wire import decode_batch  # noqa: E402
from radixkv.events.zmq_flags import add_arguments, from_args  # noqa: E402
from radixkv.events.zmq_publisher import ZmqEventPublisher  # noqa: E402
from radixkv.events.zmq_replay import END_SEQ  # noqa: E402

TIMEOUT_MS = 5000


class VllmSubscriber:
    """vLLM's subscriber logic (examples/online_serving/kv_events_subscriber.py): SUB on the
    topic, msgspec decoding, gap detection by ``seq``, replay of what was missed. The replay
    socket is a DEALER sending ``[b"", start]`` (a REQ's framing): libzmq's REQ takes only
    the first of the ROUTER's replies, which ``test_req_client_gets_the_first_reply`` shows."""

    def __init__(self, ctx, endpoint, replay_endpoint, topic=""):
        self.decoder = msgspec.msgpack.Decoder(vllm_structs(True)[0])
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(replay_endpoint)
        self.last_seq = -1
        self.batches = {}  # seq -> decoded batch
        self.replayed = 0
        self.topics = set()

    def ask_replay(self, start, upto=None):
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        while self.replay.poll(TIMEOUT_MS):
            _, seq_bytes, payload = self.replay.recv_multipart()
            if not payload:
                assert seq_bytes == END_SEQ
                return
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.last_seq:
                self.batches[seq] = self.decoder.decode(payload)
                self.last_seq = seq
                self.replayed += 1
        raise AssertionError("replay stream did not end")

    def poll(self, timeout_ms):
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        self.topics.add(topic)
        seq = int.from_bytes(seq_bytes, "big")
        if seq > self.last_seq + 1:
            self.ask_replay(self.last_seq + 1)
        if seq > self.last_seq:
            self.batches[seq] = self.decoder.decode(payload)
            self.last_seq = seq
        return True

    def close(self):
        self.sub.close()
        self.replay.close()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def workload_batches(n, seed=0):
    """``n`` event batches of a real RadixCache: inserts, evictions, one reset."""
    cache = RadixCache(page_size=2, enable_kv_events=True)
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        cache.insert(rng.integers(0, 5, 6).astype(np.int32), np.arange(6), extra_key=["a", None][len(out) % 2])
        if rng.random() < 0.3:
            cache.evict(4)
        if len(out) == n // 2:
            cache.reset()
        ev = drain_events(cache)
        if ev:
            out.append(ev)
    return out


def same(vllm_events, ours):
    assert len(vllm_events) == len(ours)
    for v, o in zip(vllm_events, ours):
        assert type(v).__name__ == type(o).__name__
        if isinstance(o, (BlockStored, BlockRemoved)):
            assert v.block_hashes == list(o.block_hashes)
        if isinstance(o, BlockStored):
            assert v.token_ids == o.token_ids.tolist() and v.parent_block_hash == o.parent_block_hash


def endpoints(kind, tmp_path):
    if kind == "ipc":
        return f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/replay.sock"
    return "tcp://127.0.0.1:*", "tcp://127.0.0.1:*"


@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_late_subscriber_catches_up_through_replay(kind, tmp_path, ctx):
    batches = workload_batches(12)
    with ZmqEventPublisher(*endpoints(kind, tmp_path), topic="kv@m0") as pub:
        for b in batches[:5]:  # before anyone listens: only replay can deliver these
            pub.publish(b)
        assert pub.flush()
        sub = VllmSubscriber(ctx, pub.endpoint, pub.replay_endpoint, topic="kv")
        try:
            deadline = time.monotonic() + 10
            i = 5
            while sub.last_seq < len(batches) - 1:
                assert time.monotonic() < deadline, f"stuck at seq {sub.last_seq}"
                if i < len(batches):
                    assert pub.publish(batches[i]) == i  # numbers are 0, 1, 2, ...
                    i += 1
                sub.poll(20)
                if i == len(batches) and sub.last_seq < 0:
                    # PUB drops what it sends before the subscription is connected
                    # (ZMQ's slow joiner), so nothing may have arrived: ask from 0.
                    sub.ask_replay(0)
            assert sorted(sub.batches) == list(range(len(batches)))
            assert sub.replayed >= 5
            for seq, b in enumerate(batches):
                same(sub.batches[seq].events, b)
                assert sub.batches[seq].data_parallel_rank == 0
            assert pub.flush()
            pub.check_invariants()
            st = pub.stats()
            assert st.published == st.next_seq == len(batches) and st.oldest_seq == 0
            while not sub.poll(20):  # the live stream carries the topic frame
                assert time.monotonic() < deadline
                pub.publish([])
            assert sub.topics == {b"kv@m0"}
        finally:
            sub.close()


def test_lagging_subscriber_recovers_every_batch_in_order(ctx):
    """Seeded stress: tiny high-water marks make PUB drop batches a slow subscriber does
    not read; the subscriber still ends with every batch, in order, by replay."""
    batches = workload_batches(150, seed=5)
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", hwm=2) as pub:
        sub = VllmSubscriber(ctx, pub.endpoint, pub.replay_endpoint)
        sub.sub.setsockopt(zmq.RCVHWM, 2)
        try:
            while not sub.poll(10):  # wait for the subscription to be live
                pub.publish([])
            base = sub.last_seq + 1
            for b in batches:
                pub.publish(b)
            assert pub.flush()
            while sub.poll(200):  # read what survived the drops
                pass
            if sub.last_seq < base + len(batches) - 1:  # the tail was dropped: ask for it
                sub.ask_replay(sub.last_seq + 1)
            got = [sub.batches[base + i] for i in range(len(batches))]
            for g, b in zip(got, batches):
                same(g.events, b)
            pub.check_invariants()
        finally:
            sub.close()


def test_replay_buffer_is_bounded_and_malformed_requests_get_the_end_marker(ctx):
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=3) as pub:
        for _ in range(6):
            pub.publish([AllBlocksCleared()])
        assert pub.flush()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(pub.replay_endpoint)
        try:
            d.send_multipart([b"", (0).to_bytes(8, "big")])
            seqs = []
            while d.poll(TIMEOUT_MS):
                _, s, p = d.recv_multipart()
                if s == END_SEQ:
                    assert p == b""
                    break
                seqs.append(int.from_bytes(s, "big"))
                assert decode_batch(p).events == [AllBlocksCleared()]
            assert seqs == [3, 4, 5]
            d.send_multipart([b"", b"\x00\x01"])  # not 8 bytes
            assert d.poll(TIMEOUT_MS)
            assert d.recv_multipart() == [b"", END_SEQ, b""]
            st = pub.stats()
            assert (st.buffered, st.oldest_seq, st.replay_requests, st.bad_replay_requests) == (3, 3, 2, 1)
            pub.check_invariants()
        finally:
            d.close()


def test_req_client_gets_the_first_reply(ctx):
    """vLLM's example subscriber replays through a REQ socket: libzmq delivers it the first
    reply only (then the REQ expects to send). The server side is vLLM's either way."""
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as pub:
        for _ in range(3):
            pub.publish([])
        assert pub.flush()
        r = ctx.socket(zmq.REQ)
        r.setsockopt(zmq.LINGER, 0)
        r.connect(pub.replay_endpoint)
        try:
            r.send((1).to_bytes(8, "big"))
            assert r.poll(TIMEOUT_MS)
            seq, payload = r.recv_multipart()
            assert int.from_bytes(seq, "big") == 1 and decode_batch(payload).events == []
        finally:
            r.close()


def test_synchronous_mode(ctx, tmp_path):
    pub = ZmqEventPublisher(f"ipc://{tmp_path}/s.sock", f"ipc://{tmp_path}/r.sock", background=False,
                            data_parallel_rank=3, layout="map")
    try:
        events = [BlockRemoved((7,), "GPU")]
        assert [pub.publish(events, ts=1.0) for _ in range(3)] == [0, 1, 2]
        assert pub.stats().published == 3
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(pub.replay_endpoint)
        d.send_multipart([b"", (2).to_bytes(8, "big")])
        assert pub.serve_replay(TIMEOUT_MS) == 1
        assert d.poll(TIMEOUT_MS)
        _, s, p = d.recv_multipart()
        b = msgspec.msgpack.Decoder(vllm_structs(False)[0]).decode(p)  # map layout, vLLM's decoder
        assert int.from_bytes(s, "big") == 2 and b.data_parallel_rank == 3 and b.events[0].block_hashes == [7]
        assert d.poll(TIMEOUT_MS) and d.recv_multipart()[1] == END_SEQ
        d.close()
        pub.check_invariants()
    finally:
        pub.close()
    pub.close()  # idempotent
    with pytest.raises(InvalidArgumentError, match="closed"):
        pub.publish([])
    assert not list(tmp_path.iterdir()), "close() left the ipc socket files"  # libzmq does not remove them


def test_full_queue_raises_capacity_and_takes_no_number(monkeypatch):
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", max_queue_size=1, put_timeout_s=0)
    gate = threading.Event()
    real_send = pub._send

    def slow_send(seq, payload):
        gate.wait(10)
        real_send(seq, payload)

    monkeypatch.setattr(pub, "_send", slow_send)
    try:
        assert pub.publish([]) == 0
        deadline = time.monotonic() + 5
        while pub.stats().queued and time.monotonic() < deadline:  # the thread holds batch 0
            time.sleep(0.001)
        assert pub.publish([]) == 1  # waits in the queue
        with pytest.raises(CapacityError):
            pub.publish([])
        assert pub.stats().next_seq == 2
    finally:
        gate.set()
        pub.close()
    st = pub.stats()
    assert (st.published, st.next_seq) == (2, 2)
    pub.check_invariants()


def test_bad_arguments_and_endpoints_leave_nothing_open(tmp_path):
    for kw in ({"buffer_steps": 0}, {"layout": "json"}, {"state_events": "maybe"}, {"topic": 3},
               {"data_parallel_rank": -1}, {"hwm": -1}):
        with pytest.raises(InvalidArgumentError):
            ZmqEventPublisher("tcp://127.0.0.1:*", **kw)
    with ZmqEventPublisher("tcp://127.0.0.1:*") as pub:
        with pytest.raises(InvalidArgumentError, match="cannot open"):
            ZmqEventPublisher(pub.endpoint.replace("127.0.0.1", "*"))  # port taken
        with pytest.raises(InvalidArgumentError, match="cannot open"):
            ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint=pub.endpoint, background=False)
        with pytest.raises(InvalidArgumentError):
            pub.serve_replay()
        with pytest.raises(InvalidArgumentError):
            pub.publish([object()])
        assert pub.stats().next_seq == 0  # a refused batch takes no number


def test_invariant_audit_names_the_broken_sequence():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", background=False)
    try:
        for _ in range(3):
            pub.publish([])
        pub._kept._buffer[1] = (7, pub._kept._buffer[1][1])  # corrupt the replay buffer
        with pytest.raises(InvariantError, match=r"missing seqs \[1\]"):
            pub.check_invariants()
    finally:
        pub.close()


def test_flags():
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert from_args(p.parse_args([])) is None
    args = p.parse_args(["--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint",
                         "tcp://127.0.0.1:*", "--kv-events-topic", "kv", "--kv-events-buffer-steps", "5",
                         "--kv-events-layout", "map"])
    pub = from_args(args, background=False)
    try:
        assert pub.topic == "kv" and pub.layout == "map" and pub.buffer_steps == 5
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and pub.replay_endpoint is not None
    finally:
        pub.close()


def test_serve_flags_carry_the_outlet_into_serve_options():
    from radixkv.service.server.cli import add_serve_arguments, serve_options_from_args
    from radixkv.service.server.manager import ServeOptions

    from radixkv.events.zmq_flags import PublisherConfig, config_from_args

    p = add_serve_arguments(argparse.ArgumentParser())
    off = serve_options_from_args(p.parse_args([]))
    assert off.kv_events is None and off.events_ring_size == ServeOptions().events_ring_size  # off by default
    on = serve_options_from_args(p.parse_args([
        "--kv-events-endpoint", "ipc:///run/kv.sock", "--kv-events-replay-endpoint", "tcp://*:5558",
        "--kv-events-topic", "kv@m1", "--kv-events-ring-size", "128", "--kv-events-state-events", "inline"]))
    assert on.kv_events == PublisherConfig("ipc:///run/kv.sock", "tcp://*:5558", "kv@m1", state_events="inline")
    assert on.events_ring_size == 128
    assert config_from_args(p.parse_args([])) is None
