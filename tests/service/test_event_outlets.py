"""The manager process publishes its events itself, on every outlet, as ONE sequence.

A real ``radixkv serve`` process (spawned) with the ZMQ outlet on ``ipc://`` endpoints; two
workers' sessions insert, evict and flush through the client. Then:

(a) a ZMQ SUB subscriber decoding with ``radixkv.events.vllm_wire``, (b) two concurrent gRPC
``WatchEvents`` streams and ``TakeEvents`` all see the same events in the same order, with
consecutive sequence numbers (per batch on ZMQ, per event on gRPC); (c) a late ZMQ subscriber
catches up through the replay socket; (d) with ``ai-dynamo-runtime``, the events taken off
the ZMQ socket, fed through the Dynamo adapter into ``dynamo._core.RadixTree``, score
exactly as ``match`` on that manager; and the graceful shutdown publishes a last
``AllBlocksCleared`` before closing the sockets.
"""
import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest

zmq = pytest.importorskip("zmq")

from radixkv.service.client import connect  # noqa: E402
from service_util import start_server, stop_server  # noqa: E402

from radixkv.engine.protocol import ExtendItem, MatchQuery  # noqa: E402
from radixkv.events.vllm_wire import decode_batch  # noqa: E402
from radixkv.events.zmq_replay import END_SEQ  # noqa: E402

PS = 4
TOPIC = "kv@m0"
WAIT_S = 15


class Subscriber:
    """vLLM's subscriber protocol: SUB on the topic, gap detection by ``seq``, replay from a
    DEALER on the ROUTER; batches decoded with ``radixkv.events.vllm_wire.decode_batch``."""

    def __init__(self, ctx, endpoint, replay_endpoint):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(replay_endpoint)
        self.batches = {}  # seq -> list of events
        self.live = 0
        self.replayed = 0

    @property
    def next_seq(self):
        return max(self.batches, default=-1) + 1

    def ask_replay(self, start):
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        while self.replay.poll(WAIT_S * 1000):
            _, seq_bytes, payload = self.replay.recv_multipart()
            if seq_bytes == END_SEQ:
                assert payload == b""
                return
            self.batches.setdefault(int.from_bytes(seq_bytes, "big"), decode_batch(payload).events)
            self.replayed += 1
        raise AssertionError("the replay stream did not end")

    def poll(self, timeout_ms):
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == TOPIC.encode()
        seq = int.from_bytes(seq_bytes, "big")
        if seq > self.next_seq:  # a gap (or a late join): ask for what was missed
            self.ask_replay(self.next_seq)
        self.batches.setdefault(seq, decode_batch(payload).events)
        self.live += 1
        return True

    def events(self):
        assert sorted(self.batches) == list(range(len(self.batches))), "ZMQ batch seqs not consecutive"
        return [e.to_dict() for s in range(len(self.batches)) for e in self.batches[s]]

    def wait_for(self, n_events, deadline):
        while sum(map(len, self.batches.values())) < n_events:
            assert time.monotonic() < deadline, f"ZMQ: {sum(map(len, self.batches.values()))} of {n_events} events"
            self.poll(50)

    def close(self):
        self.sub.close()
        self.replay.close()


class Watcher:
    """A gRPC WatchEvents stream (from seq 0) read by a thread on its own connection."""

    def __init__(self, srv):
        self.client = connect(srv.address, token=srv.token, wait_s=30)
        self.session = self.client.attach("watcher").session
        self.got = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        for seq, ev in self.client.watch_events(self.session, poll_interval_s=0.01, with_seq=True):
            self.got.append((seq, ev))

    def wait_for(self, n_events, deadline):
        while len(self.got) < n_events:
            assert time.monotonic() < deadline, f"watcher: {len(self.got)} of {n_events} events"
            time.sleep(0.01)


def workload(clients, sessions, rng, steps, step0=0):
    """Two workers' requests over shared prefixes (namespaces None / "lora-a"), each cached
    when finished; evictions now and then (the pool is small, so inserts evict as well)."""
    prefixes = [rng.integers(0, 50, 8 * PS).astype(np.int32) for _ in range(3)]
    for step in range(step0, step0 + steps):
        w = step % 2
        p = prefixes[int(rng.integers(0, 3))][: PS * int(rng.integers(1, 9))]
        toks = np.concatenate([p, rng.integers(0, 50, PS * int(rng.integers(0, 4))).astype(np.int32)])
        key = [None, "lora-a"][int(rng.integers(0, 2))]
        clients[w].alloc_extend(sessions[w], [ExtendItem(f"r{step}", toks, key)])
        clients[w].cache_finished(sessions[w], [f"r{step}"])
        if step % 7 == 6:
            clients[w].evict(sessions[w], int(rng.integers(1, 4 * PS)))
    return prefixes


class Run:
    """What the scenario saw (filled by the ``run`` fixture)."""

    phase1 = None       # the events of the workload, as TakeEvents gave them
    everything = None   # all events before the shutdown, in order
    zmq_phase1 = None   # the events the first SUB decoded for the workload (objects)
    matches = None      # [(tokens, extra_key, the manager's match in pages)] before the flush
    late_replayed = 0


@pytest.fixture(scope="module")
def run():
    """The scenario; every outlet's view checked on the way (its asserts are the test)."""
    d = tempfile.mkdtemp(prefix="rkv-ev-")  # short: ipc paths are limited to ~100 bytes
    pub, rep = f"ipc://{d}/pub", f"ipc://{d}/replay"
    srv = start_server(["--device", "cpu", "--kv-tokens", "256", "--page-size", str(PS), "--enable-kv-events",
                        "--lease-ttl-s", "30", "--grace-s", "2", "--sweep-interval-s", "0.2",
                        "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep,
                        "--kv-events-topic", TOPIC, "--kv-events-interval-s", "0.002"])
    ctx = zmq.Context()
    subs, watchers, clients = [], [], []
    r = Run()
    try:
        sub = Subscriber(ctx, pub, rep)
        subs.append(sub)
        watchers[:] = [Watcher(srv), Watcher(srv)]
        clients[:] = [connect(srv.address, token=srv.token, wait_s=30) for _ in range(2)]
        sessions = [c.attach(f"worker-{i}").session for i, c in enumerate(clients)]
        time.sleep(0.3)  # let the SUB connect (ZMQ's slow joiner); a miss is replayed anyway
        rng = np.random.default_rng(7)
        prefixes = workload(clients, sessions, rng, 30)

        # TakeEvents: its own cursor from seq 0, not competing with the watchers or ZMQ
        taken = clients[0].take_events(sessions[0])
        kinds = {e["type"] for e in taken}
        assert {"BlockStored", "BlockRemoved"} <= kinds, kinds
        n = len(taken)
        deadline = time.monotonic() + WAIT_S
        sub.wait_for(n, deadline)
        for w in watchers:
            w.wait_for(n, deadline)
        # (a) + (b): one sequence everywhere, gap-free
        assert sub.events() == taken
        assert sub.live > 0, "nothing arrived live on the SUB socket"
        for w in watchers:
            assert [s for s, _ in w.got] == list(range(n))
            assert [e for _, e in w.got] == taken
        r.phase1 = taken
        r.zmq_phase1 = [ev for s in range(len(sub.batches)) for ev in sub.batches[s]]
        r.matches = []
        for i in range(12):
            q = np.concatenate([prefixes[i % 3][: PS * (1 + i % 8)], np.array([99, 98], np.int32)])
            for key in (None, "lora-a"):
                r.matches.append((q, key, clients[0].match(sessions[0], [MatchQuery(q, key)])[0].prefix_len // PS))
        assert any(m for _, _, m in r.matches), "no query hits the cache: the Dynamo check would be vacuous"

        # flush: AllBlocksCleared goes out on every outlet too
        assert clients[0].flush(sessions[0]) is True
        tail = clients[1].take_events(sessions[1])  # TakeEvents callers share one cursor
        assert tail == [{"type": "AllBlocksCleared"}]
        everything = taken + tail

        # (c) a late subscriber: replay from 0, then live events
        late = Subscriber(ctx, pub, rep)
        subs.append(late)
        sub.wait_for(len(everything), time.monotonic() + WAIT_S)
        late.ask_replay(0)
        assert late.events() == everything
        r.late_replayed = late.replayed
        time.sleep(0.3)
        workload(clients, sessions, rng, 4, step0=100)
        more = clients[0].take_events(sessions[0])
        assert more and more[0]["type"] == "BlockStored"
        everything += more
        deadline = time.monotonic() + WAIT_S
        for s in (sub, late):
            s.wait_for(len(everything), deadline)
            assert s.events() == everything
        assert late.live > 0, "the late subscriber got nothing live after its replay"
        for w in watchers:
            w.wait_for(len(everything), deadline)
            assert [s for s, _ in w.got] == list(range(len(everything)))
            assert [e for _, e in w.got] == everything
        r.everything = everything

        for c in clients:
            c.close()
        clients.clear()
        # graceful shutdown: the streams end, the last AllBlocksCleared goes out on ZMQ
        assert stop_server(srv) == 0
        for w in watchers:
            w.thread.join(WAIT_S)
            assert not w.thread.is_alive(), "a watch stream did not end at shutdown"
        sub.wait_for(len(everything) + 1, time.monotonic() + WAIT_S)
        assert sub.events() == everything + [{"type": "AllBlocksCleared"}]
        assert not os.path.exists(f"{d}/pub") and not os.path.exists(f"{d}/replay"), "ipc sockets left behind"
        yield r
    finally:
        for c in clients:
            c.close()
        for w in watchers:
            w.client.close()
        for s in subs:
            s.close()
        ctx.term()
        stop_server(srv)
        shutil.rmtree(d, ignore_errors=True)


def test_zmq_grpc_watchers_and_take_events_carry_one_numbered_sequence(run):
    """(a), (b), the flush and the shutdown (asserted while the scenario ran)."""
    assert len(run.everything) > len(run.phase1) > 10
    assert run.everything[len(run.phase1)] == {"type": "AllBlocksCleared"}


def test_a_late_subscriber_catches_up_through_replay(run):
    assert run.late_replayed >= 2  # every batch up to the flush came by replay


def test_dynamo_indexer_fed_from_zmq_scores_as_the_manager_matches(run):
    dynamo_core = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is not installed")
    from radixkv.events.dynamo import DynamoEventAdapter, tokens_hashes

    tree, adapter = dynamo_core.RadixTree(), DynamoEventAdapter(PS)
    for ev in run.zmq_phase1:
        raw = adapter.encode(ev)
        if raw is not None:
            tree.apply_event(0, raw)
    for q, key, want in run.matches:
        assert tree.find_matches(tokens_hashes(q, PS, key)).scores.get((0, 0), 0) == want, (q, key)


def test_resume_from_start_seq_and_lag_beyond_the_ring_are_reported():
    """In-process server with an 8-event ring: a watcher resuming from a seq the ring no
    longer holds, and TakeEvents after more than a ring's worth, get the gap marker first."""
    from radixkv.service.server.manager import ServeOptions
    from tooling.testing import ThreadedServer

    opts = ServeOptions(sweep_interval_s=0.2, grace_s=1.0, events_ring_size=8)
    with ThreadedServer({"kv_tokens": 256, "page_size": PS, "enable_kv_events": True}, options=opts) as srv:
        c = srv.client()
        s = c.attach("w").session
        for i in range(12):  # 12 distinct roots: 12 BlockStored events
            toks = np.full(PS, 1000 + i, np.int32)
            c.alloc_extend(s, [ExtendItem(f"r{i}", toks)])
            c.cache_finished(s, [f"r{i}"])
        taken = c.take_events(s)
        assert taken[0] == {"type": "EventsLost", "first_seq": 0, "count": 4}
        assert [e["token_ids"][0] for e in taken[1:]] == list(range(1004, 1012))
        stream = c.watch_events(s, poll_interval_s=0.01, start_seq=2, with_seq=True)
        got = [next(stream) for _ in range(9)]
        stream.close()
        assert got[0] == (2, {"type": "EventsLost", "first_seq": 2, "count": 2})
        assert [q for q, _ in got[1:]] == list(range(4, 12))
        with pytest.raises(Exception) as err:  # ahead of the next event: INVALID_ARGUMENT
            next(c.watch_events(s, start_seq=99))
        assert "ahead" in str(err.value)
        # from_now: nothing of the past; the subscription races the inserts, so insert until
        # the stream has something
        live, first = c.watch_events(s, poll_interval_s=0.01, start_seq=None, with_seq=True), []
        reader = threading.Thread(target=lambda: first.append(next(live)), daemon=True)
        reader.start()
        for i in range(100):
            if first:
                break
            c.alloc_extend(s, [ExtendItem(f"new{i}", np.full(PS, 2000 + i, np.int32))])
            c.cache_finished(s, [f"new{i}"])
            reader.join(0.1)
        reader.join(WAIT_S)
        assert first and first[0][0] >= 12 and first[0][1]["type"] == "BlockStored"
        srv.call(lambda server: server.servicer.check_all())


def test_the_zmq_outlet_needs_events_on_and_an_endpoint_it_can_open():
    from radixkv.service.server.manager import ServeOptions
    from tooling.testing import ThreadedServer

    from radixkv.errors import InvalidArgumentError
    from radixkv.events.zmq_flags import PublisherConfig

    opts = ServeOptions(sweep_interval_s=0.2, grace_s=1.0, kv_events=PublisherConfig("tcp://127.0.0.1:*"))
    with pytest.raises(InvalidArgumentError, match="enable-kv-events"):
        ThreadedServer({"kv_tokens": 64}, options=opts).start()
    bad = opts._replace(kv_events=PublisherConfig("tcp://*:no-port"))
    with pytest.raises(InvalidArgumentError, match="cannot open KV event endpoints"):
        ThreadedServer({"kv_tokens": 64, "enable_kv_events": True}, options=bad).start()
