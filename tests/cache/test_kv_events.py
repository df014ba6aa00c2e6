"""KV events: the hash chain (reproducible, process-independent, documented layout), the
vLLM-schema events, and the recorder's bookkeeping."""
import hashlib
import json
import multiprocessing as mp
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.cache.block_hash import DEFAULT_SEED, block_hashes
from radixkv.cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
    event_from_dict,
)
from radixkv.errors import AlignmentError, InvalidArgumentError, InvariantError, NotFoundError


def _spec_extra(k):
    if k is None:
        return b"\x00"
    if isinstance(k, str):
        return b"\x01" + struct.pack("<I", len(k.encode())) + k.encode()
    if isinstance(k, bytes):
        return b"\x02" + struct.pack("<I", len(k)) + k
    if isinstance(k, tuple):
        return b"\x04" + struct.pack("<I", len(k)) + b"".join(_spec_extra(x) for x in k)
    return b"\x03" + struct.pack("<q", k)


def _spec_hashes(tokens, page_size, parent_hash, extra_key, seed):
    """An independent, deliberately naive implementation of the layout in the module doc
    (one struct.pack per token), standing in for "another process or language"."""
    if parent_hash is None:
        if isinstance(seed, int):
            prev = struct.pack("<Q", seed)
        else:
            raw = seed.encode("utf-8") if isinstance(seed, str) else seed
            prev = hashlib.sha256(raw).digest()[:8]
    else:
        prev = struct.pack("<Q", parent_hash)
    extra = _spec_extra(extra_key)
    out = []
    for p in range(len(tokens) // page_size):
        body = b"".join(struct.pack("<i", int(t)) for t in tokens[p * page_size:(p + 1) * page_size])
        d = hashlib.sha256(prev + extra + body).digest()
        out.append(struct.unpack("<Q", d[:8])[0])
        prev = d[:8]
    return out


def _hashes_in_child(args):
    tokens, page_size, parent, extra, seed = args
    from radixkv.cache.block_hash import block_hashes as bh

    return bh(np.asarray(tokens, dtype=np.int32), page_size, parent, extra, seed)


def test_known_vector_pins_the_layout():
    # Pinned once from the documented layout; a change here breaks every consumer.
    h = block_hashes(np.arange(4, dtype=np.int32), 2, None, None, DEFAULT_SEED)
    assert h == _spec_hashes(list(range(4)), 2, None, None, DEFAULT_SEED)
    root = hashlib.sha256(DEFAULT_SEED).digest()[:8]
    first = hashlib.sha256(root + b"\x00" + np.array([0, 1], "<i4").tobytes()).digest()[:8]
    assert h[0] == int.from_bytes(first, "little")


@given(
    tokens=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=24),
    page_size=st.sampled_from([1, 2, 3, 4]),
    parent=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    extra=st.recursive(
        st.one_of(st.none(), st.text(max_size=5), st.binary(max_size=5), st.integers(-(2**63), 2**63 - 1)),
        lambda inner: st.tuples(inner, inner), max_leaves=4,
    ),
    seed=st.one_of(st.binary(max_size=8), st.text(max_size=8), st.integers(0, 2**64 - 1)),
)
def test_matches_independent_spec_implementation(tokens, page_size, parent, extra, seed):
    tokens = tokens[: len(tokens) - len(tokens) % page_size]
    got = block_hashes(np.asarray(tokens, dtype=np.int32), page_size, parent, extra, seed)
    assert got == _spec_hashes(tokens, page_size, parent, extra, seed)
    assert all(0 <= h < 2**64 for h in got)


def test_chain_is_prefix_consistent():
    toks = np.random.default_rng(1).integers(0, 50_000, 64, dtype=np.int32)
    whole = block_hashes(toks, 16, None, "a")
    head = block_hashes(toks[:32], 16, None, "a")
    tail = block_hashes(toks[32:], 16, head[-1], "a")
    assert whole == head + tail  # a node split keeps its page hashes
    # int64, list and torch inputs give the same hashes as int32
    import torch

    assert block_hashes(toks.astype(np.int64), 16, None, "a") == whole
    assert block_hashes(torch.from_numpy(toks), 16, None, "a") == whole
    assert block_hashes(toks.tolist(), 16, None, "a") == whole


def test_same_hashes_in_a_spawned_process():
    rng = np.random.default_rng(7)
    cases = [
        (rng.integers(0, 32_000, 48, dtype=np.int32).tolist(), 16, None, None, DEFAULT_SEED),
        (rng.integers(0, 32_000, 10, dtype=np.int32).tolist(), 1, 12345, "tenant-a", b"s"),
        (rng.integers(0, 32_000, 8, dtype=np.int32).tolist(), 4, None, 7, 99),
    ]
    here = [_hashes_in_child(c) for c in cases]
    with mp.get_context("spawn").Pool(1) as pool:
        there = pool.map(_hashes_in_child, cases)
    assert here == there


def test_seed_and_extra_key_and_tokens_change_hashes():
    toks = np.arange(32, dtype=np.int32)
    base = block_hashes(toks, 8, None, None)
    assert block_hashes(toks, 8, None, None, seed=b"other") != base
    assert block_hashes(toks, 8, None, None, seed=1) != base
    assert block_hashes(toks, 8, None, "lora-1") != base
    assert block_hashes(toks, 8, None, "lora-1") != block_hashes(toks, 8, None, "lora-2")
    assert block_hashes(toks, 8, None, "") != base  # "" and None are different namespaces
    assert block_hashes(toks, 8, None, b"x") != block_hashes(toks, 8, None, "x")
    assert block_hashes(toks, 8, None, ("a", 1)) != block_hashes(toks, 8, None, ("a", 2))
    assert block_hashes(toks, 8, None, ("a", "b")) != block_hashes(toks, 8, None, ("ab",))
    assert block_hashes(toks, 8, 5, None) != base
    changed = toks.copy()
    changed[17] += 1
    h2 = block_hashes(changed, 8, None, None)
    assert h2[:2] == base[:2] and h2[2] != base[2] and h2[3] != base[3]  # chained
    assert len(set(base)) == 4


def test_bad_input_is_rejected():
    with pytest.raises(AlignmentError):
        block_hashes(np.arange(5, dtype=np.int32), 4)
    with pytest.raises(InvalidArgumentError):
        block_hashes(np.arange(4, dtype=np.float32), 4)
    with pytest.raises(InvalidArgumentError):
        block_hashes(np.arange(4, dtype=np.int32), 0)
    with pytest.raises(InvalidArgumentError):
        block_hashes(np.arange(4, dtype=np.int32), 4, parent_hash=-1)
    with pytest.raises(InvalidArgumentError):
        block_hashes(np.arange(4, dtype=np.int32), 4, extra_key=1.5)
    with pytest.raises(InvalidArgumentError):
        block_hashes(np.arange(4, dtype=np.int32), 4, seed=2**64)
    with pytest.raises(InvalidArgumentError):
        block_hashes(np.array([2**40], dtype=np.int64), 1)
    with pytest.raises(InvalidArgumentError):
        KVEventRecorder(0)


def test_recorder_events_follow_the_vllm_schema():
    rec = KVEventRecorder(page_size=4, seed=b"s", medium="GPU")
    toks = np.arange(8, dtype=np.int32)
    h = rec.on_stored(None, toks, "lora-a")
    assert h == block_hashes(toks, 4, None, "lora-a", b"s")
    h2 = rec.on_stored(h[-1], np.arange(8, 12, dtype=np.int32), 3)
    rec.on_removed(h2)
    rec.on_cleared()
    rec.check_invariants()
    assert rec.pending() == 4
    batch = rec.take_batch(data_parallel_rank=0)
    assert rec.pending() == 0 and rec.take_events() == []
    assert isinstance(batch, KVEventBatch) and batch.ts > 0
    stored, stored2, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert isinstance(cleared, AllBlocksCleared)
    d = stored.to_dict()
    for f in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"):
        assert f in d
    assert d["type"] == "BlockStored" and d["block_hashes"] == h and d["parent_block_hash"] is None
    assert d["token_ids"] == list(range(8)) and d["block_size"] == 4 and d["medium"] == "GPU"
    assert d["lora_name"] == "lora-a" and d["lora_id"] is None and d["extra_key"] == "lora-a"
    d2 = stored2.to_dict()
    assert d2["parent_block_hash"] == h[-1] and d2["lora_id"] == 3 and d2["lora_name"] is None
    assert removed.to_dict() == {"type": "BlockRemoved", "block_hashes": h2, "medium": "GPU"}
    assert cleared.to_dict() == {"type": "AllBlocksCleared"}
    text = json.dumps(batch.to_dict())  # JSON-able
    back = [event_from_dict(e) for e in json.loads(text)["events"]]
    assert back == batch.events
    assert not stored.token_ids.flags.writeable  # events are immutable snapshots


def test_recorder_rejects_unknown_removals_without_changing_state():
    rec = KVEventRecorder(page_size=2)
    h = rec.on_stored(None, np.arange(4, dtype=np.int32), None)
    with pytest.raises(NotFoundError) as e:
        rec.on_removed([h[0], 12345])
    assert "12345" in str(e.value)
    assert rec.pending() == 1 and rec.live_blocks() == 2
    with pytest.raises(NotFoundError):
        rec.on_removed([h[0], h[0]])  # removing one block twice
    with pytest.raises(AlignmentError):
        rec.on_stored(None, np.arange(3, dtype=np.int32), None)
    assert rec.pending() == 1 and rec.live_blocks() == 2
    rec.on_removed(h)
    assert rec.live_blocks() == 0
    with pytest.raises(NotFoundError):
        rec.on_removed(h[:1])
    assert rec.on_stored(None, np.empty(0, dtype=np.int32), None) == []
    assert rec.pending() == 2
    rec.check_invariants()


def test_check_invariants_catches_corruption():
    rec = KVEventRecorder(page_size=2)
    h = rec.on_stored(None, np.arange(4, dtype=np.int32), None)
    rec._live[h[0]] = 0
    with pytest.raises(InvariantError, match=str(h[0])):
        rec.check_invariants()


def test_bytes_and_tuple_extra_keys_round_trip_through_json():
    rec = KVEventRecorder(page_size=1)
    rec.on_stored(None, np.arange(2, dtype=np.int32), ("tenant", b"\x00\xff", 3))
    rec.on_stored(None, np.arange(2, dtype=np.int32), b"salt")
    events = rec.take_events()
    back = [event_from_dict(json.loads(json.dumps(e.to_dict()))) for e in events]
    assert back == events
    assert back[0].extra_key == ("tenant", b"\x00\xff", 3) and back[1].extra_key == b"salt"
