"""Proof against the real consumer: the events of several radixkv managers, through the
Dynamo adapter, feed Dynamo's own Rust radix indexer (``dynamo._core.RadixTree`` of
ai-dynamo-runtime). For random requests, Dynamo's overlap score for each manager equals
that manager's own ``match_prefix`` length in pages -- through inserts, evictions, a flush
and a dead manager. Skipped when ai-dynamo-runtime (the optional extra) is not installed."""
import json

import numpy as np
import pytest

dynamo_core = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is not installed")

from radixkv.cache.block_hash import block_hashes  # noqa: E402
from radixkv.cache.radix_cache import RadixCache  # noqa: E402
from radixkv.engine import CacheEngine, EngineConfig  # noqa: E402
from radixkv.engine.protocol import ExtendItem, MatchQuery  # noqa: E402
from radixkv.events.dynamo import DynamoEventAdapter, compute_block_hash_for_seq, dumps, tokens_hashes  # noqa: E402
from radixkv.events.sources import drain_events  # noqa: E402
from radixkv.events.state_index import StateIndex  # noqa: E402

PS = 4
KEYS = [None, "lora-a", ("tenant", 7)]


class Cluster:
    """N in-process managers, one adapter each, one Dynamo RadixTree for all."""

    def __init__(self, managers, session=None):
        self.managers = managers
        self.sessions = session or [None] * len(managers)
        self.adapters = [DynamoEventAdapter(PS) for _ in managers]
        self.tree = dynamo_core.RadixTree()
        self.alive = set(range(len(managers)))
        self.kinds = {"stored": 0, "removed": 0, "cleared": 0}

    def pump(self):
        for w in sorted(self.alive):
            for ev in drain_events(self.managers[w], self.sessions[w]):
                raw = self.adapters[w].encode(ev)
                if raw is not None:
                    self.tree.apply_event(w, raw)
                    data = json.loads(raw)["data"]
                    self.kinds[data if isinstance(data, str) else next(iter(data))] += 1

    def scores(self, tokens, key):
        s = self.tree.find_matches(tokens_hashes(tokens, PS, key)).scores
        assert all(dp == 0 for _, dp in s)
        return {w: n for (w, _), n in s.items()}

    def dumped_blocks(self):
        out = {}
        for raw in self.tree.dump_tree_as_events():
            d = json.loads(raw)
            blocks = d["event"]["data"]["stored"]["blocks"]
            out[d["worker_id"]] = out.get(d["worker_id"], 0) + len(blocks)
        return out


class Workload:
    """Conversations: a few shared system prompts, users continuing their own history --
    prefixes shared within and across managers."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.systems = [self.rng.integers(0, 50_000, PS * 3).astype(np.int32) for _ in range(3)]
        self.history = {}

    def request(self):
        user = int(self.rng.integers(0, 12))
        past = self.history.get(user)
        if past is None or self.rng.random() < 0.2:
            past = self.systems[int(self.rng.integers(0, 3))]
        turn = self.rng.integers(0, 50_000, PS * int(self.rng.integers(1, 4))).astype(np.int32)
        toks = np.concatenate([past, turn])
        self.history[user] = toks
        return toks, KEYS[user % 3]

    def query(self):
        toks, key = self.request()
        cut = int(self.rng.integers(1, toks.size + 1))
        return np.concatenate([toks[:cut], self.rng.integers(0, 50_000, int(self.rng.integers(0, 6))).astype(
            np.int32)]), key


def check_scores(cluster, wl, match_pages, n=25):
    hits = 0
    for _ in range(n):
        q, key = wl.query()
        got = cluster.scores(q, key)
        for w in range(len(cluster.managers)):
            want = match_pages(w, q, key) if w in cluster.alive else 0
            assert got.get(w, 0) == want, (w, got, want)
            hits += want > 0
    return hits


def test_radix_caches_overlap_equals_match_prefix_through_evictions_flush_and_death():
    caps = [96, 160, 240]  # tokens each manager may cache
    managers = [RadixCache(page_size=PS, enable_kv_events=True) for _ in caps]
    cluster = Cluster(managers)
    wl = Workload(seed=1)
    rows = 0

    def serve(w, toks, key):
        nonlocal rows
        m = managers[w]
        over = m.total_size() + toks.size - caps[w]
        if over > 0:
            m.evict(over)
        m.insert(toks, np.arange(rows, rows + toks.size), extra_key=key)
        rows += toks.size

    def match_pages(w, q, key):
        return managers[w].match_prefix(q, extra_key=key).prefix_len // PS

    hits = 0
    for step in range(240):
        toks, key = wl.request()
        serve(step % 3, toks, key)
        cluster.pump()
        if step % 20 == 19:
            hits += check_scores(cluster, wl, match_pages)
            for w, m in enumerate(managers):
                m.check_invariants()
                cluster.adapters[w].check_invariants()
                assert cluster.adapters[w].live_blocks() == m.kv_events.live_blocks()
            assert cluster.dumped_blocks() == {w: a.live_blocks() for w, a in enumerate(cluster.adapters)
                                               if a.live_blocks()}
    assert hits > 20  # the workload does share prefixes across requests
    assert cluster.kinds["removed"] > 20  # and the capacities did force evictions

    managers[1].reset()  # a flush: AllBlocksCleared
    cluster.pump()
    assert 1 not in cluster.dumped_blocks()
    check_scores(cluster, wl, match_pages)
    for _step in range(30):  # manager 1 fills again after the flush
        toks, key = wl.request()
        serve(1, toks, key)
        cluster.pump()
    check_scores(cluster, wl, match_pages)

    cluster.tree.remove_worker(2)  # manager 2 dies: its blocks stop counting
    cluster.alive.discard(2)
    assert 2 not in cluster.dumped_blocks()
    check_scores(cluster, wl, match_pages)


def _managers(kind, cfg, n):
    """``n`` managers: in-process ``CacheEngine``s, or clients of real gRPC cache managers
    (events then come over the service's TakeEvents RPC)."""
    if kind == "embedded":
        return [CacheEngine(cfg) for _ in range(n)], []
    from tooling.testing import start_remote_engine

    pairs = [start_remote_engine(cfg) for _ in range(n)]
    return [c for c, _ in pairs], [close for _, close in pairs]


@pytest.mark.parametrize("kind", ["embedded", "remote"])
def test_cache_engines_overlap_equals_engine_match(kind):
    cfg = EngineConfig(kv_tokens=128, page_size=PS, enable_kv_events=True, max_context_len=512)
    engines, closers = _managers(kind, cfg, 2)
    try:
        _check_engines_against_dynamo(engines)
    finally:
        for close in closers:
            close()


def _check_engines_against_dynamo(engines):
    sessions = [e.attach("router-test").session for e in engines]
    cluster = Cluster(engines, sessions)
    wl = Workload(seed=2)
    str_keys = {None: None, "lora-a": "lora-a", ("tenant", 7): "tenant-7"}  # engines take str keys

    def match_pages(w, q, key):
        return engines[w].match(sessions[w], [MatchQuery(q, str_keys[key])])[0].prefix_len // PS

    for step in range(80):
        toks, key = wl.request()
        w = int(wl.rng.integers(0, 2))
        rid = f"r{step}"
        engines[w].alloc_extend(sessions[w], [ExtendItem(rid, toks, str_keys[key])])
        engines[w].cache_finished(sessions[w], [rid])
        cluster.pump()
        if step % 10 == 9:
            q, key = wl.query()
            got = cluster.tree.find_matches(tokens_hashes(q, PS, str_keys[key])).scores
            for w2 in range(2):
                assert got.get((w2, 0), 0) == match_pages(w2, q, key)
            for e in engines:
                e.check_invariants()
    assert engines[0].flush(sessions[0])
    cluster.pump()
    q, key = wl.query()
    assert (0, 0) not in cluster.tree.find_matches(tokens_hashes(q, PS, str_keys[key])).scores


def test_hybrid_router_credits_kv_by_dynamo_and_states_by_the_state_index():
    from test_dynamo_adapter import hooked_mamba, insert_random_state  # tests/ is on sys.path

    ps = 2
    tree, alloc, mamba = hooked_mamba(ps)
    adapter, index, dyn = DynamoEventAdapter(ps), StateIndex(), dynamo_core.RadixTree()
    rng = np.random.default_rng(4)
    differ = 0
    for _step in range(100):
        toks = rng.integers(0, 3, 2 * int(rng.integers(1, 6))).astype(np.int32)
        if rng.random() < 0.6:
            insert_random_state(tree, alloc, mamba, rng, toks)
        else:
            tree.evict(int(rng.integers(1, 8)), int(rng.integers(0, 3)))
        for ev in drain_events(tree):
            index.apply(0, ev)
            raw = adapter.encode(ev)
            if raw is not None:
                dyn.apply_event(0, raw)
        q = rng.integers(0, 3, 2 * int(rng.integers(1, 7))).astype(np.int32)
        m = tree.match_prefix(q)
        kv = dyn.find_matches(compute_block_hash_for_seq(q, ps)).scores.get((0, 0), 0)
        assert kv == m.kv_prefix_len // ps
        assert index.usable(0, block_hashes(q, ps), kv).blocks == m.prefix_len // ps
        differ += m.prefix_len != m.kv_prefix_len
    assert differ > 0  # KV without a state did occur, and was not credited


def test_snapshot_rebuilds_a_late_router():
    cache = RadixCache(page_size=PS, enable_kv_events=True)
    adapter = DynamoEventAdapter(PS)
    wl = Workload(seed=3)
    for i in range(40):
        toks, key = wl.request()
        cache.insert(toks, np.arange(toks.size), extra_key=key)
        if i % 7 == 6:
            cache.evict(3 * PS)
        adapter.convert_all(drain_events(cache))
    late = dynamo_core.RadixTree()
    for ev in adapter.snapshot():
        late.apply_event(5, dumps(ev))
    for _ in range(30):
        q, key = wl.query()
        assert late.find_matches(tokens_hashes(q, PS, key)).scores.get((5, 0), 0) == \
            cache.match_prefix(q, extra_key=key).prefix_len // PS
