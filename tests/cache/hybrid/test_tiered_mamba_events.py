"""KV and state events of a hybrid model's host KV tier (``TieredMambaRadixCache``, issue 31,
item 4): a router index fed only the tree's events holds, after every step, exactly the tree's
pages per tier (``GPU``: device rows, ``CPU``: host only) and its states per tier (a state
stays while its block is on some tier); a demotion stores the page on ``CPU`` before removing
it from ``GPU``; Dynamo's router (through the adapter) holds
every page on any tier. A Hypothesis state machine under both write policies and page sizes
1 and 2; one test per event emission shows the index check catching its removal."""
from collections import Counter
from json import dumps

import numpy as np
import pytest
from hypothesis.stateful import invariant
from test_tiered_mamba_cache import TieredHybridMachine, machine_tests, make, serve

from radixkv.bench.router_index import PyRadixIndex
from radixkv.cache.host_tier import HostTierMixin
from radixkv.cache.hybrid.tiered_mamba_cache import TieredMambaRadixCache
from radixkv.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
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
        """Apply the pending events one at a time (a page gone from every tier is never
        stored on ``CPU`` next: only a demotion stores there, and it must store first)."""
        gone: set[int] = set()
        for e in cache.take_events():
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


def run_steps(policy, ps=1, seed=0, steps=120):
    """A seeded run (serves, KV / state / host evictions) with the index checked after every
    step; returns the view and the cache."""
    rng = np.random.default_rng(seed)
    cache, alloc, mamba = make(ps, device_tokens=16 * ps, host_tokens=24 * ps, slots=4, host_slots=5,
                               write_policy=policy, events=True)
    view = RouterView(ps)
    convs = [[1 + c] * ps for c in range(3)]
    for _ in range(steps):
        op = rng.random()
        if op < 0.7:
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
        assert view.dynamo.scores(tokens_hashes(toks, ps)).get(0, 0) == m.kv_prefix_len // ps
    cache.reset()
    view.feed(cache)
    view.check(cache)
    return view, cache


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
