"""A tiered manager's KV events as a medium-blind router index needs them.

With the host tier on, a page moving tier is ``BlockRemoved`` from one medium then
``BlockStored`` in the other, and a parent can move while its children stay: an index with
one tree (Dynamo's, :class:`~radixkv.events.dynamo.DynamoEventAdapter`) would refuse the
removal. :class:`AnyTierEvents` keeps a block while it is on any tier: a move emits nothing,
a block that leaves every tier is removed, a new one stored. O(hashes) per event.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, event_from_dict
from radixkv.errors import InvariantError, describe_ids

__all__ = ["AnyTierEvents"]

_KV_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class AnyTierEvents:
    """Per manager: the media each live block is on; :meth:`apply` filters one drained batch.

    Invariant: a hash is live iff it is on at least one medium; a move (removed, then stored
    again in the same batch) is invisible downstream.
    """

    def __init__(self) -> None:
        self._media: dict[int, set[str | None]] = {}

    def apply(self, events: Sequence[Any]) -> list[Any]:
        """The events of one batch (objects or ``to_dict()`` dicts), medium-blind. Raises
        InvariantError for a removal of a block not live or a store half of live blocks."""
        out: list[Any] = []
        pending: dict[int, None] = {}  # hashes that left their last medium in this batch, in order
        for raw in events:
            ev = event_from_dict(raw) if isinstance(raw, dict) and raw.get("type") in _KV_TYPES else raw
            if isinstance(ev, BlockRemoved):
                gone = [h for h in ev.block_hashes if ev.medium not in self._media.get(h, ())]
                if gone:
                    raise InvariantError(f"BlockRemoved from {ev.medium} of blocks not there: {describe_ids(gone)}")
                for h in ev.block_hashes:
                    media = self._media[h]
                    media.discard(ev.medium)
                    if not media:
                        pending[h] = None
            elif isinstance(ev, BlockStored):
                hashes = list(ev.block_hashes)
                moved = [h for h in hashes if h in pending]
                live = [h for h in hashes if h in self._media and h not in pending]
                if (moved and len(moved) != len(hashes)) or (live and len(live) != len(hashes)):
                    raise InvariantError(f"BlockStored mixes new and live blocks: {describe_ids(moved + live)}")
                for h in hashes:
                    self._media.setdefault(h, set()).add(ev.medium)
                    pending.pop(h, None)
                if not moved and not live:
                    out.append(ev)
            elif isinstance(ev, AllBlocksCleared):
                self._flush(pending, out)
                self._media.clear()
                out.append(ev)
            else:
                out.append(raw)
        self._flush(pending, out)
        return out

    def _flush(self, pending: dict[int, None], out: list[Any]) -> None:
        if pending:
            for h in pending:
                del self._media[h]
            out.append(BlockRemoved(tuple(pending), None))
            pending.clear()
