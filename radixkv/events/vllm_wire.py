"""vLLM's KV-event wire format: the msgpack bytes of one ``KVEventBatch``.

Writes (with ``msgpack``) and reads the bytes vLLM's ``msgspec`` structs
(``vllm/distributed/kv_events.py``) produce, byte for byte, so any vLLM-event consumer
decodes radixkv's batches. A batch is ``[ts, events, data_parallel_rank]``; events are tagged
in the ``"array"`` layout (``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name]``, ``["BlockRemoved", ...]``,
``["AllBlocksCleared"]``) or the ``"map"`` layout. Hashes are u64; the namespace travels as
``lora_name`` (``str``) or ``lora_id`` (``int``), others decode as ``None``. Later optional
vLLM fields are not written, so every vLLM version reads the batches. Hybrid state events
(``StateStored`` / ``StateRemoved``) are radixkv's own tags, dropped by :func:`encode_batch`
unless ``state_events="inline"``. The byte layout, with an annotated example:
``docs/events.md``, "Payload" and "Layouts".
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, TypeVar

import msgpack
import numpy as np

from radixkv.cache.hybrid.state_events import CacheEvent, StateRemoved, StateStored, as_events, is_state_event
from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from radixkv.errors import InvalidArgumentError, LengthMismatchError

__all__ = ["LAYOUTS", "STATE_POLICIES", "encode_batch", "encode_event", "decode_batch", "as_events"]

#: Event layouts: ``"array"`` (array_like tagged structs) and ``"map"`` (tagged maps).
LAYOUTS = ("array", "map")
#: What :func:`encode_batch` does with state events: drop them, write them, or refuse.
STATE_POLICIES = ("drop", "inline", "error")

_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
    "StateStored": ("block_hash", "position", "medium"),
    "StateRemoved": ("block_hashes", "medium"),
}
_U64 = 1 << 64
_I32 = np.iinfo(np.int32)
_T = TypeVar("_T")


# --------------------------------------------------------------------------- encoding


def _values(event: object) -> tuple[str, tuple[object, ...]]:
    """(tag, field values in declaration order), validated."""
    if isinstance(event, BlockStored):
        hashes = [_hash(int(h), "block_hashes") for h in event.block_hashes]
        if event.parent_block_hash is not None:
            _hash(int(event.parent_block_hash), "parent_block_hash")
        tokens = np.asarray(event.token_ids)
        if tokens.ndim != 1 or tokens.size != len(hashes) * int(event.block_size):
            raise LengthMismatchError(f"BlockStored: {len(hashes)} hashes of {event.block_size} tokens "
                                      f"but {tokens.size} token ids")
        return "BlockStored", (hashes, event.parent_block_hash, tokens.tolist(), int(event.block_size),
                               event.lora_id, event.medium, event.lora_name)
    if isinstance(event, BlockRemoved):
        return "BlockRemoved", ([_hash(int(h), "block_hashes") for h in event.block_hashes], event.medium)
    if isinstance(event, AllBlocksCleared):
        return "AllBlocksCleared", ()
    if isinstance(event, StateStored):
        return "StateStored", (int(event.block_hash), int(event.position), event.medium)
    if isinstance(event, StateRemoved):
        return "StateRemoved", ([_hash(int(h), "block_hashes") for h in event.block_hashes], event.medium)
    raise InvalidArgumentError(f"not a KV event: {type(event).__name__}")


def encode_event(event: object, layout: str = "array") -> list[object] | dict[str, object]:
    """The msgpack-ready form of one event (a list for ``"array"``, a dict for ``"map"``)."""
    tag, values = _values(event)
    if layout == "array":
        return [tag, *values]
    if layout == "map":
        # omit_defaults: no field of these seven structs has a default, so all stay.
        return {"type": tag, **dict(zip(_FIELDS[tag], values))}
    raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def encode_batch(events: KVEventBatch | Iterable[object], *, ts: float | None = None,
                 data_parallel_rank: int | None = None, layout: str = "array", state_events: str = "drop") -> bytes:
    """The msgpack bytes of one vLLM ``KVEventBatch``.

    Args:
        events: a :class:`KVEventBatch` (its ``ts`` / ``data_parallel_rank`` unless given
            here), or a sequence of events or their ``to_dict()`` dicts.
        ts, data_parallel_rank: override the batch's (defaults ``time.time()``, nil).
        layout: ``"array"`` or ``"map"``; state_events: ``"drop"`` (default), ``"inline"``,
            ``"error"``. Raises InvalidArgumentError / LengthMismatchError for a bad event.

    O(total tokens), no per-token Python loop (numpy ``tolist`` + C msgpack).
    """
    if layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if state_events not in STATE_POLICIES:
        raise InvalidArgumentError(f"state_events must be one of {STATE_POLICIES}, got {state_events!r}")
    if isinstance(events, KVEventBatch):
        ts = events.ts if ts is None else ts
        if data_parallel_rank is None:
            data_parallel_rank = events.data_parallel_rank
        events = events.events
    evs = as_events(events)
    if state_events != "inline":
        if state_events == "error" and any(map(is_state_event, evs)):
            raise InvalidArgumentError("state events in a batch for a vLLM consumer")
        evs = [e for e in evs if not is_state_event(e)]
    ts = time.time() if ts is None else ts
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise InvalidArgumentError(f"ts must be a number, got {ts!r}")
    if data_parallel_rank is not None and (isinstance(data_parallel_rank, bool)
                                           or not isinstance(data_parallel_rank, int)):
        raise InvalidArgumentError(f"data_parallel_rank must be an int or None, got {data_parallel_rank!r}")
    body = [float(ts), [encode_event(e, layout) for e in evs], data_parallel_rank]
    packed: bytes = msgpack.packb(body, use_bin_type=True)  # msgpack ships no types
    return packed


# --------------------------------------------------------------------------- decoding


def _fail(path: str, msg: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"bad KV event batch at {path}: {msg}")


def _hash(v: object, path: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _U64:
        raise _fail(path, f"a block hash must be a u64 int, got {v!r}")
    return v


def _hashes(v: object, path: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise _fail(path, f"block_hashes must be an array, got {type(v).__name__}")
    return tuple(_hash(h, f"{path}[{i}]") for i, h in enumerate(v))


def _opt(v: object, kind: type[_T], path: str) -> _T | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, kind):
        raise _fail(path, f"expected {kind.__name__} or nil, got {v!r}")
    return v


def _fields(raw: object, path: str) -> tuple[str, dict[str, object]]:
    """(tag, {field: value}) of one encoded event, either layout."""
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise _fail(path, "an array event must start with its tag")
        tag: str = raw[0]
        if tag not in _FIELDS:
            raise _fail(path, f"unknown event tag {tag!r}")
        names = _FIELDS[tag]
        if len(raw) - 1 < len(names):
            raise _fail(path, f"{tag} needs {len(names)} fields, got {len(raw) - 1}")
        return tag, dict(zip(names, raw[1:]))  # trailing extra fields are ignored, as msgspec does
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str) or kind not in _FIELDS:  # a list or map tag is unhashable: no TypeError
            raise _fail(path, f"unknown event tag {kind!r}")
        missing = [n for n in _FIELDS[kind] if n not in raw]
        if missing:
            raise _fail(path, f"{kind} lacks fields {missing}")
        return kind, raw
    raise _fail(path, f"an event must be an array or a map, got {type(raw).__name__}")


def _decode_event(raw: object, path: str, allow_state: bool) -> CacheEvent:
    tag, f = _fields(raw, path)
    if tag == "BlockStored":
        hashes = _hashes(f["block_hashes"], f"{path}.block_hashes")
        parent = f["parent_block_hash"]
        if parent is not None:
            parent = _hash(parent, f"{path}.parent_block_hash")
        size = f["block_size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise _fail(f"{path}.block_size", f"must be an int >= 1, got {size!r}")
        toks = f["token_ids"]
        if not isinstance(toks, list):
            raise _fail(f"{path}.token_ids", "must be an array")
        try:
            arr = np.asarray(toks, dtype=np.int64) if toks else np.empty(0, np.int64)
        except (TypeError, ValueError, OverflowError):
            raise _fail(f"{path}.token_ids", "must be ints") from None
        if arr.ndim != 1 or (arr.size and (arr.min() < _I32.min or arr.max() > _I32.max)):
            raise _fail(f"{path}.token_ids", "must be int32 ints")
        if arr.size != len(hashes) * size:
            raise _fail(path, f"{len(hashes)} hashes of {size} tokens but {arr.size} token ids")
        arr = arr.astype(np.int32)
        arr.setflags(write=False)
        lora_id = _opt(f["lora_id"], int, f"{path}.lora_id")
        lora_name = _opt(f["lora_name"], str, f"{path}.lora_name")
        return BlockStored(hashes, parent, arr, size, lora_id, _opt(f["medium"], str, f"{path}.medium"),
                           lora_name, lora_name if lora_name is not None else lora_id)
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(f["block_hashes"], f"{path}.block_hashes"),
                            _opt(f["medium"], str, f"{path}.medium"))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not allow_state:
        raise _fail(path, f"state event {tag!r} where none is allowed")
    if tag == "StateStored":
        pos = f["position"]
        if isinstance(pos, bool) or not isinstance(pos, int) or pos < 1:
            raise _fail(f"{path}.position", f"must be an int >= 1, got {pos!r}")
        return StateStored(_hash(f["block_hash"], f"{path}.block_hash"), pos,
                           _opt(f["medium"], str, f"{path}.medium"))
    return StateRemoved(_hashes(f["block_hashes"], f"{path}.block_hashes"), _opt(f["medium"], str, f"{path}.medium"))


def decode_batch(payload: bytes, *, allow_state: bool = True) -> KVEventBatch:
    """Parse the msgpack bytes of a batch (either event layout; the batch itself as an array
    or a map) into a :class:`KVEventBatch` of radixkv event objects.

    ``extra_key`` of a ``BlockStored`` is its ``lora_name``, else its ``lora_id``.
    Raises InvalidArgumentError naming the path of the first malformed element.
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"payload must be bytes, got {type(payload).__name__}")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise InvalidArgumentError(f"payload is not msgpack: {e}") from None
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2:
        raise _fail("$", "a batch is [ts, events, data_parallel_rank]")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise _fail("$[0]", f"ts must be a number, got {ts!r}")
    if not isinstance(events, list):
        raise _fail("$[1]", "events must be an array")
    rank = _opt(rank, int, "$[2]")
    # KVEventBatch types its events as KV events; a decoded batch may carry state events too
    out: list[Any] = [_decode_event(e, f"$[1][{i}]", allow_state) for i, e in enumerate(events)]
    return KVEventBatch(float(ts), out, rank)
