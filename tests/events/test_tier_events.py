"""KV events with the host tier (docs/events.md, section 5): the recorder's tier moves, a seeded
stress of a TieredRadixCache whose events feed a (hash, medium) model, the Dynamo adapter and
its indexer (a page held on any tier stays in the router), and vLLM's wire with ``"CPU"``."""
from collections import Counter

import numpy as np
import pytest
from cache.tier_util import make_cache, serve

from radixkv.bench.router_index import PyRadixIndex
from radixkv.cache.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored, KVEventBatch, KVEventRecorder
from radixkv.errors import InvalidArgumentError, NotFoundError
from radixkv.events.dynamo import DynamoEventAdapter, dumps, tokens_hashes
from radixkv.events.vllm_wire import decode_batch, encode_batch


def test_recorder_move_is_stored_then_removed():
    rec = KVEventRecorder(2)
    hashes = rec.on_stored(None, [1, 2, 3, 4])
    rec.take_events()
    rec.on_moved(hashes, MEDIUM_CPU, None, [1, 2, 3, 4])
    stored, removed = rec.take_events()
    assert isinstance(stored, BlockStored) and stored.medium == "CPU" and list(stored.block_hashes) == hashes
    assert stored.token_ids.tolist() == [1, 2, 3, 4] and stored.parent_block_hash is None
    assert removed == BlockRemoved(tuple(hashes), "GPU")
    assert rec.live_blocks() == 2 and all(rec.medium_of(h) == "CPU" for h in hashes)
    rec.on_moved(hashes, MEDIUM_CPU, None, [1, 2, 3, 4])  # already there: nothing
    assert rec.take_events() == []
    with pytest.raises(NotFoundError, match="not stored"):
        rec.on_moved([hashes[0], 12345], MEDIUM_GPU, None, [1, 2, 3, 4])
    assert rec.take_events() == [] and rec.medium_of(hashes[0]) == "CPU"
    child = rec.on_stored(hashes[-1], [5, 6])  # on the GPU, under a CPU page
    rec.on_removed(hashes + child)  # one event per tier
    assert rec.take_events()[1:] == [BlockRemoved(tuple(hashes), "CPU"), BlockRemoved(tuple(child), "GPU")]
    rec.check_invariants()
    assert rec.live_blocks() == 0 and rec.medium_of(hashes[0]) == "GPU"


def test_stored_on_a_tier():
    rec = KVEventRecorder(1)
    (h,) = rec.on_stored(None, [9], medium=MEDIUM_CPU)
    assert rec.take_events()[0].medium == "CPU" and rec.medium_of(h) == "CPU"
    rec.on_cleared()
    assert rec.medium_of(h) == "GPU"
    rec.check_invariants()


def test_dynamo_adapter_hides_tier_moves():
    rec, ad = KVEventRecorder(2), DynamoEventAdapter(2)
    a = rec.on_stored(None, [1, 2, 3, 4])
    b = rec.on_stored(a[-1], [5, 6])
    rec.on_moved(b, MEDIUM_CPU, a[-1], [5, 6])
    rec.on_moved(a, MEDIUM_CPU, None, [1, 2, 3, 4])  # a parent leaves the GPU before its child's removal
    rec.on_moved(a, MEDIUM_GPU, None, [1, 2, 3, 4])
    out = [ad.convert(e) for e in rec.take_events()]
    assert [None if d is None else next(iter(d["data"])) for d in out] == ["stored", "stored"] + [None] * 6
    assert [d["event_id"] for d in out if d is not None] == [0, 1] and ad.next_event_id == 2
    assert ad.live_blocks() == 3
    rec.on_removed(b)  # gone from the CPU: a real removal
    (d,) = [ad.convert(e) for e in rec.take_events()]
    assert d["data"] == {"removed": {"block_hashes": b}}
    ad.check_invariants()
    assert ad.convert(BlockStored((a[0],), None, np.array([1, 2], np.int32), 2, None, "CPU")) is None
    with pytest.raises(InvalidArgumentError, match="partly"):  # a[0] on the CPU, a[1] on the GPU
        ad.convert(BlockStored(tuple(a), None, np.array([1, 2, 3, 4], np.int32), 2, None, "CPU"))


def test_vllm_wire_carries_the_tier():
    rec = KVEventRecorder(2)
    a = rec.on_stored(None, [1, 2])
    rec.on_moved(a, MEDIUM_CPU, None, [1, 2])
    batch = KVEventBatch(1.5, rec.take_events())
    for layout in ("array", "map"):
        back = decode_batch(encode_batch(batch, layout=layout))
        assert [(type(e).__name__, e.medium) for e in back.events] == [
            ("BlockStored", "GPU"), ("BlockStored", "CPU"), ("BlockRemoved", "GPU")]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ps,policy", [(1, "write_back"), (4, "write_back"), (4, "write_through")])
def test_events_mirror_every_tier(seed, ps, policy):
    """Random requests with shared prefixes through a small device pool and a smaller host
    tier; after each step the events, replayed into a (hash, medium) model, say exactly
    where every page of the tree is, and the Dynamo router holds exactly the tree's pages."""
    rng = np.random.default_rng(seed)
    cache = make_cache(ps=ps, device_tokens=48, host_tokens=32, write_policy=policy, events=True)
    ad, index = DynamoEventAdapter(ps), PyRadixIndex()
    model: dict[int, set[str]] = {}  # hash -> the tiers the events put it on
    seen: Counter[tuple[str, str]] = Counter()
    stems = [rng.integers(0, 9, size=int(rng.integers(1, 5)) * ps * 2).astype(np.int32) for _ in range(5)]
    for step in range(60):
        op = rng.random()
        if op < 0.7:
            tail = rng.integers(0, 9, size=int(rng.integers(0, 3)) * ps).astype(np.int32)
            serve(cache, np.concatenate([stems[int(rng.integers(len(stems)))], tail]))
        elif op < 0.9:
            cache.evict(int(rng.integers(1, 24)))
        else:
            cache.evict_host(int(rng.integers(1, 4)))
        for e in cache.take_events():
            seen[(type(e).__name__, getattr(e, "medium", ""))] += 1
            if isinstance(e, BlockStored):
                assert not any(e.medium in model.get(h, ()) for h in e.block_hashes), f"step {step}: stored twice"
                for h in e.block_hashes:
                    model.setdefault(h, set()).add(e.medium)
            elif isinstance(e, BlockRemoved):
                assert all(e.medium in model.get(h, ()) for h in e.block_hashes), f"step {step}: not there"
                for h in e.block_hashes:
                    model[h].discard(e.medium)
                    if not model[h]:
                        del model[h]
            d = ad.convert(e)
            if d is not None:
                index.apply_event(0, dumps(d))
        cache.check_invariants()
        ad.check_invariants()
        want = {h: {MEDIUM_GPU if x.vbuf else MEDIUM_CPU} for x in cache.iter_nodes() for h in x.block_hashes or ()}
        assert model == want, f"step {step}"
        assert ad.live_blocks() == len(want)
    assert min(seen[("BlockStored", "CPU")], seen[("BlockRemoved", "CPU")], seen[("BlockRemoved", "GPU")]) > 0, seen
    for stem in stems:  # the router scores what the tree holds on any tier
        n = cache.match_prefix(stem)
        assert index.scores(tokens_hashes(stem, ps)).get(0, 0) == (n.prefix_len + n.host_len) // ps


def test_state_index_keeps_a_state_while_its_block_moves_tier():
    """A hybrid tree's KV tier move (``BlockStored`` on the new tier, then ``BlockRemoved`` on
    the old) keeps the block's states in ``StateIndex``; its removal from the last tier, or an
    unknown block's removal, drops them."""
    from radixkv.cache.hybrid.state_events import HybridEventRecorder, StateStored
    from radixkv.events.state_index import StateIndex

    rec, index = HybridEventRecorder(1), StateIndex()
    h = rec.on_stored(None, np.array([1, 2], dtype=np.int32))
    rec.on_state_stored(h[-1], 2, MEDIUM_CPU)
    rec.on_moved(h, MEDIUM_CPU, None, np.array([1, 2], dtype=np.int32))
    index.apply_all("w", rec.take_events())
    assert index.live("w") == {h[-1]: 2}
    rec.on_moved(h, MEDIUM_GPU, None, np.array([1, 2], dtype=np.int32))
    index.apply_all("w", rec.take_events())
    assert index.live("w", MEDIUM_CPU) == {h[-1]: 2}
    rec.on_removed(h)
    index.apply_all("w", rec.take_events())
    assert index.live("w") == {}
    index.apply("w", StateStored(99, 1, MEDIUM_GPU))
    index.apply("w", BlockRemoved((99,), MEDIUM_GPU))  # a stream joined late: unknown block
    assert index.live("w") == {}
