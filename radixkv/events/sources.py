"""Where KV events come from: one call that drains any radixkv event source.

Sources: a ``RadixCache`` / ``MambaRadixCache`` (``take_events()``), a ``KVEventRecorder``
(``take_events()``), or a ``CacheEngine`` (without a session its ``drain_events()``; with one,
``take_events(session)``, which returns ``to_dict()`` dicts). Whatever the source,
:func:`drain_events` returns event objects, oldest first, ready for
:class:`~radixkv.events.zmq_publisher.ZmqEventPublisher` or
:class:`~radixkv.events.dynamo.DynamoEventAdapter`. Drain once and hand the same list to
every outlet: each source has one queue, and an event taken is gone from it.
"""
from __future__ import annotations

from radixkv.cache.hybrid.state_events import CacheEvent, as_events
from radixkv.errors import InvalidArgumentError

__all__ = ["drain_events"]


def drain_events(source: object, session: object | None = None, max_events: int = 0) -> list[CacheEvent]:
    """Take the pending events of ``source`` as event objects (KV and state events).

    A ``CacheEngine`` is drained with its session-less ``drain_events()`` when ``session``
    is ``None``, else with ``take_events(session, max_events)``; ``session`` must be
    ``None`` for the other sources. ``max_events`` (0: all) applies with a session only.
    Raises InvalidArgumentError for a source without ``take_events``.
    """
    drain = getattr(source, "drain_events", None)
    if session is None and drain is not None and not max_events:
        drained: list[CacheEvent] = drain()  # a CacheEngine's, typed there
        return drained
    take = getattr(source, "take_events", None)
    if take is None:
        raise InvalidArgumentError(f"{type(source).__name__} has no take_events()")
    if session is not None:
        return as_events(take(session, max_events))
    if max_events:
        raise InvalidArgumentError("max_events applies to a CacheEngine (with a session) only")
    return as_events(take())
