"""The wire form: numpy arrays <-> packed little-endian bytes, protocol NamedTuples <-> messages.

Token ids travel as packed ``<i4`` bytes, indices and lengths as ``<i8``, block hashes as
``<u8`` (``len(bytes) == itemsize * count``), never as repeated varints. Decoding copies
into native-order, writable numpy arrays (one ``frombuffer`` + ``astype``: O(n), no Python
loop per element).

Every ``*_to_msg`` function has a ``*_from_msg`` inverse; ``tests/service/test_wire.py``
round-trips them. Decoding validates what the wire can get wrong (a byte string that is
not a whole number of items, counts that disagree) and raises ``InvalidArgumentError`` /
``LengthMismatchError``; the engine validates the meaning.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.shm import CudaIpcDescriptor, Descriptor, ShmDescriptor

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

I32, I64, U64 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<u8")


# --------------------------------------------------------------------------- arrays


def pack(values: Any, dtype: np.dtype) -> bytes:
    """Packed little-endian bytes of ``values`` as ``dtype`` (a 1-D copy when needed)."""
    return np.ascontiguousarray(values, dtype=dtype).reshape(-1).tobytes()


def unpack(data: bytes, dtype: np.dtype, field: str, native: Any = None) -> np.ndarray:
    """The array packed in ``data`` (native order, writable).

    Raises:
        InvalidArgumentError: ``len(data)`` is not a multiple of the item size.
    """
    if len(data) % dtype.itemsize:
        raise InvalidArgumentError(
            f"{field}: {len(data)} bytes is not a whole number of {dtype.itemsize}-byte items")
    return np.frombuffer(data, dtype=dtype).astype(native or dtype.newbyteorder("="), copy=True)


def unpack_i32(data: bytes, field: str) -> np.ndarray:
    return unpack(data, I32, field, np.int32)


def unpack_i64(data: bytes, field: str) -> np.ndarray:
    return unpack(data, I64, field, np.int64)


def _count(arr: np.ndarray, n: int, field: str) -> np.ndarray:
    if arr.shape[0] != n:
        raise LengthMismatchError(f"{field}: {arr.shape[0]} values for {n} entries")
    return arr


# --------------------------------------------------------------------------- sessions


_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


def session_to_msg(session: Session) -> pb.SessionRef:
    """Raises ``InvalidArgumentError`` for what is not a Session (as the engine does) and
    ``StaleSessionError`` for an epoch no manager can have (outside int64)."""
    if not isinstance(session, tuple) or len(session) < 2:
        raise InvalidArgumentError("a Session is (session_id: str, epoch: int, lease_ttl_s: float)")
    sid, epoch = session[0], session[1]
    if not isinstance(sid, str) or isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)):
        raise InvalidArgumentError("a Session is (session_id: str, epoch: int, lease_ttl_s: float)")
    if not _I64_MIN <= int(epoch) <= _I64_MAX:
        raise StaleSessionError(f"session {sid!r} is from epoch {int(epoch)}, not this manager's")
    ttl = session[2] if len(session) > 2 else 0.0
    ttl = float(ttl) if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) else 0.0
    secret = session[3] if len(session) > 3 else b""
    if not isinstance(secret, bytes):
        raise InvalidArgumentError("a Session's secret is bytes")
    return pb.SessionRef(session_id=sid, epoch=int(epoch), lease_ttl_s=ttl, secret=secret)


def session_from_msg(msg: pb.SessionRef) -> Session:
    """The session a message names, with the secret it carries."""
    return Session(msg.session_id, int(msg.epoch), float(msg.lease_ttl_s), bytes(msg.secret))


# --------------------------------------------------------------------------- match


def match_queries_to_msg(queries: Sequence[MatchQuery]) -> list[pb.MatchQuery]:
    out = []
    for q in queries:
        m = pb.MatchQuery(token_ids_i32=pack(q.token_ids, I32))
        if q.extra_key is not None:
            m.extra_key = q.extra_key
        out.append(m)
    return out


def match_queries_from_msg(msgs: Sequence[pb.MatchQuery]) -> list[MatchQuery]:
    return [MatchQuery(unpack_i32(m.token_ids_i32, "token_ids"),
                       m.extra_key if m.HasField("extra_key") else None) for m in msgs]


def match_infos_to_msg(infos: Sequence[MatchInfo]) -> pb.MatchResponse:
    return pb.MatchResponse(prefix_len_i64=pack([i.prefix_len for i in infos], I64),
                            kv_prefix_len_i64=pack([i.kv_prefix_len for i in infos], I64))


def match_infos_from_msg(msg: pb.MatchResponse, n: int) -> list[MatchInfo]:
    p = _count(unpack_i64(msg.prefix_len_i64, "prefix_len"), n, "prefix_len")
    k = _count(unpack_i64(msg.kv_prefix_len_i64, "kv_prefix_len"), n, "kv_prefix_len")
    return [MatchInfo(int(a), int(b)) for a, b in zip(p.tolist(), k.tolist())]


# --------------------------------------------------------------------------- extend


def extend_items_to_msg(items: Sequence[ExtendItem]) -> list[pb.ExtendItem]:
    out = []
    for it in items:
        m = pb.ExtendItem(rid=it.rid, token_ids_i32=pack(it.token_ids, I32), priority=int(it.priority))
        if it.extra_key is not None:
            m.extra_key = it.extra_key
        out.append(m)
    return out


def extend_items_from_msg(msgs: Sequence[pb.ExtendItem]) -> list[ExtendItem]:
    return [ExtendItem(m.rid, unpack_i32(m.token_ids_i32, "token_ids"),
                       m.extra_key if m.HasField("extra_key") else None, int(m.priority)) for m in msgs]


def extend_results_to_msg(results: Sequence[ExtendResult]) -> pb.AllocExtendResponse:
    return pb.AllocExtendResponse(results=[
        pb.ExtendResult(rid=r.rid, req_pool_idx=int(r.req_pool_idx), prefix_len=int(r.prefix_len),
                        start=int(r.start), seq_len=int(r.seq_len),
                        out_cache_loc_i64=pack(r.out_cache_loc, I64), mamba_slot=int(r.mamba_slot),
                        reserved_i64=pack(r.reserved, I64), track_slot=int(r.track_slot),
                        track_seqlen=int(r.track_seqlen))
        for r in results])


def extend_results_from_msg(msg: pb.AllocExtendResponse) -> list[ExtendResult]:
    return [ExtendResult(m.rid, int(m.req_pool_idx), int(m.prefix_len), int(m.start), int(m.seq_len),
                         unpack_i64(m.out_cache_loc_i64, "out_cache_loc"), int(m.mamba_slot),
                         unpack_i64(m.reserved_i64, "reserved"), int(m.track_slot), int(m.track_seqlen))
            for m in msg.results]


# --------------------------------------------------------------------------- decode


def decode_items_to_msg(session: Session, items: Sequence[DecodeItem]) -> pb.AllocDecodeRequest:
    return pb.AllocDecodeRequest(session=session_to_msg(session), rids=[it.rid for it in items],
                                 token_ids_i32=pack([it.token_id for it in items], I32))


def decode_items_from_msg(msg: pb.AllocDecodeRequest) -> list[DecodeItem]:
    tokens = _count(unpack_i32(msg.token_ids_i32, "token_ids"), len(msg.rids), "token_ids")
    return [DecodeItem(rid, tok) for rid, tok in zip(msg.rids, tokens.tolist())]


def decode_result_to_msg(r: DecodeResult) -> pb.AllocDecodeResponse:
    return pb.AllocDecodeResponse(out_cache_loc_i64=pack(r.out_cache_loc, I64), seq_lens_i64=pack(r.seq_lens, I64),
                                  req_pool_indices_i64=pack(r.req_pool_indices, I64),
                                  mamba_slots_i64=pack(r.mamba_slots, I64), reserved_i64=pack(r.reserved, I64),
                                  reserved_lens_i64=pack(r.reserved_lens, I64),
                                  track_slots_i64=pack(r.track_slots, I64))


def decode_result_from_msg(msg: pb.AllocDecodeResponse, n: int) -> DecodeResult:
    """Raises ``LengthMismatchError`` when a per-request array does not have ``n`` values,
    ``reserved_lens`` has neither 0 nor ``n``, or the lengths do not add up to ``reserved``."""
    arrays = [_count(unpack_i64(getattr(msg, f + "_i64"), f), n, f)
              for f in ("out_cache_loc", "seq_lens", "req_pool_indices", "mamba_slots")]
    reserved = unpack_i64(msg.reserved_i64, "reserved")
    lens = unpack_i64(msg.reserved_lens_i64, "reserved_lens")
    if lens.size and lens.size != n:
        raise LengthMismatchError(f"reserved_lens: {lens.size} values for {n} entries")
    if int(lens.sum()) != reserved.size or (lens.size and int(lens.min()) < 0):
        raise LengthMismatchError(f"reserved_lens add up to {int(lens.sum())}, reserved has {reserved.size}")
    track = unpack_i64(msg.track_slots_i64, "track_slots")
    if track.size and track.size != n:
        raise LengthMismatchError(f"track_slots: {track.size} values for {n} entries")
    return DecodeResult(*arrays, reserved, lens, track)


def apply_decodes_to_msg(session: Session, calls: Sequence[pb.AllocDecodeRequest]) -> pb.ApplyDecodesRequest:
    """The replay of ``calls`` (AllocDecodeRequests with no session of their own)."""
    return pb.ApplyDecodesRequest(session=session_to_msg(session), calls=calls)


# --------------------------------------------------------------------------- cache / evict / stats


def cache_results_to_msg(results: Sequence[CacheResult]) -> pb.CacheResponse:
    return pb.CacheResponse(results=[pb.CacheResult(rid=r.rid, cached_len=int(r.cached_len)) for r in results])


def cache_results_from_msg(msg: pb.CacheResponse) -> list[CacheResult]:
    return [CacheResult(m.rid, int(m.cached_len)) for m in msg.results]


def evict_result_to_msg(r: EvictResult) -> pb.EvictResponse:
    return pb.EvictResponse(tokens=int(r.tokens), states=int(r.states))


def evict_result_from_msg(msg: pb.EvictResponse) -> EvictResult:
    return EvictResult(int(msg.tokens), int(msg.states))


def stats_to_msg(s: EngineStats) -> pb.StatsResponse:
    return pb.StatsResponse(**{f: int(getattr(s, f)) for f in EngineStats._fields})


def stats_from_msg(msg: pb.StatsResponse) -> EngineStats:
    return EngineStats(**{f: int(getattr(msg, f)) for f in EngineStats._fields})


# --------------------------------------------------------------------------- events


def event_to_msg(d: dict[str, Any]) -> pb.KVEvent:
    """A ``to_dict()`` KV event (BlockStored / BlockRemoved / AllBlocksCleared) as a message.

    Raises:
        InvalidArgumentError: an unknown event type.
    """
    kind = d.get("type")
    if kind == "BlockStored":
        m = pb.BlockStored(block_hashes_u64=pack(d["block_hashes"], U64),
                           token_ids_i32=pack(d["token_ids"], I32), block_size=int(d["block_size"]),
                           extra_key_json=json.dumps(d.get("extra_key")))
        for f in ("parent_block_hash", "lora_id", "medium", "lora_name"):
            if d.get(f) is not None:
                setattr(m, f, d[f])
        return pb.KVEvent(block_stored=m)
    if kind == "BlockRemoved":
        m = pb.BlockRemoved(block_hashes_u64=pack(d["block_hashes"], U64))
        if d.get("medium") is not None:
            m.medium = d["medium"]
        return pb.KVEvent(block_removed=m)
    if kind == "AllBlocksCleared":
        return pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared())
    raise InvalidArgumentError(f"unknown KV event type {kind!r}")


def _opt(m: Any, f: str) -> Any:
    return getattr(m, f) if m.HasField(f) else None


def event_from_msg(msg: pb.KVEvent) -> dict[str, Any]:
    """Inverse of :func:`event_to_msg`: the same dict ``to_dict()`` gave."""
    kind = msg.WhichOneof("event")
    if kind == "block_stored":
        m = msg.block_stored
        return {
            "type": "BlockStored",
            "block_hashes": unpack(m.block_hashes_u64, U64, "block_hashes", np.uint64).tolist(),
            "parent_block_hash": _opt(m, "parent_block_hash"),
            "token_ids": unpack_i32(m.token_ids_i32, "token_ids").tolist(),
            "block_size": int(m.block_size),
            "lora_id": _opt(m, "lora_id"),
            "medium": _opt(m, "medium"),
            "lora_name": _opt(m, "lora_name"),
            "extra_key": json.loads(m.extra_key_json) if m.extra_key_json else None,
        }
    if kind == "block_removed":
        m = msg.block_removed
        return {"type": "BlockRemoved",
                "block_hashes": unpack(m.block_hashes_u64, U64, "block_hashes", np.uint64).tolist(),
                "medium": _opt(m, "medium")}
    if kind == "all_blocks_cleared":
        return {"type": "AllBlocksCleared"}
    raise InvalidArgumentError("an empty KV event")


# --------------------------------------------------------------------------- buffers


def mapping_to_msg(pool: str, desc: Descriptor) -> pb.PoolMapping:
    if isinstance(desc, ShmDescriptor):
        return pb.PoolMapping(pool=pool, shm=pb.ShmFile(path=desc.path, nbytes=int(desc.nbytes)))
    if isinstance(desc, CudaIpcDescriptor):
        return pb.PoolMapping(pool=pool, cuda_ipc=pb.CudaIpcHandle(**desc._asdict()))
    raise InvalidArgumentError(f"not a buffer descriptor: {type(desc).__name__}")


def mapping_from_msg(msg: pb.PoolMapping) -> Descriptor:
    kind = msg.WhichOneof("source")
    if kind == "shm":
        return ShmDescriptor(msg.shm.path, int(msg.shm.nbytes))
    if kind == "cuda_ipc":
        c = msg.cuda_ipc
        return CudaIpcDescriptor(**{f: getattr(c, f) for f in CudaIpcDescriptor._fields})
    raise InvalidArgumentError(f"pool {msg.pool!r}: a mapping with no source")


def descriptor_to_dict(desc: Descriptor) -> dict[str, Any]:
    """The JSON-able form a layout carries per pool under ``"mapping"`` (``mode`` is
    ``"shm"`` or ``"cuda_ipc"``; the engine's in-process one is ``"embedded"``)."""
    if isinstance(desc, ShmDescriptor):
        return {"mode": "shm", "path": desc.path, "nbytes": int(desc.nbytes)}
    d: dict[str, Any] = {"mode": "cuda_ipc"}
    for f, v in desc._asdict().items():
        d[f] = v.hex() if isinstance(v, bytes) else v
    return d


def descriptor_from_dict(d: dict[str, Any]) -> Descriptor | None:
    """Inverse of :func:`descriptor_to_dict` (None for ``{"mode": "embedded"}``/unknown)."""
    kind = d.get("mode") if isinstance(d, dict) else None
    if kind == "shm":
        return ShmDescriptor(str(d["path"]), int(d["nbytes"]))
    if kind == "cuda_ipc":
        vals = {f: d[f] for f in CudaIpcDescriptor._fields}
        for f in ("handle", "ref_counter_handle", "event_handle"):
            vals[f] = bytes.fromhex(vals[f])
        return CudaIpcDescriptor(**vals)
    return None
