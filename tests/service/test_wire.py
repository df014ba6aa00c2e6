"""Wire conversions: packed little-endian arrays and every NamedTuple <-> message round trip."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.shm import CudaIpcDescriptor, ShmDescriptor

from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.engine.protocol import (
    CacheResult,
    DecodeItem,
    DecodeResult,
    EngineStats,
    EvictResult,
    ExtendItem,
    ExtendResult,
    MatchInfo,
    MatchQuery,
    Session,
)
from radixkv.errors import InvalidArgumentError, LengthMismatchError, StaleSessionError

i32s = st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=64)
i64s = st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=64)


@given(i32s)
def test_int32_round_trip_is_packed_little_endian(values):
    a = np.array(values, dtype=np.int32)
    b = wire.pack(a, wire.I32)
    assert b == a.astype("<i4").tobytes() and len(b) == 4 * len(values)
    out = wire.unpack_i32(b, "t")
    assert out.dtype == np.int32 and out.flags.writeable and np.array_equal(out, a)


@given(i64s)
def test_int64_round_trip(values):
    a = np.array(values, dtype=np.int64)
    out = wire.unpack_i64(wire.pack(a, wire.I64), "t")
    assert out.dtype == np.int64 and np.array_equal(out, a)


def test_big_endian_input_is_packed_little_endian():
    a = np.array([1, 2, 258], dtype=">i4")
    assert wire.pack(a, wire.I32) == b"\x01\x00\x00\x00\x02\x00\x00\x00\x02\x01\x00\x00"


def test_truncated_bytes_are_refused():
    with pytest.raises(InvalidArgumentError, match="whole number"):
        wire.unpack_i32(b"\x01\x02\x03", "token_ids")
    with pytest.raises(InvalidArgumentError):
        wire.unpack_i64(b"\x00" * 12, "loc")


def test_session_round_trip_and_validation():
    s = Session("abc", 123456789012345, 7.5)
    assert wire.session_from_msg(wire.session_to_msg(s)) == s
    with pytest.raises(InvalidArgumentError):
        wire.session_to_msg(("abc",))
    with pytest.raises(InvalidArgumentError):
        wire.session_to_msg(Session(5, 1, 1.0))
    with pytest.raises(StaleSessionError):
        wire.session_to_msg(Session("abc", 1 << 70, 1.0))


def test_match_round_trip():
    qs = [MatchQuery(np.arange(5, dtype=np.int32)), MatchQuery(np.array([], dtype=np.int32), "ns")]
    back = wire.match_queries_from_msg(wire.match_queries_to_msg(qs))
    assert [q.extra_key for q in back] == [None, "ns"]
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(qs, back))
    infos = [MatchInfo(3, 4), MatchInfo(0, 0)]
    assert wire.match_infos_from_msg(wire.match_infos_to_msg(infos), 2) == infos
    with pytest.raises(LengthMismatchError):
        wire.match_infos_from_msg(wire.match_infos_to_msg(infos), 3)


def test_extend_round_trip():
    items = [ExtendItem("a", np.array([1, 2, 3], np.int32)), ExtendItem("b", np.array([9], np.int32), "k", -4)]
    ref = pb.SessionRef(session_id="s", epoch=1)
    back = wire.extend_items_from_msg(wire.extend_request_to_msg(ref, items))
    assert [(b.rid, b.extra_key, b.priority) for b in back] == [("a", None, 0), ("b", "k", -4)]
    assert all(np.array_equal(a.token_ids, b.token_ids) and b.token_ids.dtype == np.int32
               for a, b in zip(items, back))
    assert wire.extend_items_from_msg(wire.extend_request_to_msg(ref, [])) == []
    uni = [ExtendItem("é€", np.array([1], np.int32), ""), ExtendItem("𝔵", np.array([2], np.int32), "ü")]
    assert [(b.rid, b.extra_key) for b in wire.extend_items_from_msg(wire.extend_request_to_msg(ref, uni))] == \
        [("é€", ""), ("𝔵", "ü")]
    res = [ExtendResult("a", 3, 2, 2, 5, np.array([7, 8, 9], np.int64), -1),
           ExtendResult("b", 4, 0, 0, 0, np.zeros(0, np.int64), 6)]
    back = wire.extend_results_from_msg(wire.extend_results_to_msg(res), ["a", "b"])
    for a, b in zip(res, back):
        assert a[:5] == b[:5] and a.mamba_slot == b.mamba_slot
        assert np.array_equal(a.out_cache_loc, b.out_cache_loc) and b.out_cache_loc.dtype == np.int64
    with pytest.raises(LengthMismatchError):
        wire.extend_results_from_msg(wire.extend_results_to_msg(res), ["a"])


def test_extend_results_carry_the_tiers_and_read_zeros_from_an_older_manager():
    res = [ExtendResult("a", 3, 8, 8, 9, np.array([7], np.int64), host_len=6, storage_len=2),
           ExtendResult("b", 4, 0, 0, 1, np.array([5], np.int64))]
    msg = wire.extend_results_to_msg(res)
    back = wire.extend_results_from_msg(msg, ["a", "b"])
    assert [(b.host_len, b.storage_len) for b in back] == [(6, 2), (0, 0)]
    msg.ClearField("host_len_i64")
    msg.ClearField("storage_len_i64")  # what a manager without tiers sends
    assert [(b.host_len, b.storage_len) for b in wire.extend_results_from_msg(msg, ["a", "b"])] == [(0, 0), (0, 0)]


def test_packed_fields_that_disagree_are_refused():
    ref = pb.SessionRef(session_id="s", epoch=1)
    good = wire.extend_request_to_msg(ref, [ExtendItem("ab", np.array([1, 2], np.int32), "k", 3)])
    for field, value, err in (("rid_lens_i32", wire.pack([3], wire.I32), InvalidArgumentError),
                              ("rid_lens_i32", wire.pack([-1, 3], wire.I32), InvalidArgumentError),
                              ("rid_lens_i32", b"\x01", InvalidArgumentError),
                              ("token_lens_i32", wire.pack([3], wire.I32), LengthMismatchError),
                              ("token_lens_i32", wire.pack([2, 0], wire.I32), LengthMismatchError),
                              ("token_lens_i32", wire.pack([-1], wire.I32), InvalidArgumentError),
                              ("extra_key_lens_i32", wire.pack([1, -1], wire.I32), LengthMismatchError),
                              ("extra_key_lens_i32", wire.pack([-2], wire.I32), InvalidArgumentError),
                              ("priorities_i64", wire.pack([1, 2], wire.I64), LengthMismatchError)):
        bad = pb.AllocExtendRequest()
        bad.CopyFrom(good)
        setattr(bad, field, value)
        with pytest.raises(err):
            wire.extend_items_from_msg(bad)
    msg = wire.apply_decodes_to_msg(Session("s", 1, 1.0), [(["a", "b"], np.array([5, 6], np.int32))])
    for field, value in (("rid_index_i32", [0, 2]), ("rid_index_i32", [0, -1]), ("call_lens_i32", [3]),
                         ("call_lens_i32", [3, -1]), ("token_ids_i32", [5])):
        bad = pb.ApplyDecodesRequest()
        bad.CopyFrom(msg)
        setattr(bad, field, wire.pack(value, wire.I32))
        with pytest.raises((InvalidArgumentError, LengthMismatchError)):
            wire.apply_decodes_from_msg(bad)


def test_decode_round_trip_and_count_mismatch():
    s = Session("s", 1, 1.0)
    items = [DecodeItem("a", 5), DecodeItem("b", 2**31 - 1)]
    msg = wire.decode_items_to_msg(s, items)
    assert wire.decode_items_from_msg(msg) == items
    msg.token_ids_i32 = msg.token_ids_i32[:4]
    with pytest.raises(LengthMismatchError):
        wire.decode_items_from_msg(msg)
    r = DecodeResult(*(np.array([i, i + 1], np.int64) for i in range(4)))
    back = wire.decode_result_from_msg(wire.decode_result_to_msg(r), 2)
    assert all(np.array_equal(x, y) for x, y in zip(r, back))


def test_small_results_round_trip():
    cr = [CacheResult("a", 16), CacheResult("b", 0)]
    assert wire.cache_results_from_msg(wire.cache_results_to_msg(cr), ["a", "b"]) == cr
    with pytest.raises(LengthMismatchError):
        wire.cache_results_from_msg(wire.cache_results_to_msg(cr), ["a"])
    assert wire.evict_result_from_msg(wire.evict_result_to_msg(EvictResult(5, 1))) == EvictResult(5, 1)
    s = EngineStats(*range(1, len(EngineStats._fields) + 1))
    assert wire.stats_from_msg(wire.stats_to_msg(s)) == s


def test_stats_message_mirrors_engine_stats():
    assert [f.name for f in pb.StatsResponse.DESCRIPTOR.fields] == list(EngineStats._fields)


@pytest.mark.parametrize("event", [
    BlockStored(block_hashes=(1, (1 << 64) - 1), parent_block_hash=None,
                token_ids=np.arange(8, dtype=np.int32), block_size=4, lora_id=None, medium=None),
    BlockStored(block_hashes=(5,), parent_block_hash=(1 << 63) + 7, token_ids=np.arange(4, dtype=np.int32),
                block_size=4, lora_id=3, medium="GPU", extra_key=b"\x00\x01"),
    BlockStored(block_hashes=(5,), parent_block_hash=2, token_ids=np.arange(4, dtype=np.int32),
                block_size=4, lora_id=None, lora_name="tenant", medium="GPU", extra_key=("a", 1)),
    BlockRemoved(block_hashes=(2, (1 << 64) - 2), medium="GPU"),
    BlockRemoved(block_hashes=(), medium=None),
    AllBlocksCleared(),
])
def test_events_round_trip_exactly(event):
    d = event.to_dict()
    assert wire.event_from_msg(wire.event_to_msg(d)) == d


def test_unknown_event_is_refused():
    with pytest.raises(InvalidArgumentError):
        wire.event_to_msg({"type": "Nope"})
    with pytest.raises(InvalidArgumentError):
        wire.event_from_msg(pb.KVEvent())


def test_mappings_round_trip():
    shm = ShmDescriptor("/dev/shm/x.buf", 4096)
    cuda = CudaIpcDescriptor(0, b"\x01" * 64, 1 << 20, 512, b"rc", 3, b"ev", True, 0, 1 << 19)
    for d in (shm, cuda):
        assert wire.mapping_from_msg(wire.mapping_to_msg("kv", d)) == d
        assert wire.descriptor_from_dict(wire.descriptor_to_dict(d)) == d
    assert wire.descriptor_from_dict({"mode": "embedded", "key": "embedded-1"}) is None
    with pytest.raises(InvalidArgumentError):
        wire.mapping_from_msg(pb.PoolMapping(pool="kv"))


def test_plain_extend_request_packs_what_the_item_by_item_path_packs():
    """The client's fast path: for the common items the same bytes as validating item by
    item; None (the slow path then validates and raises) for anything else."""
    ref = pb.SessionRef(session_id="s", epoch=1)
    a, b = np.array([1, 2, 3], np.int32), np.arange(5, dtype=np.int32)[::2]  # b: not contiguous
    plain = ([ExtendItem("a", a), ExtendItem("bé", b)], (ExtendItem("a", a, None, 3), ExtendItem("b", b, None, -4)))
    for items in plain:
        fast = wire.plain_extend_request(ref, items)
        assert fast is not None
        assert fast.SerializeToString() == wire.extend_request_to_msg(ref, list(items)).SerializeToString()
        back = wire.extend_items_from_msg(fast)
        assert [(it.rid, it.token_ids.tolist(), it.priority) for it in back] == \
            [(it.rid, it.token_ids.tolist(), it.priority) for it in items]
    for bad in ([], "ab", [("a", a)], [ExtendItem("a", a), ExtendItem("a", b)], [ExtendItem("", a)],
                [ExtendItem("x" * 257, a)], [ExtendItem(b"a", a)], [ExtendItem("a", a.astype(np.int64))],
                [ExtendItem("a", a.astype(">i4"))], [ExtendItem("a", a.reshape(1, 3))], [ExtendItem("a", a[:0])],
                [ExtendItem("a", np.array([1, -1], np.int32))], [ExtendItem("a", [1, 2])],
                [ExtendItem("a", a, "k")], [ExtendItem("a", a, None, True)], [ExtendItem("a", a, None, np.int64(1))],
                [ExtendItem("a", a, None, 1 << 63)]):
        assert wire.plain_extend_request(ref, bad) is None, bad
