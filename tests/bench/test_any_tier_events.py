"""``AnyTierEvents``: a tiered engine's KV events (pages demoted to the host tier, loaded
back, dropped) fed through it into Dynamo's adapter are accepted, and the blocks the router
then holds are exactly those on the device or host tier; without it the adapter refuses a
parent that moves tier while its children stay."""
import numpy as np
import pytest

from radixkv.bench.any_tier_events import AnyTierEvents
from radixkv.cache.kv_events import BlockRemoved, BlockStored
from radixkv.engine.config import EngineConfig
from radixkv.engine.embedded import CacheEngine
from radixkv.engine.protocol import ExtendItem
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.events.dynamo import DynamoEventAdapter

PAGE = 16


def _held(eng) -> set[int]:
    return {h for x in eng.tree.iter_nodes() if x.parent is not None for h in (x.block_hashes or ())}


def _replay(seed: int, filtered: bool) -> None:
    eng = CacheEngine(EngineConfig(kv_tokens=128, host_kv_tokens=256, page_size=PAGE, request_rows=2,
                                   max_context_len=128, enable_kv_events=True))
    s = eng.attach("t").session
    blind, adapter = AnyTierEvents(), DynamoEventAdapter(PAGE)
    rng = np.random.default_rng(seed)
    convs: list[np.ndarray] = []
    for i in range(150):
        if not convs or rng.random() < 0.3:
            convs.append(rng.integers(0, 100, int(rng.integers(1, 4)) * PAGE).astype(np.int32))
        k = int(rng.integers(0, len(convs)))
        convs[k] = np.concatenate([convs[k], rng.integers(0, 100, int(rng.integers(1, 40))).astype(np.int32)])[:120]
        eng.alloc_extend(s, [ExtendItem(f"r{i}", convs[k])])
        eng.cache_finished(s, [f"r{i}"])
        events = eng.take_events(s)
        for ev in blind.apply(events) if filtered else events:
            adapter.encode(ev)
        if filtered:
            assert set(adapter._blocks) == set(blind._media) == _held(eng), i
    eng.check_invariants()
    assert eng.tier_stats()["demoted_pages"] > 0 and eng.tier_stats()["loaded_pages"] > 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_router_holds_what_the_device_and_host_tiers_hold(seed):
    _replay(seed, filtered=True)


def test_without_it_the_adapter_refuses_a_parent_that_moves_tier():
    with pytest.raises(InvalidArgumentError, match="children stay"):
        _replay(0, filtered=False)


def test_bad_sequences_are_refused():
    blind = AnyTierEvents()
    toks = np.arange(2 * PAGE, dtype=np.int32)
    assert blind.apply([BlockStored((1, 2), None, toks, PAGE, None, medium="GPU")]) != []
    assert blind.apply([BlockRemoved((1, 2), "GPU"), BlockStored((1, 2), None, toks, PAGE, None, medium="CPU")]) == []
    with pytest.raises(InvariantError, match="not there"):
        blind.apply([BlockRemoved((1,), "GPU")])
    with pytest.raises(InvariantError, match="mixes"):
        blind.apply([BlockStored((2, 3), None, toks, PAGE, None, medium="GPU")])
    assert blind.apply([BlockRemoved((1, 2), "CPU")]) == [BlockRemoved((1, 2), None)]
