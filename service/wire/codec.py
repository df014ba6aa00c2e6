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
import operator
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


def pack_strs(strs: Sequence[str | None]) -> tuple[str, bytes]:
    """``strs`` packed: their concatenation and the length of each in characters (-1 for
    None). O(total length)."""
    return "".join(s for s in strs if s is not None), pack([-1 if s is None else len(s) for s in strs], I32)


def unpack_strs(text: str, lens_data: bytes, field: str, optional: bool = False, n: int | None = None) -> list[Any]:
    """Inverse of :func:`pack_strs` (lengths of -1 are None only when ``optional``).

    Raises:
        InvalidArgumentError: a length below 0 (-1 when ``optional``), or lengths that do
            not add up to ``len(text)``; ``LengthMismatchError``: not ``n`` lengths (when given).
    """
    lens = unpack_i32(lens_data, field + "_lens").astype(np.int64)
    if n is not None:
        _count(lens, n, field + "_lens")
    if lens.size and int(lens.min()) < (-1 if optional else 0):
        raise InvalidArgumentError(f"{field}_lens: a negative length")
    ends = np.cumsum(np.maximum(lens, 0))
    if (int(ends[-1]) if ends.size else 0) != len(text):
        raise InvalidArgumentError(f"{field}_lens: add up to {int(ends[-1]) if ends.size else 0}, {field} has "
                                   f"{len(text)} characters")
    b = ends.tolist()
    a = [0] + b[:-1]
    if not optional:
        return [text[i:j] for i, j in zip(a, b)]
    return [None if n < 0 else text[i:j] for i, j, n in zip(a, b, lens.tolist())]


def _split(flat: np.ndarray, lens: np.ndarray, field: str) -> list[np.ndarray]:
    """``flat`` cut into consecutive pieces of ``lens`` values (views). Raises
    ``InvalidArgumentError`` for a negative length or lengths not adding up to ``flat.size``."""
    if lens.size and int(lens.min()) < 0:
        raise InvalidArgumentError(f"{field}: a negative length")
    ends = np.cumsum(lens, dtype=np.int64)
    if (int(ends[-1]) if ends.size else 0) != flat.size:
        raise LengthMismatchError(f"{field}: lengths add up to {int(ends[-1]) if ends.size else 0}, "
                                  f"{flat.size} values sent")
    b = ends.tolist()
    return [flat[i:j] for i, j in zip([0] + b[:-1], b)]


def _concat(arrays: Sequence[np.ndarray], dtype: np.dtype) -> bytes:
    return np.concatenate(arrays).astype(dtype, copy=False).tobytes() if len(arrays) else b""


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
                            kv_prefix_len_i64=pack([i.kv_prefix_len for i in infos], I64),
                            host_len_i64=pack([i.host_len for i in infos], I64),
                            storage_len_i64=pack([i.storage_len for i in infos], I64))


def _optional_col(data: bytes, n: int, field: str) -> list[int]:
    """A per-item int64 column that an empty field means all 0 of (the tier columns: a
    manager without tiers sends none)."""
    return _count(unpack_i64(data, field), n, field).tolist() if data else [0] * n


def match_infos_from_msg(msg: pb.MatchResponse, n: int) -> list[MatchInfo]:
    p = _count(unpack_i64(msg.prefix_len_i64, "prefix_len"), n, "prefix_len")
    k = _count(unpack_i64(msg.kv_prefix_len_i64, "kv_prefix_len"), n, "kv_prefix_len")
    h = _optional_col(msg.host_len_i64, n, "host_len")
    s = _optional_col(msg.storage_len_i64, n, "storage_len")
    return [MatchInfo(int(a), int(b), c, d) for a, b, c, d in zip(p.tolist(), k.tolist(), h, s)]


# --------------------------------------------------------------------------- extend


def extend_request_to_msg(ref: pb.SessionRef, items: Sequence[ExtendItem]) -> pb.AllocExtendRequest:
    """The packed ``AllocExtendRequest`` of ``items`` (validated: int32 token arrays)."""
    rids, rid_lens = pack_strs([it.rid for it in items])
    toks = [it.token_ids for it in items]
    m = pb.AllocExtendRequest(session=ref, rids=rids, rid_lens_i32=rid_lens, token_ids_i32=_concat(toks, I32),
                              token_lens_i32=pack([t.size for t in toks], I32))
    keys = [it.extra_key for it in items]
    if any(k is not None for k in keys):
        m.extra_keys, m.extra_key_lens_i32 = pack_strs(keys)
    if any(it.priority for it in items):
        m.priorities_i64 = pack([int(it.priority) for it in items], I64)
    return m


def plain_extend_request(ref: pb.SessionRef, items: Any) -> pb.AllocExtendRequest | None:
    """The packed ``AllocExtendRequest`` of ``items`` when they are the common case, else
    None (nothing raised: the caller then validates item by item, with the engine's messages):
    a non-empty list/tuple of ``ExtendItem`` with distinct non-empty ``str`` rids of at most
    ``MAX_RID_LEN`` characters, non-empty 1-D int32 numpy token arrays with no negative id,
    no ``extra_key`` and ``int`` priorities within int64 -- exactly what the item-by-item
    checks (``radixkv.validation``) accept, checked in C-level passes over the items and one
    reduction over the packed tokens (no Python loop per item, no rebuilt items)."""
    if type(items) not in (list, tuple) or not items or set(map(type, items)) != {ExtendItem}:
        return None
    # here, not at the top: radixkv.validation loads torch (~2 CPU-s), which a process that
    # only packs messages (the chaos workers of tests/reliability) never needs
    from radixkv.validation import MAX_RID_LEN

    n = len(items)
    rids, toks, keys, pris = zip(*items)
    if set(map(type, rids)) != {str} or len(set(rids)) != n:
        return None
    rid_lens = list(map(len, rids))
    if min(rid_lens) < 1 or max(rid_lens) > MAX_RID_LEN or keys.count(None) != n:
        return None
    if set(map(type, pris)) != {int} or min(pris) < _I64_MIN or max(pris) > _I64_MAX:
        return None
    if set(map(type, toks)) != {np.ndarray} or set(map(_DTYPE, toks)) != {_I32_NATIVE} \
            or set(map(_NDIM, toks)) != {1}:
        return None
    tok_lens = list(map(len, toks))
    if min(tok_lens) < 1:
        return None
    flat = np.concatenate(toks)
    if int(flat.min()) < 0:
        return None
    m = pb.AllocExtendRequest(session=ref, rids="".join(rids), rid_lens_i32=pack(rid_lens, I32),
                              token_ids_i32=flat.astype(I32, copy=False).tobytes(),
                              token_lens_i32=pack(tok_lens, I32))
    if any(pris):
        m.priorities_i64 = pack(pris, I64)
    return m


_DTYPE, _NDIM, _I32_NATIVE = operator.attrgetter("dtype"), operator.attrgetter("ndim"), np.dtype(np.int32)


def extend_items_from_msg(msg: pb.AllocExtendRequest) -> list[ExtendItem]:
    """The items of a packed ``AllocExtendRequest`` (token arrays are views of one copy).
    Raises ``InvalidArgumentError`` / ``LengthMismatchError`` for fields that disagree."""
    rids = unpack_strs(msg.rids, msg.rid_lens_i32, "rids")
    n = len(rids)
    lens = _count(unpack_i32(msg.token_lens_i32, "token_lens"), n, "token_lens")
    toks = _split(unpack_i32(msg.token_ids_i32, "token_ids"), lens, "token_lens")
    if msg.extra_key_lens_i32 or msg.extra_keys:
        keys = unpack_strs(msg.extra_keys, msg.extra_key_lens_i32, "extra_keys", optional=True, n=n)
    else:
        keys = [None] * n
    pri = _count(unpack_i64(msg.priorities_i64, "priorities"), n, "priorities").tolist() \
        if msg.priorities_i64 else [0] * n
    return [ExtendItem(*it) for it in zip(rids, toks, keys, pri)]


_EXTEND_COLS = ("req_pool_idx", "prefix_len", "start", "seq_len", "mamba_slot", "track_slot", "track_seqlen",
                "host_len", "storage_len")
_OPTIONAL_COLS = ("host_len", "storage_len")  # empty from a manager without tiers: zeros


def extend_results_to_msg(results: Sequence[ExtendResult]) -> pb.AllocExtendResponse:
    cols = np.array([[getattr(r, f) for f in _EXTEND_COLS] for r in results],
                    dtype=I64).reshape(-1, len(_EXTEND_COLS)).T.copy()
    res = [r.reserved for r in results]
    return pb.AllocExtendResponse(**{f + "_i64": c.tobytes() for f, c in zip(_EXTEND_COLS, cols)},
                                  out_cache_loc_i64=_concat([r.out_cache_loc for r in results], I64),
                                  reserved_i64=_concat(res, I64), reserved_lens_i64=pack([x.size for x in res], I64))


def extend_results_from_msg(msg: pb.AllocExtendResponse, rids: Sequence[str]) -> list[ExtendResult]:
    """The results of the extend of ``rids`` (in their order). Raises ``LengthMismatchError``
    when a field does not have one value per rid or the slot counts do not add up."""
    n = len(rids)
    cols = {f: np.zeros(n, dtype=I64) if f in _OPTIONAL_COLS and not getattr(msg, f + "_i64")
            else _count(unpack_i64(getattr(msg, f + "_i64"), f), n, f) for f in _EXTEND_COLS}
    out = _split(unpack_i64(msg.out_cache_loc_i64, "out_cache_loc"), cols["seq_len"] - cols["start"], "out_cache_loc")
    res = _split(unpack_i64(msg.reserved_i64, "reserved"),
                 _count(unpack_i64(msg.reserved_lens_i64, "reserved_lens"), n, "reserved_lens"), "reserved_lens")
    c = [cols[f].tolist() for f in _EXTEND_COLS]
    return [ExtendResult(rid, c[0][i], c[1][i], c[2][i], c[3][i], out[i], c[4][i], res[i], c[5][i], c[6][i],
                         c[7][i], c[8][i]) for i, rid in enumerate(rids)]


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
    loc, seq_lens, rows, slots = (_count(unpack_i64(getattr(msg, f + "_i64"), f), n, f)
                                  for f in ("out_cache_loc", "seq_lens", "req_pool_indices", "mamba_slots"))
    reserved = unpack_i64(msg.reserved_i64, "reserved")
    lens = unpack_i64(msg.reserved_lens_i64, "reserved_lens")
    if lens.size and lens.size != n:
        raise LengthMismatchError(f"reserved_lens: {lens.size} values for {n} entries")
    if int(lens.sum()) != reserved.size or (lens.size and int(lens.min()) < 0):
        raise LengthMismatchError(f"reserved_lens add up to {int(lens.sum())}, reserved has {reserved.size}")
    track = unpack_i64(msg.track_slots_i64, "track_slots")
    if track.size and track.size != n:
        raise LengthMismatchError(f"track_slots: {track.size} values for {n} entries")
    return DecodeResult(loc, seq_lens, rows, slots, reserved, lens, track)


def apply_decodes_to_msg(session: Session, calls: Sequence[tuple[Sequence[str], np.ndarray]]) -> pb.ApplyDecodesRequest:
    """The packed replay of decode ``calls`` (each: its rids and their int32 tokens). O(items);
    consecutive calls naming the same rid list object (a batch decoded step after step) share
    one index array, built once."""
    index: dict[str, int] = {}
    parts, prev, cur = [], None, np.empty(0, I32)
    for names, _ in calls:
        if names is not prev:
            cur = np.fromiter([index.setdefault(rid, len(index)) for rid in names], I32, len(names))
            prev = names
        parts.append(cur)
    rids, rid_lens = pack_strs(list(index))
    return pb.ApplyDecodesRequest(session=session_to_msg(session), rids=rids, rid_lens_i32=rid_lens,
                                  call_lens_i32=pack([len(r) for r, _ in calls], I32),
                                  rid_index_i32=_concat(parts, I32), token_ids_i32=_concat([t for _, t in calls], I32))


def apply_decodes_from_msg(msg: pb.ApplyDecodesRequest) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """A packed replay as ``(rids, call_lens, rid_index, token_ids)``: the distinct rids, items
    per call, and per item (calls concatenated) its rid's index and its token (int32 arrays).
    Raises ``InvalidArgumentError`` / ``LengthMismatchError`` when they disagree (an index
    outside ``rids``, counts that do not add up)."""
    rids = unpack_strs(msg.rids, msg.rid_lens_i32, "rids")
    lens = unpack_i32(msg.call_lens_i32, "call_lens")
    idx = unpack_i32(msg.rid_index_i32, "rid_index")
    toks = _count(unpack_i32(msg.token_ids_i32, "token_ids"), idx.size, "token_ids")
    if lens.size and int(lens.min()) < 0 or int(lens.sum(dtype=np.int64)) != idx.size:
        raise LengthMismatchError(f"call_lens: add up to {int(lens.sum(dtype=np.int64))}, {idx.size} items sent")
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= len(rids)):
        raise InvalidArgumentError(f"rid_index: an index outside the {len(rids)} rids")
    return rids, lens, idx, toks


# --------------------------------------------------------------------------- cache / evict / stats


def cache_results_to_msg(results: Sequence[CacheResult]) -> pb.CacheResponse:
    return pb.CacheResponse(cached_len_i64=pack([r.cached_len for r in results], I64))


def cache_results_from_msg(msg: pb.CacheResponse, rids: Sequence[str]) -> list[CacheResult]:
    lens = _count(unpack_i64(msg.cached_len_i64, "cached_len"), len(rids), "cached_len").tolist()
    return [CacheResult(*r) for r in zip(rids, lens)]


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
        rm = pb.BlockRemoved(block_hashes_u64=pack(d["block_hashes"], U64))
        if d.get("medium") is not None:
            rm.medium = d["medium"]
        return pb.KVEvent(block_removed=rm)
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
        rm = msg.block_removed
        return {"type": "BlockRemoved",
                "block_hashes": unpack(rm.block_hashes_u64, U64, "block_hashes", np.uint64).tolist(),
                "medium": _opt(rm, "medium")}
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
