"""The Dynamo adapter: Dynamo's ``tokens_hash`` (pinned against ai-dynamo-runtime 1.6.1, and
compared with it live when installed), the KvCacheEvent JSON, the adapter's validation and
audit, a state machine driving a RadixCache whose events feed a plain-Python model of
Dynamo's indexer, and the state events of hybrid models (recorder, index, and a real
MambaRadixCache wired through the hook)."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from radixkv.bench.cluster import PyRadixIndex  # noqa: E402
from radixkv.cache.block_hash import block_hashes
from radixkv.cache.hybrid.state_events import (
    HybridEventRecorder,
    StateRemoved,
    StateStored,
    any_event_from_dict,
    split_state_events,
)
from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.cache.radix_cache import RadixCache
from radixkv.errors import (
    InvalidArgumentError,
    InvariantError,
    LengthMismatchError,
    NotFoundError,
)
from radixkv.events.dynamo import (
    DynamoEventAdapter,
    DynamoNamespace,
    compute_block_hash_for_seq,
    default_namespace,
    dumps,
    dynamo_seed,
    tokens_hashes,
)
from radixkv.events.sources import drain_events
from radixkv.events.state_index import StateIndex

try:
    from dynamo._core import compute_block_hash_for_seq as dynamo_hash
except ImportError:  # the optional extra is not installed
    dynamo_hash = None

needs_dynamo = pytest.mark.skipif(dynamo_hash is None, reason="ai-dynamo-runtime is not installed")
SEQ = list(range(1, 33))


# --------------------------------------------------------------------------- tokens_hash


def test_pinned_vectors_from_dynamo_1_6_1():
    # measured with dynamo._core.compute_block_hash_for_seq of ai-dynamo-runtime 1.6.1
    assert compute_block_hash_for_seq(SEQ, 16) == [16863443419780771464, 2287610619914608821]
    assert compute_block_hash_for_seq(SEQ, 16, lora_name="adapter-a") == [4377081107200288488,
                                                                          16216151377791080369]
    assert compute_block_hash_for_seq(SEQ, 16, cache_namespace="tenant-1") == [15362812222086887632,
                                                                               3775388916072002001]
    assert compute_block_hash_for_seq(SEQ, 16, "adapter-a", "tenant-1") == [10705809790500934550,
                                                                            12602935856247641818]
    assert compute_block_hash_for_seq(SEQ, 16, lora_name="ü") == [607877884791841930, 9113151264727088259]
    # u32 tokens; int32 negatives are the same bytes
    assert compute_block_hash_for_seq([0, 2**32 - 1, 7, 2**31], 2) == [82595646164830710, 3328332411540099357]
    assert compute_block_hash_for_seq(np.array([0, -1, 7, -(2**31)], np.int32), 2) == [82595646164830710,
                                                                                       3328332411540099357]
    # empty names are absent; a partial last block is ignored
    assert compute_block_hash_for_seq(SEQ + [5, 6], 16, "", "") == compute_block_hash_for_seq(SEQ, 16)
    assert dynamo_seed() == 1337 and dynamo_seed("", None) == 1337


@needs_dynamo
@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40), bs=st.integers(1, 9),
       lora=st.one_of(st.none(), st.text(max_size=8)), ns=st.one_of(st.none(), st.text(max_size=8)))
def test_equals_dynamos_compute_block_hash_for_seq(tokens, bs, lora, ns):
    assert compute_block_hash_for_seq(np.asarray(tokens, np.uint32), bs, lora, ns) == dynamo_hash(
        tokens, bs, lora_name=lora, cache_namespace=ns)


def test_hash_input_validation():
    for bad in ([[1, 2]], [1.5], [2**32], [-(2**31) - 1]):
        with pytest.raises(InvalidArgumentError):
            compute_block_hash_for_seq(np.asarray(bad) if bad != [[1, 2]] else bad, 1)
    with pytest.raises(InvalidArgumentError):
        compute_block_hash_for_seq([1], 0)
    with pytest.raises(InvalidArgumentError):
        dynamo_seed(lora_name=3)


def test_default_namespace_is_injective_and_router_side_hashes_match():
    keys = [None, "a", "", 1, b"a", ("a", None), ("a",), (1, "a"), -1]
    seeds = [dynamo_seed(*default_namespace(k)) for k in keys]
    assert len(set(seeds)) == len(keys)
    assert default_namespace("lora-x") == DynamoNamespace("lora-x", None)
    assert default_namespace(7).cache_namespace.startswith("radixkv:")
    toks = np.arange(8, dtype=np.int32)
    ns = default_namespace(7)
    assert tokens_hashes(toks, 4, 7) == compute_block_hash_for_seq(toks, 4, *ns)


# --------------------------------------------------------------------------- a model of Dynamo's indexer


class ModelRouter(PyRadixIndex):
    """Dynamo's RadixTree semantics in plain Python (the cluster benchmark's fallback index),
    with the names these tests use: ``apply``, ``lookup`` (worker -> block hash -> node) and
    ``remove_worker``."""

    apply = PyRadixIndex.apply_event

    @property
    def lookup(self) -> dict[int, dict[int, dict]]:
        return self._lookup

    def remove_worker(self, worker: int) -> None:
        self.apply(worker, b'{"event_id": 0, "data": "cleared"}')
        self._lookup.pop(worker, None)


# --------------------------------------------------------------------------- adapter


def stored(hashes, tokens, parent=None, size=2, key=None):
    t = np.asarray(tokens, np.int32)
    return BlockStored(tuple(hashes), parent, t, size, None, "GPU", key if isinstance(key, str) else None, key)


def test_event_json_shape():
    a = DynamoEventAdapter(2, dp_rank=1, first_event_id=10)
    d = a.convert(stored([5, 6], [1, 2, 3, 4]))
    th = compute_block_hash_for_seq([1, 2, 3, 4], 2)
    assert d == {"event_id": 10, "dp_rank": 1, "data": {"stored": {"parent_hash": None, "blocks": [
        {"block_hash": 5, "tokens_hash": th[0]}, {"block_hash": 6, "tokens_hash": th[1]}]}}}
    assert json.loads(a.encode(BlockRemoved((6,), "GPU"))) == {"event_id": 11, "dp_rank": 1,
                                                               "data": {"removed": {"block_hashes": [6]}}}
    assert a.convert(AllBlocksCleared().to_dict()) == {"event_id": 12, "dp_rank": 1, "data": "cleared"}
    assert a.convert(StateStored(5, 2)) is None and a.next_event_id == 13  # no Dynamo kind
    assert dumps({"a": 2**64 - 1}) == b'{"a":18446744073709551615}'


def test_refusals_leave_the_adapter_unchanged():
    a = DynamoEventAdapter(2)
    a.convert(stored([1, 2], [1, 2, 3, 4]))
    a.convert(stored([3], [5, 6], parent=2))
    before = (dict(a._blocks), dict(a._children), a.next_event_id)
    bad = [
        (stored([9], [1, 2], parent=77), NotFoundError),  # unknown parent
        (stored([2], [1, 2]), InvalidArgumentError),  # stored twice
        (stored([8, 8], [1, 2, 3, 4]), InvalidArgumentError),  # twice in one event
        (stored([9], [1, 2, 3]), LengthMismatchError),
        (stored([9], [1, 2, 3], size=3), InvalidArgumentError),  # other page size
        (BlockRemoved((42,), "GPU"), NotFoundError),
        (BlockRemoved((1,), "GPU"), InvalidArgumentError),  # its child 2 stays
        (BlockRemoved((3, 3), "GPU"), NotFoundError),
        ("BlockStored", InvalidArgumentError),
    ]
    for ev, err in bad:
        with pytest.raises(err):
            a.convert(ev)
        assert (dict(a._blocks), dict(a._children), a.next_event_id) == before
        a.check_invariants()
    a.convert(BlockRemoved((2, 3), "GPU"))  # a node with its child in one event is fine
    assert a.live_blocks() == 1
    a.check_invariants()


def test_namespace_collisions_are_refused():
    a = DynamoEventAdapter(1, namespace_fn=lambda k: DynamoNamespace(None, None))
    a.convert(stored([1], [1], size=1, key="x"))
    with pytest.raises(InvalidArgumentError, match="share the Dynamo namespace"):
        a.convert(stored([2], [1], size=1, key="y"))
    assert a.live_blocks() == 1
    with pytest.raises(InvalidArgumentError):
        DynamoEventAdapter(0)
    with pytest.raises(InvalidArgumentError):
        DynamoEventAdapter(2, namespace_fn="default")
    with pytest.raises(InvalidArgumentError):
        DynamoEventAdapter(1, namespace_fn=lambda k: "ns").convert(stored([1], [1], size=1))


def test_audit_names_the_corrupted_blocks():
    a = DynamoEventAdapter(2)
    a.convert(stored([1, 2], [1, 2, 3, 4]))
    a._blocks[5] = (99, 0)
    with pytest.raises(InvariantError, match=r"parent is not stored: \[5\]"):
        a.check_invariants()
    del a._blocks[5]
    a._children[1] += 1
    with pytest.raises(InvariantError, match=r"child counts wrong for blocks \[1\]"):
        a.check_invariants()


class AdapterMachine(RuleBasedStateMachine):
    """Random inserts / evictions / matches / resets on a RadixCache with events; the adapter
    turns them into Dynamo JSON for a model router; the router's score must be the cache's
    own match length in pages, after every step."""

    PS = 2
    KEYS = [None, "lora-a", 3]

    @initialize(seed=st.integers(0, 2**16))
    def setup(self, seed):
        self.rng = np.random.default_rng(seed)
        self.cache = RadixCache(page_size=self.PS, enable_kv_events=True)
        self.adapter = DynamoEventAdapter(self.PS)
        self.router = ModelRouter()
        self.rows = 0

    def pump(self):
        for ev in drain_events(self.cache):
            raw = self.adapter.encode(ev)
            if raw is not None:
                self.router.apply(0, raw)

    def tokens(self, n):
        base = self.rng.integers(0, 3, 2 * n).astype(np.int32)  # small alphabet: shared prefixes
        return base[: n * self.PS]

    @rule(pages=st.integers(1, 6), k=st.integers(0, 2))
    def insert(self, pages, k):
        toks = self.tokens(pages)
        self.cache.insert(toks, np.arange(self.rows, self.rows + toks.size), extra_key=self.KEYS[k])
        self.rows += toks.size
        self.pump()

    @rule(n=st.integers(1, 12))
    def evict(self, n):
        self.cache.evict(n)
        self.pump()

    @rule()
    def reset(self):
        if self.rng.random() < 0.2:
            self.cache.reset()
            self.pump()

    @rule(pages=st.integers(1, 7), k=st.integers(0, 2), extra=st.integers(0, 1))
    def match(self, pages, k, extra):
        q = self.tokens(pages)
        q = np.concatenate([q, np.ones(extra, np.int32)])  # a partial page is never matched
        want = self.cache.match_prefix(q, extra_key=self.KEYS[k]).prefix_len // self.PS
        got = self.router.scores(tokens_hashes(q, self.PS, self.KEYS[k])).get(0, 0)
        assert got == want

    @invariant()
    def audit(self):
        if hasattr(self, "cache"):
            self.cache.check_invariants()
            self.adapter.check_invariants()
            assert self.adapter.live_blocks() == self.cache.kv_events.live_blocks()

    @rule()
    def late_router_from_snapshot(self):
        fresh = ModelRouter()
        for ev in self.adapter.snapshot():
            fresh.apply(0, dumps(ev))
        for node in self.cache.iter_nodes():  # every live block reachable, same scores
            assert all(h in fresh.lookup[0] for h in node.block_hashes)
        assert len(fresh.lookup.get(0, {})) == self.adapter.live_blocks()


TestAdapterMachine = AdapterMachine.TestCase
TestAdapterMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


# --------------------------------------------------------------------------- hybrid state events


def test_hybrid_recorder_orders_and_validates_state_events():
    rec = HybridEventRecorder(2)
    h = rec.on_stored(None, np.arange(4, dtype=np.int32))
    rec.on_state_stored(h[1], 4)
    with pytest.raises(InvalidArgumentError):
        rec.on_state_stored(h[1], 4)  # one state per block
    with pytest.raises(NotFoundError):
        rec.on_state_stored(12345, 2)
    with pytest.raises(InvalidArgumentError):
        rec.on_state_stored(h[0], 3)  # not a page end
    with pytest.raises(NotFoundError):
        rec.on_state_removed([h[0]])
    rec.on_state_stored(h[0], 2)
    rec.on_state_removed([h[0]])
    rec.on_removed([h[1]])  # drops the state of block 1 (rule 2)
    assert rec.live_states() == {}
    rec.check_invariants()
    events = rec.take_events()
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["BlockStored", "StateStored", "StateStored", "StateRemoved", "BlockRemoved"]
    kv, states = split_state_events(events)
    assert [type(e) for e in kv] == [BlockStored, BlockRemoved] and len(states) == 3
    assert [any_event_from_dict(e.to_dict()) for e in states] == states
    rec.on_stored(None, np.arange(2, dtype=np.int32))
    rec.on_state_stored(rec.block_hashes(np.arange(2, dtype=np.int32))[0], 2)
    rec._states["GPU"][777] = 2
    with pytest.raises(InvariantError, match=r"\[777\]"):
        rec.check_invariants()
    rec.on_cleared()
    assert rec.live_states() == {}
    with pytest.raises(InvalidArgumentError):
        any_event_from_dict({"type": "StateStored", "block_hash": 1})


def test_state_index_credits_only_prefixes_that_end_at_a_state():
    idx = StateIndex()
    chain = [11, 12, 13, 14]
    idx.apply_all("w", [StateStored(12, 4), StateStored(14, 8).to_dict()])
    assert idx.usable("w", chain, 4).blocks == 4
    assert idx.usable("w", chain, 3).blocks == 2  # block 3 has KV but no state
    idx.apply("w", StateRemoved((12,)))
    assert idx.usable("w", chain, 3).blocks == 0
    idx.apply("w", BlockRemoved((14,), "GPU"))
    assert idx.usable("w", chain, 4) == (4, 0) and idx.num_states("w") == 0
    idx.apply("v", StateStored(11, 2))
    idx.apply("v", AllBlocksCleared())
    assert idx.usable("v", chain, 1).blocks == 0
    idx.remove_worker("v")
    assert idx.workers() == ["w"]
    with pytest.raises(InvalidArgumentError):
        idx.usable("w", chain, 5)
    idx.check_invariants()


def hooked_mamba(page_size=2, slots=8):
    """A MambaRadixCache with KV events on: it emits state events (StateStored / StateRemoved)
    in order with the KV events."""
    mrc = pytest.importorskip("radixkv.cache.hybrid.mamba_radix_cache")
    from radixkv.allocator import PagedTokenToKVPoolAllocator
    from radixkv.memory import HybridReqToTokenPool, MambaPool

    mamba = MambaPool(slots, (3, 12), (2, 4, 4), 2)
    pool = HybridReqToTokenPool(4, 64, mamba_pool=mamba)
    alloc = PagedTokenToKVPoolAllocator(256, page_size)
    tree = mrc.MambaRadixCache(pool, alloc, page_size=page_size, enable_kv_events=True)
    assert isinstance(tree.kv_events, HybridEventRecorder)
    return tree, alloc, mamba


def insert_random_state(tree, alloc, mamba, rng, toks):
    """Insert ``toks`` with fresh rows and, 70% of the time, a fresh state slot; free the
    caller's duplicates (rows already cached, a slot the tree did not keep)."""
    rows = alloc.alloc(toks.size)
    slot = int(mamba.alloc(1)[0]) if rng.random() < 0.7 and mamba.available_size() else None
    res = tree.insert_with_state(toks, rows, slot)
    if res.prefix_len:
        alloc.free(rows[:res.prefix_len])
    if slot is not None and not res.state_kept:
        mamba.free([slot])


def test_mamba_cache_events_let_a_router_credit_only_reusable_prefixes():
    ps = 2
    tree, alloc, mamba = hooked_mamba(ps)
    rng = np.random.default_rng(11)
    adapter, router, index = DynamoEventAdapter(ps), ModelRouter(), StateIndex()
    for step in range(120):
        toks = rng.integers(0, 3, 2 * int(rng.integers(1, 6))).astype(np.int32)
        if rng.random() < 0.6:
            insert_random_state(tree, alloc, mamba, rng, toks)
        elif rng.random() < 0.5:
            tree.evict(int(rng.integers(1, 8)), int(rng.integers(0, 3)))
        elif step % 40 == 39:
            tree.reset()
        for ev in drain_events(tree):
            index.apply(0, ev)
            raw = adapter.encode(ev)
            if raw is not None:
                router.apply(0, raw)
        tree.check_invariants()
        tree.kv_events.check_invariants()
        q = rng.integers(0, 3, 2 * int(rng.integers(1, 7))).astype(np.int32)
        m = tree.match_prefix(q)
        kv = router.scores(compute_block_hash_for_seq(q, ps)).get(0, 0)
        assert kv == m.kv_prefix_len // ps
        chain = block_hashes(q, ps)
        assert index.usable(0, chain, kv).blocks == m.prefix_len // ps
