"""The event stream's messages: numbered KV events, hybrid state events and gap markers.

:mod:`radixkv.service.wire.codec` converts the three KV events (``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``, ``to_dict()`` form) to and from ``KVEvent``
messages. The event hub's outlets add three things, kept here:

* the event's sequence number (``KVEvent.seq``), the same on every stream;
* the hybrid state events as their own kinds (``state_stored`` / ``state_removed``), dict form
  ``{"type": "StateStored", "block_hash", "position", "medium"}`` /
  ``{"type": "StateRemoved", "block_hashes", "medium"}`` (``radixkv.events.state_index``);
* the gap marker ``events_lost`` (not an event): the events ``first_seq .. first_seq +
  count - 1`` are lost to this stream; dict form ``{"type": "EventsLost", "first_seq",
  "count"}``.

Every function is O(size of the event).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb

from radixkv.errors import InvalidArgumentError

__all__ = ["EVENTS_LOST", "event_to_msg", "lost_to_msg", "event_from_msg", "numbered_event_from_msg"]

#: The ``type`` of the gap marker's dict form.
EVENTS_LOST = "EventsLost"
_U64 = np.dtype("<u8")


def _as_dict(event: Any) -> dict[str, Any]:
    if isinstance(event, dict):
        return event
    to_dict = getattr(event, "to_dict", None)
    if to_dict is None:
        raise InvalidArgumentError(f"not an event: {type(event).__name__}")
    d: dict[str, Any] = to_dict()
    return d


def event_to_msg(event: Any, seq: int) -> pb.KVEvent:
    """``event`` (an event object or its ``to_dict()`` dict; KV or state kind) as a
    ``KVEvent`` numbered ``seq``. Raises ``InvalidArgumentError`` for an unknown kind."""
    d = _as_dict(event)
    kind = d.get("type")
    if kind == "StateStored":
        m = pb.StateStored(block_hash=int(d["block_hash"]), position=int(d["position"]))
        if d.get("medium") is not None:
            m.medium = d["medium"]
        msg = pb.KVEvent(state_stored=m)
    elif kind == "StateRemoved":
        rm = pb.StateRemoved(block_hashes_u64=np.asarray(d["block_hashes"], dtype=_U64).tobytes())
        if d.get("medium") is not None:
            rm.medium = d["medium"]
        msg = pb.KVEvent(state_removed=rm)
    else:
        msg = wire.event_to_msg(d)
    msg.seq = int(seq)
    return msg


def lost_to_msg(first_seq: int, count: int) -> pb.KVEvent:
    """The gap marker: events ``first_seq .. first_seq + count - 1`` are lost to the stream."""
    return pb.KVEvent(events_lost=pb.EventsLost(first_seq=int(first_seq), count=int(count)), seq=int(first_seq))


def event_from_msg(msg: pb.KVEvent) -> dict[str, Any]:
    """The dict form of any ``KVEvent`` (KV, state or gap marker), without its seq."""
    kind = msg.WhichOneof("event")
    if kind == "state_stored":
        m = msg.state_stored
        return {"type": "StateStored", "block_hash": int(m.block_hash), "position": int(m.position),
                "medium": m.medium if m.HasField("medium") else None}
    if kind == "state_removed":
        rm = msg.state_removed
        raw = rm.block_hashes_u64
        if len(raw) % 8:
            raise InvalidArgumentError(f"block_hashes: {len(raw)} bytes is not a whole number of u64")
        return {"type": "StateRemoved", "block_hashes": np.frombuffer(raw, dtype=_U64).tolist(),
                "medium": rm.medium if rm.HasField("medium") else None}
    if kind == "events_lost":
        return {"type": EVENTS_LOST, "first_seq": int(msg.events_lost.first_seq),
                "count": int(msg.events_lost.count)}
    return wire.event_from_msg(msg)


def numbered_event_from_msg(msg: pb.KVEvent) -> tuple[int, dict[str, Any]]:
    """``(seq, dict form)`` of a ``KVEvent``."""
    return int(msg.seq), event_from_msg(msg)
