"""What one call may ask for, checked on the request's raw bytes before it is decoded.

Decoding costs in proportion to a message's items, not its bytes, so a call's items and
tokens are bounded by :class:`CallLimits` *before* parsing: :func:`check_raw` walks the
protobuf wire format (tags and lengths only) and stops as soon as a count passes its limit:
refusing a hostile call costs O(limit), whatever its size. Packed int32 byte fields are
counted from their length alone, O(1) per field. A refused call is ``RequestLimitError``
(RESOURCE_EXHAUSTED) naming the limit.

The field numbers below are those of ``proto/radixkv/v1/cache_manager.proto``;
``tests/service/test_limits.py`` checks them against the generated descriptors.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from radixkv.service.wire.errors import RequestLimitError

from radixkv.errors import InvalidArgumentError

__all__ = ["CallLimits", "check_raw", "check_raw_steps", "CHECK_STEP", "limits_for", "SPECS"]


class CallLimits(NamedTuple):
    """Per-call bounds. ``max_items``: entries of one call (queries, items, rids);
    ``max_tokens``: token ids of one call; ``max_replayed_items``: decode rids of one
    ``ApplyDecodes`` (all its calls together)."""

    max_items: int
    max_tokens: int
    max_replayed_items: int


def limits_for(kv_tokens: int, request_rows: int, decode_reserve: int = 0) -> CallLimits:
    """The default limits of a pool: a call names at most 4x the rows (and at least 1024)
    entries and 4x the pool (at least 64 Ki) tokens; a replay at most one call per reserved
    decode step (``decode_reserve``, at least 1) of that many rids."""
    items = max(1024, 4 * int(request_rows))
    return CallLimits(items, max(1 << 16, 4 * int(kv_tokens)), items * max(1, int(decode_reserve)))


class _Spec(NamedTuple):
    items: int  # the repeated field whose entries are counted (0: none)
    sub_tokens: int  # in each entry (a sub-message): the bytes field of int32 tokens (0: none)
    tokens: int  # at the top level: a bytes field of int32 tokens (0: none)
    #: packed int32 fields, one value per entry: (field, the limit it counts against, what)
    packed: tuple[tuple[int, str, str], ...] = ()


#: The requests with entries to count: (repeated field, token field inside an entry, token
#: field at the top, packed int32 fields of one value per entry and the limit each counts
#: against: ``max_items``, or ``max_replayed_items`` for a replay's decode items).
SPECS: dict[str, _Spec] = {
    "Match": _Spec(2, 1, 0),  # MatchRequest.queries[].token_ids_i32
    "AllocExtend": _Spec(0, 0, 5, ((4, "max_items", "entries"),)),  # AllocExtendRequest: rid_lens_i32, token_ids_i32
    "AllocDecode": _Spec(2, 0, 3),  # AllocDecodeRequest.rids, .token_ids_i32
    # ApplyDecodesRequest: rid_lens_i32 (distinct rids), call_lens_i32 (calls), rid_index_i32
    # (decode items), token_ids_i32
    "ApplyDecodes": _Spec(0, 0, 7, ((4, "max_items", "rids"), (5, "max_items", "replayed calls"),
                                    (6, "max_replayed_items", "replayed decode items"))),
    "CacheUnfinished": _Spec(2, 0, 0),  # CacheRequest.rids
    "CacheFinished": _Spec(2, 0, 0),
    "Release": _Spec(2, 0, 0),  # ReleaseRequest.rids
}


def _varint(buf: memoryview, i: int, end: int) -> tuple[int, int]:
    shift = value = 0
    while i < end and shift < 64:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
    raise InvalidArgumentError("the request is not a valid message (a broken varint)")


def _fields(buf: memoryview, i: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(field number, start, stop)`` of each length-delimited field in ``buf[i:end]``
    (other wire types are skipped). Raises ``InvalidArgumentError`` for broken framing."""
    while i < end:
        key, i = _varint(buf, i, end)
        wire_type = key & 7
        if wire_type == 2:
            n, i = _varint(buf, i, end)
            if i + n > end:
                raise InvalidArgumentError("the request is not a valid message (a field runs past its end)")
            yield key >> 3, i, i + n
            i += n
        elif wire_type == 0:
            _, i = _varint(buf, i, end)
        elif wire_type == 1:
            i += 8
        elif wire_type == 5:
            i += 4
        else:  # groups are not in this schema
            raise InvalidArgumentError(f"the request is not a valid message (wire type {wire_type})")
    if i != end:
        raise InvalidArgumentError("the request is not a valid message (broken framing)")


def _sub_tokens(buf: memoryview, a: int, b: int, field: int) -> int:
    """Tokens in field ``field`` of the entry ``buf[a:b]``; an entry that is that one field
    alone (the usual query) is read without walking it (a third of the cost)."""
    if b - a >= 2 and buf[a] == (field << 3) | 2:
        n, i = (buf[a + 1], a + 2) if buf[a + 1] < 0x80 else _varint(buf, a + 1, b)
        if i + n == b:
            return n // 4
    return sum((d - c) // 4 for f, c, d in _fields(buf, a, b) if f == field)


def _refuse(method: str, what: str, limit_name: str, limit: int) -> RequestLimitError:
    return RequestLimitError(f"{method}: more than {limit} {what} in one call (limit {limit_name}={limit})",
                             requested=limit + 1, available=limit)


def check_raw(method: str, raw: bytes | bytearray | memoryview, limits: CallLimits) -> None:
    """Raise ``RequestLimitError`` when the ``method`` request in ``raw`` has more entries
    or tokens than ``limits`` allow (other methods: nothing to check). O(min(entries, limit));
    framing the parser would refuse may raise ``InvalidArgumentError`` here first."""
    for _ in check_raw_steps(method, raw, limits):
        pass


#: Top-level fields :func:`check_raw_steps` counts between two yields.
CHECK_STEP = 128


def check_raw_steps(method: str, raw: bytes | bytearray | memoryview, limits: CallLimits,
                    every: int = CHECK_STEP) -> Iterator[int]:
    """:func:`check_raw` in steps: yields the fields counted so far after every ``every``
    top-level fields (a caller may let other work run in between) and raises as it does."""
    spec = SPECS.get(method)
    if spec is None:
        return
    buf = memoryview(raw).cast("B")
    items = tokens = 0
    packed = {f: (name, what) for f, name, what in spec.packed}
    counted: dict[int, int] = {}
    for k, (field, a, b) in enumerate(_fields(buf, 0, len(buf)), 1):
        if k % every == 0:
            yield k
        if field == spec.items:
            items += 1
            if items > limits.max_items:
                raise _refuse(method, "entries", "max_items", limits.max_items)
            if spec.sub_tokens:
                tokens += _sub_tokens(buf, a, b, spec.sub_tokens)
        elif field in packed:  # every occurrence counts (the parser keeps the last one)
            counted[field] = n = counted.get(field, 0) + (b - a) // 4
            name, what = packed[field]
            if n > getattr(limits, name):
                raise _refuse(method, what, name, getattr(limits, name))
        if field == spec.tokens:
            tokens += (b - a) // 4
        if tokens > limits.max_tokens:
            raise _refuse(method, "tokens", "max_tokens", limits.max_tokens)
