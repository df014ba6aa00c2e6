"""State events of hybrid models: which recurrent (Mamba / KDA) states the cache holds.

A hybrid prefix is reusable only where the tree also holds the state after it, so a router
needs to know where the states are. radixkv's own format, in the style of vLLM's KV events:
:class:`StateStored` ``(block_hash, position, medium)`` (the state after a live page) and
:class:`StateRemoved` ``(block_hashes, medium)``. Rules: a ``StateStored`` names a live
block, at most one state per block and tier (``medium``: ``GPU`` the device, ``CPU`` the host
state tier; a state moving tier is stored on the new one, then removed from the old);
``BlockRemoved`` and ``AllBlocksCleared`` drop the states too.

:class:`HybridEventRecorder` is the producer: a ``KVEventRecorder`` whose one queue also
takes state events (hooks ``on_state_stored`` / ``on_state_removed``, called by
``StateTable.attach`` / ``detach``). The consumer, ``StateIndex``, is in the events package.
Format and rules: ``docs/events.md``, section 3.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from radixkv.cache.block_hash import DEFAULT_SEED, Seed
from radixkv.cache.block_hash import check_hash as _check_hash
from radixkv.cache.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventRecorder,
    event_from_dict,
)
from radixkv.errors import InvalidArgumentError, InvariantError, NotFoundError, describe_ids

__all__ = ["StateStored", "StateRemoved", "STATE_EVENT_TYPES", "is_state_event", "any_event_from_dict",
           "as_events", "split_state_events", "HybridEventRecorder", "StateEvent", "CacheEvent"]



@dataclass(frozen=True)
class StateStored:
    """The recurrent state after block ``block_hash`` (``position`` tokens) is cached."""

    block_hash: int
    position: int
    medium: str | None = MEDIUM_GPU

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, tagged like the KV events' ``to_dict``."""
        return {"type": "StateStored", "block_hash": self.block_hash, "position": self.position,
                "medium": self.medium}


@dataclass(frozen=True)
class StateRemoved:
    """The states after the blocks ``block_hashes`` are gone."""

    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM_GPU

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form, tagged like the KV events' ``to_dict``."""
        return {"type": "StateRemoved", "block_hashes": list(self.block_hashes), "medium": self.medium}


STATE_EVENT_TYPES = (StateStored, StateRemoved)

#: A state event, and any event a (hybrid) tree records.
StateEvent = StateStored | StateRemoved
CacheEvent = KVEvent | StateEvent


def is_state_event(event: object) -> TypeGuard[StateEvent]:
    """Whether ``event`` is a :class:`StateStored` / :class:`StateRemoved`."""
    return isinstance(event, STATE_EVENT_TYPES)


def _check_position(position: object) -> int:
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 1:
        raise InvalidArgumentError(f"position must be an int >= 1, got {position!r}")
    return int(position)


def any_event_from_dict(d: dict[str, Any]) -> CacheEvent:
    """Inverse of ``to_dict()`` for the KV events and the two state events.

    Raises InvalidArgumentError for an unknown ``type`` or malformed fields."""
    if not isinstance(d, dict):
        raise InvalidArgumentError(f"an event dict is expected, got {type(d).__name__}")
    kind = d.get("type")
    try:
        if kind == "StateStored":
            return StateStored(_check_hash(d["block_hash"], "block_hash"), _check_position(d["position"]),
                               d.get("medium"))
        if kind == "StateRemoved":
            return StateRemoved(tuple(_check_hash(h, "block hash") for h in d["block_hashes"]), d.get("medium"))
        return event_from_dict(d)
    except InvalidArgumentError:
        raise
    except KeyError as e:
        raise InvalidArgumentError(f"{kind} event lacks field {e.args[0]!r}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidArgumentError(f"malformed {kind} event: {e}") from None


def as_events(events: Iterable[object]) -> list[CacheEvent]:
    """Event objects from events or their ``to_dict()`` dicts (a CacheEngine's
    ``take_events``). Raises InvalidArgumentError for anything else."""
    out: list[CacheEvent] = []
    for i, e in enumerate(events):
        if isinstance(e, dict):
            e = any_event_from_dict(e)
        elif not isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared, StateStored, StateRemoved)):
            raise InvalidArgumentError(f"events[{i}] is not a KV event: {type(e).__name__}")
        out.append(e)
    return out


def split_state_events(events: Iterable[CacheEvent]) -> tuple[list[CacheEvent], list[CacheEvent]]:
    """``(kv_events, state_events)``, each in its original order."""
    kv: list[CacheEvent] = []  # KVEvents only
    st: list[CacheEvent] = []  # StateEvents only
    for e in events:
        (st if is_state_event(e) else kv).append(e)
    return kv, st


# --------------------------------------------------------------------------- producer


class HybridEventRecorder(KVEventRecorder):
    """A :class:`KVEventRecorder` that also records state events, in the same queue.

    Besides the live block multiset of its base, it keeps the live states per tier (medium ->
    block hash -> position), so a state on a block that is not stored, a second state on one
    block and tier, or the removal of a state that is not there is refused at once (typed
    error, nothing recorded).

    Args: as :class:`KVEventRecorder` (``page_size``, ``seed``, ``medium``).
    """

    def __init__(self, page_size: int, seed: Seed = DEFAULT_SEED, medium: str = MEDIUM_GPU):
        super().__init__(page_size, seed=seed, medium=medium)
        self._states: dict[str, dict[int, int]] = {}  # medium -> block hash -> position

    # -- the hooks of a hybrid cache

    def on_state_stored(self, block_hash: int, position: int, medium: str | None = None) -> None:
        """Record a :class:`StateStored` on ``medium`` (default the recorder's): the state after
        the page ``block_hash`` (which ends at token ``position``, a multiple of the page
        size). A state moving tier is stored on the new one before it is removed from the old
        (both briefly live). O(1).

        Raises NotFoundError when the block is not live, InvalidArgumentError for a bad hash /
        position, a block that already has a state on ``medium``, or one on another tier at
        another position (nothing recorded)."""
        h = _check_hash(block_hash, "block_hash")
        pos = _check_position(position)
        m = self.medium if medium is None else medium
        if pos % self.page_size:
            raise InvalidArgumentError(f"state position {pos} is not a multiple of page_size {self.page_size}")
        if not self.is_live(h):
            raise NotFoundError(f"StateStored for block {h}, which is not stored")
        tier = self._states.get(m)
        if tier is not None and h in tier:
            raise InvalidArgumentError(f"block {h} already has a state on {m} (at {tier[h]})")
        other = [(x, t[h]) for x, t in self._states.items() if h in t and t[h] != pos]
        if other:
            raise InvalidArgumentError(f"block {h} has a state at {other[0][1]} on {other[0][0]}, not {pos}")
        self._states.setdefault(m, {})[h] = pos
        self._events.append(StateStored(h, pos, m))

    def on_state_removed(self, block_hashes: Sequence[int], medium: str | None = None) -> None:
        """Record a :class:`StateRemoved` on ``medium`` (default the recorder's) for blocks
        that have a state there. O(len).

        Raises NotFoundError naming the blocks without one (nothing recorded)."""
        hs = [_check_hash(h, "block hash") for h in block_hashes]
        if not hs:
            return
        m = self.medium if medium is None else medium
        dup = [h for h, n in Counter(hs).items() if n > 1]
        if dup:
            raise InvalidArgumentError(f"StateRemoved names blocks twice: {describe_ids(dup)}")
        tier = self._states.get(m, {})
        missing = [h for h in hs if h not in tier]
        if missing:
            raise NotFoundError(f"StateRemoved for blocks without a state on {m}: {describe_ids(missing)}")
        for h in hs:
            del tier[h]
        self._events.append(StateRemoved(tuple(hs), m))

    # -- the KV hooks keep the states consistent (rules 2 and 3)

    def on_removed(self, block_hashes: Sequence[int], medium: str | None = None) -> None:
        """The base's ``BlockRemoved``; the removed blocks' states go with them (rule 2)."""
        super().on_removed(block_hashes, medium)  # validates; raises before any change
        for h in block_hashes:
            h = int(h)
            if not self.is_live(h):
                for tier in self._states.values():
                    tier.pop(h, None)

    def on_cleared(self) -> None:
        """The base's ``AllBlocksCleared``; every state goes too (rule 3)."""
        super().on_cleared()
        self._states.clear()

    # -- queries

    def live_states(self, medium: str | None = None) -> dict[int, int]:
        """Block hash -> position of every live state on ``medium`` (a copy), or on any tier
        when ``None``."""
        if medium is not None:
            return dict(self._states.get(medium, {}))
        return {h: p for tier in self._states.values() for h, p in tier.items()}

    def check_invariants(self) -> None:
        """The base's checks (state events accepted in the queue), and every live state sits
        on a live block at a page-aligned position."""
        pending = self._events
        self._events = [e for e in pending if not is_state_event(e)]
        try:
            super().check_invariants()
        finally:
            self._events = pending
        states = [(h, p) for tier in self._states.values() for h, p in tier.items()]
        orphans = [h for h, _ in states if not self.is_live(h)]
        if orphans:
            raise InvariantError(f"states on blocks that are not stored: {describe_ids(orphans)}")
        bad = [h for h, p in states if p < 1 or p % self.page_size]
        if bad:
            raise InvariantError(f"states at positions that are not page ends: {describe_ids(bad)}")
