"""State events of hybrid models, the consumer side: :class:`StateIndex` (per worker, the
live recurrent states) and :class:`UsableOverlap`.

The event types, their dict codec and the producer (:class:`HybridEventRecorder`, which
the hybrid tree records with) are in :mod:`radixkv.cache.hybrid.state_events` (the rules a
consumer relies on: ``docs/events.md``, section 3).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

from radixkv.cache.hybrid.state_events import (
    CacheEvent,
    StateRemoved,
    StateStored,
    any_event_from_dict,
)
from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.errors import InvalidArgumentError, InvariantError, describe_ids

__all__ = ["StateIndex", "UsableOverlap"]


# --------------------------------------------------------------------------- consumer


class UsableOverlap(NamedTuple):
    """``kv_blocks``: the KV overlap the caller gave; ``blocks``: the deepest block within
    it that has a live state (0 when none) -- what the worker can really reuse."""

    kv_blocks: int
    blocks: int


class StateIndex:
    """Router-side index of the live states of many workers, fed with their event streams.

    It consumes both kinds of events (``BlockRemoved`` and ``AllBlocksCleared`` drop states,
    the rules of ``docs/events.md``, section 3) and answers, for a request's chain of block hashes
    (:func:`radixkv.cache.block_hash.block_hashes` of its tokens) and a KV overlap found elsewhere,
    how much of the overlap ends at a state. A state counts while it is live on some tier
    (``medium``; a state moving tier is stored on the new one before it is removed from the
    old), and a ``BlockRemoved`` drops it only when its block is on no tier left (a block
    moving tier is stored on the new one first, docs/events.md, section 6). Unknown removals
    drop the states named, nothing else (a consumer must not fail on a stream it joined late).
    """

    def __init__(self) -> None:
        self._states: dict[Hashable, dict[int, dict[str | None, int]]] = {}  # worker -> hash -> tier -> pos
        self._blocks: dict[Hashable, dict[int, set[str | None]]] = {}  # worker -> hash -> its tiers

    def apply(self, worker: Hashable, event: CacheEvent | dict[str, object]) -> None:
        """Apply one event (object or ``to_dict()`` dict) of ``worker``. O(len(event))."""
        if isinstance(event, dict):
            event = any_event_from_dict(event)
        states = self._states.setdefault(worker, {})
        blocks = self._blocks.setdefault(worker, {})
        if isinstance(event, BlockStored):
            for h in event.block_hashes:
                blocks.setdefault(int(h), set()).add(event.medium)
        elif isinstance(event, StateStored):
            states.setdefault(event.block_hash, {})[event.medium] = event.position
        elif isinstance(event, StateRemoved):
            for h in event.block_hashes:
                tiers = states.get(int(h))
                if tiers is not None:
                    tiers.pop(event.medium, None)
                    if not tiers:
                        del states[int(h)]
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                media = blocks.get(int(h))
                if media is not None:
                    media.discard(event.medium)
                    if media:  # a tier move: the block is still on another tier
                        continue
                    del blocks[int(h)]
                states.pop(int(h), None)
        elif isinstance(event, AllBlocksCleared):
            states.clear()
            blocks.clear()
        else:
            raise InvalidArgumentError(f"unknown event type {type(event).__name__}")

    def apply_all(self, worker: Hashable, events: Iterable[CacheEvent | dict[str, object]]) -> None:
        """:meth:`apply` of each event, in order."""
        for e in events:
            self.apply(worker, e)

    def remove_worker(self, worker: Hashable) -> None:
        """Forget ``worker`` (it died)."""
        self._states.pop(worker, None)
        self._blocks.pop(worker, None)

    def workers(self) -> list[Hashable]:
        return list(self._states)

    def num_states(self, worker: Hashable) -> int:
        return len(self._states.get(worker, ()))

    def live(self, worker: Hashable, medium: str | None = None) -> dict[int, int]:
        """``worker``'s live states: block hash -> position, on any tier, or on ``medium`` only."""
        return {h: p for h, tiers in self._states.get(worker, {}).items() for m, p in tiers.items()
                if medium is None or m == medium}

    def usable(self, worker: Hashable, chain_hashes: Sequence[int], kv_blocks: int) -> UsableOverlap:
        """The deepest ``i <= kv_blocks`` with a state after block ``chain_hashes[i-1]`` on
        ``worker``. O(kv_blocks) dict probes, scanning from the deep end."""
        if isinstance(kv_blocks, bool) or not isinstance(kv_blocks, int) or kv_blocks < 0:
            raise InvalidArgumentError(f"kv_blocks must be an int >= 0, got {kv_blocks!r}")
        if kv_blocks > len(chain_hashes):
            raise InvalidArgumentError(f"kv_blocks {kv_blocks} exceeds the {len(chain_hashes)} hashes given")
        states = self._states.get(worker)
        if states:
            for i in range(kv_blocks, 0, -1):
                if int(chain_hashes[i - 1]) in states:
                    return UsableOverlap(kv_blocks, i)
        return UsableOverlap(kv_blocks, 0)

    def check_invariants(self) -> None:
        """Every position is a positive int."""
        bad: set[int] = {h for s in self._states.values() for h, t in s.items()
                         if not t or min(t.values()) < 1}
        if bad:
            raise InvariantError(f"states on no tier or with non-positive positions: {describe_ids(bad)}")
