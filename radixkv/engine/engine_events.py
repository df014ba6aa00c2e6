"""The engine's event queue (:class:`EventQueue`): one queue of KV and (hybrid) state events
in the tree's order, read through :class:`~radixkv.engine.embedded.CacheEngine`'s
``take_events`` (dicts, one session's call) or ``drain_events`` (objects, no session: the
service's event hub).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from radixkv.contracts import Event

if TYPE_CHECKING:
    from radixkv.cache.radix_cache import RadixCache

__all__ = ["EventQueue"]


class EventQueue:
    """The events of ``tree`` (its recorder's, moved here as they are taken), oldest first.

    One queue for the whole engine: events go to whoever takes them. Holds no session;
    the engine checks the caller's first.
    """

    def __init__(self, tree: RadixCache) -> None:
        self._tree = tree
        self._queue: deque[Event] = deque()

    @property
    def enabled(self) -> bool:
        """Whether the tree records events (``enable_kv_events``). O(1)."""
        return self._tree.kv_events is not None

    def take(self, max_events: int) -> list[dict[str, Any]]:
        """Up to ``max_events`` events (0: all), oldest first, as ``to_dict()`` dicts: KV events
        and, for hybrid models, state events, in the order the tree recorded them. O(events)."""
        q = self._queue
        q.extend(self._tree.take_events())
        k = len(q) if max_events == 0 else min(max_events, len(q))
        return [q.popleft().to_dict() for _ in range(k)]

    def pending(self) -> int:
        """Events recorded and not yet taken (0 when events are off). O(1)."""
        rec = self._tree.kv_events
        return len(self._queue) + rec.pending() if rec is not None else 0

    def drain(self) -> list[Event]:
        """Every pending event as an event object (KV and state kinds), oldest first. O(events)."""
        rec = self._tree.kv_events
        out = list(self._queue)
        self._queue.clear()
        if rec is not None:
            out.extend(rec.take_events())
        return out
