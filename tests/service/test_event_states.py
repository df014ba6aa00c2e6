"""Hybrid state events over the service, end to end, on a real ``radixkv serve`` process
(spawned) with a hybrid model (KDA + full attention) and the ZMQ outlet carrying state events
(``--kv-events-state-events inline``):

* every RPC that changes the tree is followed by its events on ZMQ at once: the pump task
  (``--kv-events-interval-s 60``) and the sweeper (``--sweep-interval-s 1000``) never run
  during the test, so only the servicer's pump after each call can have sent them;
* ZMQ, a ``WatchEvents`` stream and ``TakeEvents`` carry the same KV + state sequence;
* a :class:`~radixkv.bench.state_router.StateAwareIndex` fed from any of them scores the
  manager exactly as its own ``match`` (``prefix_len``) after mamba evictions (states gone,
  KV kept), while the plain KV index credits ``kv_prefix_len``.
"""
import json
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

from radixkv.bench.state_router import StateAwareIndex, StateAwareScore  # noqa: E402
from radixkv.engine import EngineConfig  # noqa: E402
from radixkv.engine.protocol import ExtendItem, MatchQuery  # noqa: E402
from radixkv.events.dynamo import tokens_hashes  # noqa: E402
from radixkv.events.vllm_wire import decode_batch  # noqa: E402
from radixkv.events.zmq_replay import END_SEQ  # noqa: E402

PS = 2
WAIT_S = 10


class Sub:
    """SUB + DEALER replay (vLLM's subscriber protocol), batches as dict lists by seq."""

    def __init__(self, ctx, endpoint, replay_endpoint):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, "")
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.connect(replay_endpoint)
        self.batches = {}

    def _keep(self, seq, payload):
        self.batches.setdefault(seq, [e.to_dict() for e in decode_batch(payload).events])

    def poll(self, timeout_ms):
        if not self.sub.poll(timeout_ms):
            return False
        _, seq_b, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_b, "big")
        nxt = max(self.batches, default=-1) + 1
        if seq > nxt:  # joined late (slow joiner): replay what was missed
            self.replay.send_multipart([b"", nxt.to_bytes(8, "big")])
            while self.replay.poll(WAIT_S * 1000):
                _, s, p = self.replay.recv_multipart()
                if s == END_SEQ:
                    break
                self._keep(int.from_bytes(s, "big"), p)
        self._keep(seq, payload)
        return True

    def events(self):
        assert sorted(self.batches) == list(range(len(self.batches)))
        return [e for s in range(len(self.batches)) for e in self.batches[s]]

    def close(self):
        self.sub.close()
        self.replay.close()


@pytest.fixture
def hybrid_events_server():
    d = tempfile.mkdtemp(prefix="rkv-st-")
    cfg = EngineConfig(layer_types="FKF", page_size=PS, kv_tokens=512, head_num=1, head_dim=4, kda_num_heads=1,
                       kda_head_dim=4, state_slots=12, request_rows=8, max_context_len=128, enable_kv_events=True)
    path = os.path.join(d, "engine.json")
    with open(path, "w") as f:
        json.dump(cfg.to_dict(), f)
    pub, rep = f"ipc://{d}/pub", f"ipc://{d}/replay"
    srv = start_server(["--config", path, "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep,
                        "--kv-events-state-events", "inline", "--kv-events-interval-s", "60",
                        "--sweep-interval-s", "1000", "--grace-s", "2"])
    try:
        yield srv, pub, rep
    finally:
        code = stop_server(srv)
        shutil.rmtree(d, ignore_errors=True)
    assert code == 0, f"server exited with {code}"


def _serve(c, s, rid, toks):
    c.alloc_extend(s, [ExtendItem(rid, np.asarray(toks, dtype=np.int32))])
    c.cache_finished(s, [rid])


def _truth(c, s, q):
    m = c.match(s, [MatchQuery(np.asarray(q, dtype=np.int32))])[0]
    return StateAwareScore(m.kv_prefix_len // PS, m.prefix_len // PS)


def test_state_events_reach_every_outlet_promptly_and_the_state_aware_score_is_exact(hybrid_events_server):
    srv, pub, rep = hybrid_events_server
    ctx = zmq.Context()
    sub = Sub(ctx, pub, rep)
    c = connect(srv.address, token=srv.token, wait_s=30)
    watch_c = connect(srv.address, token=srv.token, wait_s=30)
    try:
        s = c.attach("w").session
        ws = watch_c.attach("watcher").session
        watched = []

        def watch():
            for ev in watch_c.watch_events(ws, poll_interval_s=0.01):
                watched.append(ev)

        time.sleep(0.3)  # let the SUB subscription reach the publisher
        base = np.arange(10, 26, dtype=np.int32)
        steps = [("p", base[:8]), ("q", base), ("r", np.concatenate([base[:4], [99, 98]]))]
        for rid, toks in steps:
            _serve(c, s, rid, toks)
            t0 = time.monotonic()  # no pump task nor sweeper runs: only the pump after the call
            assert sub.poll(int(WAIT_S * 1000)), f"no ZMQ batch after {rid}'s calls"
            assert time.monotonic() - t0 < WAIT_S
        assert c.evict(s, 0, 2).states == 2  # mamba evictions: two states go, the KV stays
        assert sub.poll(int(WAIT_S * 1000)), "no ZMQ batch after Evict"
        while sub.poll(200):  # any further batch (none expected: one per call that recorded events)
            pass
        zmq_events = sub.events()
        kinds = [e["type"] for e in zmq_events]
        assert kinds.count("StateStored") == 3 and kinds.count("StateRemoved") == 2

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        deadline = time.monotonic() + WAIT_S
        while len(watched) < len(zmq_events):
            assert time.monotonic() < deadline, f"watcher: {len(watched)} of {len(zmq_events)}"
            time.sleep(0.01)
        taken = c.take_events(s)
        assert watched[:len(zmq_events)] == taken == zmq_events  # one sequence, every outlet

        index = StateAwareIndex(PS, index="python")
        index.apply_all(0, taken)
        index.check_invariants()
        queries = [base, base[:12], np.concatenate([base[:8], [5]]), np.concatenate([base[:4], [99, 98, 1]])]
        over = 0
        for q in queries:
            got = index.scores(q).get(0, StateAwareScore(0, 0))
            want = _truth(c, s, q)
            assert got == want, (q.tolist(), got, want)
            assert index.kv_index.scores(tokens_hashes(q[:q.size // PS * PS], PS)).get(0, 0) == want.kv_blocks
            over += want.kv_blocks > want.blocks
        assert over >= 1, "no query where the plain KV index overcredits: the test proves nothing"
        c.detach(s)
        watch_c.close()
        th.join(WAIT_S)
    finally:
        c.close()
        watch_c.close()
        sub.close()
        ctx.term()
