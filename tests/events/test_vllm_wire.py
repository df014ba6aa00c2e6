"""vLLM's KV-event wire format: radixkv's msgpack bytes equal what vLLM's msgspec structs
write, vLLM's decoders (old and new field sets, both layouts) read them, and radixkv reads
what vLLM writes."""
import struct
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

msgspec = pytest.importorskip("msgspec")

from radixkv.cache.hybrid.state_events import StateRemoved, StateStored  # noqa: E402
from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from radixkv.cache.radix_cache import RadixCache  # noqa: E402
from radixkv.errors import InvalidArgumentError, LengthMismatchError  # noqa: E402
from radixkv.events.vllm_wire import decode_batch, encode_batch  # noqa: E402

U64 = 2**64 - 1


# --------------------------------------------------------------------------- vLLM's structs
# Mirrors of vllm/distributed/kv_events.py (declared the way vLLM declares them; typed by
# hand since vllm itself is not a dependency). ``array_like`` picks the event layout.


def vllm_structs(array_like: bool, fields: str = "lora_name"):
    """(KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared) of one vLLM version:
    ``fields="medium"``: the example subscriber's set (up to ``medium``); ``"lora_name"``:
    plus ``lora_name``; ``"latest"``: plus the later optional fields."""

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    if fields == "medium":
        class BlockStored(KVCacheEvent):
            block_hashes: list[int]
            parent_block_hash: int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
    elif fields == "lora_name":
        class BlockStored(KVCacheEvent):
            block_hashes: list[int]
            parent_block_hash: int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
    else:
        class BlockStored(KVCacheEvent):
            block_hashes: list[int]
            parent_block_hash: int | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[tuple[Any, ...] | None] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def to_vllm(events, structs):
    _, S, R, C = structs
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(S(list(e.block_hashes), e.parent_block_hash, e.token_ids.tolist(), e.block_size,
                         e.lora_id, e.medium, e.lora_name))
        elif isinstance(e, BlockRemoved):
            out.append(R(list(e.block_hashes), e.medium))
        else:
            out.append(C())
    return out


# --------------------------------------------------------------------------- strategies

hashes = st.lists(st.integers(0, U64), min_size=1, max_size=4)


@st.composite
def stored(draw):
    hs = draw(hashes)
    size = draw(st.integers(1, 3))
    toks = np.asarray(draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=len(hs) * size,
                                    max_size=len(hs) * size)), dtype=np.int32)
    toks.setflags(write=False)
    key = draw(st.one_of(st.none(), st.integers(0, 2**40), st.text(min_size=1, max_size=6)))
    return BlockStored(tuple(hs), draw(st.one_of(st.none(), st.integers(0, U64))), toks, size,
                       key if isinstance(key, int) else None, draw(st.sampled_from(["GPU", None])),
                       key if isinstance(key, str) else None, key)


events_st = st.lists(st.one_of(stored(), st.builds(lambda h, m: BlockRemoved(tuple(h), m), hashes,
                                                   st.sampled_from(["GPU", None])),
                               st.just(AllBlocksCleared())), max_size=6)


@settings(max_examples=60, deadline=None)
@given(events=events_st, ts=st.floats(0, 2e9, allow_nan=False), rank=st.one_of(st.none(), st.integers(0, 300)),
       array_like=st.booleans())
def test_bytes_equal_msgspec_encoding_of_vllm_structs(events, ts, rank, array_like):
    structs = vllm_structs(array_like)
    ours = encode_batch(events, ts=ts, data_parallel_rank=rank, layout="array" if array_like else "map")
    theirs = msgspec.msgpack.encode(structs[0](ts=ts, events=to_vllm(events, structs), data_parallel_rank=rank))
    assert ours == theirs
    if not array_like:  # omit_defaults drops the later optional fields from maps: same bytes
        latest = vllm_structs(False, "latest")
        assert ours == msgspec.msgpack.encode(latest[0](ts=ts, events=to_vllm(events, latest),
                                                        data_parallel_rank=rank))
    assert decode_batch(ours) == KVEventBatch(ts, events, rank)


@pytest.mark.parametrize("array_like", [True, False])
@pytest.mark.parametrize("fields", ["medium", "lora_name", "latest"])
def test_vllm_decoders_of_every_field_set_read_a_real_cache_stream(array_like, fields):
    cache = RadixCache(page_size=2, enable_kv_events=True)
    rng = np.random.default_rng(3)
    for i in range(12):
        toks = rng.integers(0, 6, 8).astype(np.int32)
        cache.insert(toks, np.arange(8), extra_key=[None, "lora-a", 7][i % 3])
        if i % 4 == 3:
            cache.evict(6)
    cache.reset()
    events = cache.take_events()
    assert {type(e) for e in events} == {BlockStored, BlockRemoved, AllBlocksCleared}
    payload = encode_batch(events, ts=12.5, data_parallel_rank=0, layout="array" if array_like else "map")
    batch = msgspec.msgpack.Decoder(vllm_structs(array_like, fields)[0]).decode(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0 and len(batch.events) == len(events)
    for got, want in zip(batch.events, events):
        assert type(got).__name__ == type(want).__name__
        if isinstance(want, BlockStored):
            assert got.block_hashes == list(want.block_hashes)
            assert got.parent_block_hash == want.parent_block_hash
            assert got.token_ids == want.token_ids.tolist() and got.block_size == 2
            assert got.lora_id == want.lora_id and got.medium == "GPU"
            if fields != "medium":
                assert got.lora_name == want.lora_name
        elif isinstance(want, BlockRemoved):
            assert got.block_hashes == list(want.block_hashes)


@pytest.mark.parametrize("array_like", [True, False])
def test_reads_what_vllm_writes_including_later_optional_fields(array_like):
    structs = vllm_structs(array_like, "latest")
    B, S, R, C = structs
    batch = B(ts=3.0, data_parallel_rank=2, events=[
        S([1, U64], None, [5, 6, 7, 8], 2, None, "GPU", "ad", extra_keys=[("ad",), None], group_idx=0,
          kv_cache_spec_kind="full_attention"),
        S([9], U64, [1, 1], 2, 4, None, None),
        R([1], "GPU"), C()])
    got = decode_batch(msgspec.msgpack.encode(batch))
    assert got.ts == 3.0 and got.data_parallel_rank == 2
    s0, s1, r, c = got.events
    assert s0.block_hashes == (1, U64) and s0.parent_block_hash is None and s0.lora_name == "ad"
    assert s0.extra_key == "ad" and s0.token_ids.dtype == np.int32 and s0.token_ids.tolist() == [5, 6, 7, 8]
    assert s1.parent_block_hash == U64 and s1.lora_id == 4 and s1.extra_key == 4 and s1.medium is None
    assert r == BlockRemoved((1,), "GPU") and isinstance(c, AllBlocksCleared)
    # a batch written as a map is read too (vLLM's newest EventBatch drops array_like)
    as_map = msgpack.packb({"ts": 1.0, "events": [], "data_parallel_rank": None})
    assert decode_batch(as_map) == KVEventBatch(1.0, [], None)


def test_layout_details_pinned():
    e = BlockStored((5,), None, np.array([1, 2], np.int32), 2, None, "GPU", None, None)
    assert msgpack.unpackb(encode_batch([e], ts=0.5)) == [0.5, [["BlockStored", [5], None, [1, 2], 2, None,
                                                                 "GPU", None]], None]
    m = msgpack.unpackb(encode_batch([e, BlockRemoved((5,), "GPU"), AllBlocksCleared()], ts=0.5, layout="map"))
    assert list(m[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                             "medium", "lora_name"]
    assert m[1][1] == {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}
    assert m[1][2] == {"type": "AllBlocksCleared"}
    # fixarray(3), float64 ts, empty fixarray, nil rank
    assert encode_batch([], ts=1.0) == b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x90\xc0"


def test_state_events_are_kept_off_vllm_streams_unless_inline():
    st_events = [StateStored(5, 4, "GPU"), StateRemoved((5,), "GPU")]
    kv = BlockRemoved((5,), "GPU")
    plain = encode_batch([st_events[0], kv], ts=1.0)
    assert decode_batch(plain).events == [kv]
    vllm = msgspec.msgpack.Decoder(vllm_structs(True)[0])
    assert len(vllm.decode(plain).events) == 1
    inline = encode_batch(st_events + [kv], ts=1.0, state_events="inline")
    assert decode_batch(inline).events == st_events + [kv]
    assert msgpack.unpackb(inline)[1][0] == ["StateStored", 5, 4, "GPU"]
    with pytest.raises(msgspec.ValidationError):  # why they stay off by default
        vllm.decode(inline)
    with pytest.raises(InvalidArgumentError, match="state event"):
        decode_batch(inline, allow_state=False)
    with pytest.raises(InvalidArgumentError):
        encode_batch(st_events, state_events="error")
    m = encode_batch(st_events, ts=1.0, state_events="inline", layout="map")
    assert decode_batch(m).events == st_events


@pytest.mark.parametrize("payload, match", [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1.0]), "a batch is"),
    (msgpack.packb(["x", []]), "ts must"),
    (msgpack.packb([1.0, {}]), "events must"),
    (msgpack.packb([1.0, [["Nope"]]]), "unknown event tag"),
    (msgpack.packb([1.0, [["BlockRemoved", [1]]]]), "needs 2 fields"),
    (msgpack.packb([1.0, [["BlockRemoved", [1.5], None]]]), "u64"),
    (msgpack.packb([1.0, [["BlockRemoved", [-1], None]]]), "u64"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2, 3], 2, None, None, None]]]), "token ids"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [2**31, 0], 2, None, None, None]]]), "int32"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 0, None, None, None]]]), "block_size"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 2, "x", None, None]]]), "lora_id"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved"}]]), "lacks fields"),
    (msgpack.packb([1.0, [{"type": ["BlockRemoved"]}]]), "unknown event tag"),  # an unhashable tag
    (msgpack.packb([1.0, [{"type": {"a": 1}}]]), "unknown event tag"),
    (msgpack.packb([1.0, [["StateStored", 1, 0, None]]]), "position"),
    (msgpack.packb([1.0, [7]]), "array or a map"),
    (msgpack.packb([1.0, [], "r"]), r"\$\[2\]"),
])
def test_malformed_payloads_raise_typed_errors(payload, match):
    with pytest.raises(InvalidArgumentError, match=match):
        decode_batch(payload)


def test_bad_inputs_to_encode():
    bad = BlockStored((1, 2), None, np.array([1, 2], np.int32), 2, None, "GPU")
    with pytest.raises(LengthMismatchError):
        encode_batch([bad])
    with pytest.raises(InvalidArgumentError):
        encode_batch([BlockRemoved((2**64,), None)])
    with pytest.raises(InvalidArgumentError):
        encode_batch([], layout="json")
    with pytest.raises(InvalidArgumentError):
        encode_batch(["BlockStored"])
    with pytest.raises(InvalidArgumentError):
        encode_batch([], ts="now")
    with pytest.raises(InvalidArgumentError):
        decode_batch("text")
    # dicts from a CacheEngine's take_events() are accepted
    d = BlockRemoved((3,), "GPU").to_dict()
    assert decode_batch(encode_batch([d], ts=0.0)).events == [BlockRemoved((3,), "GPU")]
