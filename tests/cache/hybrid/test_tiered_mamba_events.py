"""KV and state events of a hybrid model's host KV tier (``TieredMambaRadixCache``, issue 31,
item 4): a router index fed only the tree's events holds, after every step, exactly the tree's
pages per tier (``GPU``: device rows, ``CPU``: host only) and its states per tier (a state
stays while its block is on some tier); a demotion stores the page on ``CPU`` before removing
it from ``GPU``; Dynamo's router (through the adapter) holds
every page on any tier. A Hypothesis state machine under both write policies and page sizes
1 and 2; one test per event emission shows the index check catching its removal. With a
storage tier (L3) and restarts: a storage read's host-only leaf is announced ``BlockStored(CPU)``
then ``StateStored(CPU)``, so a restarted tree's first events come from storage."""
from collections import Counter
from json import dumps

import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import invariant, rule
from storage_double import DictStorage
from test_hybrid_state_storage import StoredHybridMachine
from test_tiered_mamba_cache import TieredHybridMachine, machine_tests, make, serve

from radixkv.bench.router_index import PyRadixIndex
from radixkv.cache.host_tier import HostTierMixin
from radixkv.cache.hybrid.state_events import StateStored
from radixkv.cache.hybrid.tiered_mamba_cache import TieredMambaRadixCache
from radixkv.cache.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecorder,
)
from radixkv.events.dynamo import DynamoEventAdapter, tokens_hashes
from radixkv.events.state_index import StateIndex


class RouterView:
    """A router's index of one manager: blocks by (hash, medium) (vLLM's consumers), states by
    tier (:class:`StateIndex`) and Dynamo's radix index (tiers hidden by the adapter)."""

    def __init__(self, ps):
        self.blocks: dict[int, set[str]] = {}
        self.states = StateIndex()
        self.adapter, self.dynamo = DynamoEventAdapter(ps), PyRadixIndex()
        self.seen: Counter[tuple[str, str]] = Counter()

    def feed(self, cache):
        """Apply the tree's pending events (:meth:`replay`)."""
        self.replay(cache.take_events())

    def replay(self, events):
        """Apply ``events`` one at a time (a page gone from every tier is never stored on
        ``CPU`` next: only a demotion or a storage read stores there, and a demotion stores first)."""
        gone: set[int] = set()
        for e in events:
            self.seen[(type(e).__name__, getattr(e, "medium", "") or "")] += 1
            if isinstance(e, BlockStored):
                assert not any(e.medium in self.blocks.get(h, ()) for h in e.block_hashes), "stored twice"
                if e.medium == MEDIUM_CPU:
                    assert not gone & set(e.block_hashes), "a demotion removed the page before storing it"
                for h in e.block_hashes:
                    self.blocks.setdefault(h, set()).add(e.medium)
            elif isinstance(e, BlockRemoved):
                assert all(e.medium in self.blocks.get(h, ()) for h in e.block_hashes), "removed, not there"
                for h in e.block_hashes:
                    self.blocks[h].discard(e.medium)
                    if not self.blocks[h]:
                        del self.blocks[h]
                        gone.add(h)
            elif isinstance(e, AllBlocksCleared):
                self.blocks.clear()
            self.states.apply("w", e)
            d = self.adapter.convert(e)
            if d is not None:
                self.dynamo.apply_event(0, dumps(d).encode())

    @staticmethod
    def tree_blocks(cache):
        return {h: {MEDIUM_GPU if x.vbuf else MEDIUM_CPU} for x in cache.iter_nodes() for h in x.block_hashes or ()}

    def check(self, cache):
        """The index equals the tree, page by page and state by state, per tier."""
        assert self.blocks == self.tree_blocks(cache)
        for medium, where in ((MEDIUM_GPU, cache.state_slot), (MEDIUM_CPU, cache.host_state_slot)):
            want = {n.block_hashes[-1] for n in cache.iter_nodes() if n.parent is not None and where(n) is not None}
            assert set(self.states.live("w", medium)) == want, medium
        assert self.adapter.live_blocks() == len(self.blocks)


class TieredHybridEventMachine(TieredHybridMachine):
    """The tiered hybrid machine (serve, match, KV / state / host evictions) with events on,
    a :class:`RouterView` fed after every step."""

    EVENTS = True

    def __init__(self):
        super().__init__()
        self.view = RouterView(self.PS)

    @invariant()
    def audit(self):
        self.view.feed(self.cache)
        self.view.check(self.cache)
        super().audit()


globals().update(machine_tests(TieredHybridEventMachine, "TestTieredHybridEvents"))


def run_steps(policy, ps=1, seed=0, steps=120, store=None):
    """A seeded run (serves, KV / state / host evictions; with ``store`` a storage tier and
    restarts) with the index checked after every step; returns the view and the cache (the
    last tree's). A restarted tree is a new manager: a new view, its first events checked."""
    rng = np.random.default_rng(seed)

    def fresh():
        return make(ps, device_tokens=16 * ps, host_tokens=24 * ps, slots=4, host_slots=5,
                    write_policy=policy, events=True, backend=store)

    cache, alloc, mamba = fresh()
    view = RouterView(ps)
    convs = [[1 + c] * ps for c in range(3)]
    from_storage = 0
    for _ in range(steps):
        op = rng.random()
        if store is not None and op > 0.93:
            assert cache.storage.drain(10.0)
            cache.storage.close()
            seen = view.seen
            cache, alloc, mamba = fresh()
            view = RouterView(ps)
            view.seen = seen
            from_storage += first_from_storage(cache, alloc, mamba, view, convs[int(rng.integers(3))])
        elif op < 0.7:
            c = int(rng.integers(3))
            toks = convs[c] + [int(t) for t in rng.integers(1, 9, size=int(rng.integers(1, 4))) for _ in range(ps)]
            if len(toks) > 10 * ps:
                toks = convs[c][:ps] + toks[-ps:]
            if serve(cache, alloc, mamba, toks) is not None:
                convs[c] = toks
        elif op < 0.8:
            cache.evict(int(rng.integers(1, 12)) * ps)
        elif op < 0.9:
            cache.evict(0, int(rng.integers(1, 3)))
        else:
            cache.evict_host(int(rng.integers(1, 8)))
        view.feed(cache)
        view.check(cache)
    for c in convs:  # Dynamo's router scores the KV the tree holds on any tier
        toks = np.asarray(c, dtype=np.int32)
        m = cache.match_prefix(toks)
        view.feed(cache)  # a storage read announces what it brought in
        assert view.dynamo.scores(tokens_hashes(toks, ps)).get(0, 0) == m.kv_prefix_len // ps
    cache.reset()
    view.feed(cache)
    view.check(cache)
    view.restarts_from_storage = from_storage
    return view, cache


def first_from_storage(cache, alloc, mamba, view, toks):
    """Serve ``toks`` as a restarted tree's first call: when storage held some of it, its
    first events are the storage read's (``BlockStored(CPU)``, then ``StateStored(CPU)`` on its
    last page), the view checked after it."""
    m = cache.match_prefix(np.asarray(toks, dtype=np.int32))
    events = cache.take_events()
    if m.storage_len:
        assert isinstance(events[0], BlockStored) and events[0].medium == MEDIUM_CPU, events
        assert len(events[0].block_hashes) == m.storage_len // cache.page_size
        assert events[1] == StateStored(events[0].block_hashes[-1], m.storage_len, MEDIUM_CPU), events
    else:
        assert not events, events
    view.replay(events)
    view.check(cache)
    serve(cache, alloc, mamba, toks)
    view.feed(cache)
    view.check(cache)
    return bool(m.storage_len)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("ps,seed", [(1, 0), (2, 1)])
def test_seeded_events_mirror_the_tiers(policy, ps, seed):
    view, _ = run_steps(policy, ps, seed)
    seen = view.seen
    assert min(seen[("BlockStored", "CPU")], seen[("BlockRemoved", "CPU")], seen[("BlockRemoved", "GPU")],
               seen[("StateStored", "CPU")], seen[("StateRemoved", "CPU")]) > 0, seen


def _without(monkeypatch, name, skip):
    """Patch ``HostTierMixin.<name>`` so that it records nothing when ``skip(args)``."""
    orig = getattr(HostTierMixin, name)

    def patched(self, *args):
        if not skip(args):
            orig(self, *args)
    monkeypatch.setattr(HostTierMixin, name, patched)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("emission", ["demote", "load", "drop"])
def test_index_check_catches_a_missing_emission(monkeypatch, policy, emission):
    """Each emission matters: without the demotion's move (to CPU), the load's (to GPU) or
    the host drop's removal, the index no longer equals the tree (the tree's own audit, which
    would catch it too, is turned off: the index alone must)."""
    monkeypatch.setattr(TieredMambaRadixCache, "check_invariants", lambda self, *a: None)
    if emission == "drop":
        _without(monkeypatch, "_record_removed", lambda args: True)
    else:
        dst = MEDIUM_CPU if emission == "demote" else MEDIUM_GPU
        _without(monkeypatch, "_moved", lambda args: args[1] == dst)
    with pytest.raises(AssertionError):
        run_steps(policy)


@pytest.mark.parametrize("policy,ps,seed", [("write_back", 1, 2), ("write_back", 2, 3), ("write_through", 1, 4),
                                            ("write_through", 2, 5)])
def test_seeded_events_mirror_the_tiers_with_storage_and_restarts(policy, ps, seed):
    """With a storage tier: in-run storage reads (host drops send prefixes away) and restarts
    (a new tree and a new view on the same store) keep the index equal to the tree after every
    step; some restarted trees' first events came from storage."""
    store = DictStorage()
    view, cache = run_steps(policy, ps, seed, steps=160, store=store)
    assert view.restarts_from_storage > 0
    assert view.seen[("StateStored", "CPU")] > 0 and view.seen[("BlockStored", "CPU")] > 0
    cache.storage.close()


def test_index_check_catches_a_missing_storage_read_emission(monkeypatch):
    """Without the storage read's ``BlockStored(CPU)`` (hashes still given to the node, the
    event withheld from the queue) the router's index no longer equals the tree."""
    monkeypatch.setattr(TieredMambaRadixCache, "check_invariants", lambda self, *a: None)
    orig = KVEventRecorder.on_stored

    def withheld(self, parent_hash, token_ids, extra_key=None, medium=None):
        out = orig(self, parent_hash, token_ids, extra_key, medium)
        if medium == MEDIUM_CPU:  # a hybrid tree stores on CPU only from a storage read
            self._events.pop()
        return out
    monkeypatch.setattr(KVEventRecorder, "on_stored", withheld)
    with pytest.raises(AssertionError):
        run_steps("write_back", 1, 2, steps=160, store=DictStorage())


class StoredHybridEventMachine(StoredHybridMachine, TieredHybridEventMachine):
    """The event machine with a storage tier and restarts (``StoredHybridMachine``'s: a new
    tree on the same store, drained first), a new view for each new tree."""

    @rule()
    def restart(self):
        super().restart()
        self.view = RouterView(self.PS)


for _ps, _policy, _name in ((1, "write_back", "TestStoredHybridEvents"),
                            (2, "write_through", "TestStoredHybridEventsPagedWriteThrough")):
    _variant = type(_name[4:], (StoredHybridEventMachine,), {"PS": _ps, "POLICY": _policy})
    globals()[_name] = _variant.TestCase
    globals()[_name].settings = settings(max_examples=20, stateful_step_count=30, deadline=None)


def test_a_demoted_leaf_dropped_under_its_demoted_parent_is_removed_once():
    """One ``evict`` demotes a leaf, then its parent, then drops the stateless device node
    above them with its host-only subtree: the leaf's pages leave once (the end-of-call prune
    of the demoted leaf must see it gone; it raised ``NotFoundError`` from the recorder).
    Found by the storage event machine; storage plays no part in it."""
    cache, alloc, mamba = make(1, device_tokens=16, host_tokens=12, slots=4, host_slots=3, events=True)
    view = RouterView(1)
    convs = [[1], [2], [3]]
    for c, grow in [(0, [1, 1]), (1, [1]), (0, [1, 1, 1]), (0, [1, 1, 1]), (1, [1]), (2, [1, 1]), (2, [1, 1, 1]),
                    (0, [1]), (1, [1, 1]), (2, [1])]:
        toks = convs[c] + grow
        if len(toks) > 10:
            toks = convs[c][:1] + toks[-1:]
        if serve(cache, alloc, mamba, toks) is not None:
            convs[c] = toks
        view.feed(cache)
        view.check(cache)
    assert view.seen[("BlockRemoved", "CPU")] > 0
