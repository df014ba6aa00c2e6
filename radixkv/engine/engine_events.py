"""The engine's event queue, bound as :class:`~radixkv.engine.embedded.CacheEngine` methods:
one queue of KV and (hybrid) state events in the tree's order, read by ``take_events``
(dicts, one session's call) or ``drain_events`` (objects, no session: the service's event
hub). Split out of :mod:`radixkv.engine.embedded` (the protocol's allocation calls).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixkv.contracts import Event
from radixkv.engine.protocol import Session
from radixkv.validation import check_count

if TYPE_CHECKING:
    from radixkv.engine.embedded import CacheEngine

__all__ = ["take_events", "events_enabled", "pending_events", "drain_events"]


def take_events(engine: CacheEngine, session: Session, max_events: int = 0) -> list[dict[str, Any]]:
    """Drain up to ``max_events`` events (0: all), oldest first, as ``to_dict()`` dicts:
    KV events and, for hybrid models, state events, in the order the tree recorded them.
    One queue for the whole engine: events go to whoever takes them."""
    engine._enter(session)
    n = check_count(max_events, "max_events")
    engine._events.extend(engine.tree.take_events())
    k = len(engine._events) if n == 0 else min(n, len(engine._events))
    return [engine._events.popleft().to_dict() for _ in range(k)]


def events_enabled(engine: CacheEngine) -> bool:
    """Whether the tree records events (``enable_kv_events``). O(1)."""
    return engine.tree.kv_events is not None


def pending_events(engine: CacheEngine) -> int:
    """Events recorded and not yet taken (0 when events are off). O(1)."""
    rec = engine.tree.kv_events
    return len(engine._events) + rec.pending() if rec is not None else 0


def drain_events(engine: CacheEngine) -> list[Event]:
    """Take every pending event as event objects (KV and state kinds), oldest first,
    without a session (no sweep, no lease renewal): :meth:`take_events`'s queue, for
    the one consumer that owns it (the service's event hub). O(events)."""
    rec = engine.tree.kv_events
    out = list(engine._events)
    engine._events.clear()
    if rec is not None:
        out.extend(rec.take_events())
    return out
