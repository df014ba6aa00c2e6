"""A state-aware router index: credits a hybrid manager only with the prefix it can reuse.

A hybrid model resumes a prefix only where its tree holds the state after its last token; a
plain KV index overstates managers that evicted states (tombstones). :class:`StateAwareIndex`
feeds each manager's stream to a KV index (Dynamo's ``RadixTree`` or the Python one, through
a :class:`~radixkv.events.dynamo.DynamoEventAdapter`: ``kv_blocks``) and a
:class:`~radixkv.events.state_index.StateIndex` (the deepest matched block that ALSO has a
live state: ``blocks``, exactly the manager's ``match_prefix(tokens).prefix_len //
page_size``). A lost-events gap marker makes it forget the manager until its next
``AllBlocksCleared`` (:meth:`StateAwareIndex.desynced`). Details: ``docs/events.md``, "The
reference consumer".

Costs: :meth:`apply` O(tokens) for a stored event, O(blocks) otherwise; :meth:`scores`
O(pages) hashes (XXH3 + SHA-256 per page) plus O(kv_blocks) probes per matching manager.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from radixkv.cache.block_hash import DEFAULT_SEED, Seed, block_hashes, chain_root
from radixkv.cache.hybrid.state_events import CacheEvent, any_event_from_dict
from radixkv.cache.kv_events import AllBlocksCleared
from radixkv.errors import InvalidArgumentError, InvariantError, describe_ids
from radixkv.events.dynamo import DynamoEventAdapter, DynamoNamespace, default_namespace, tokens_hashes
from radixkv.events.state_index import StateIndex
from radixkv.validation import int32_tokens

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.bench.router_index import KVIndex

__all__ = ["StateAwareIndex", "StateAwareScore", "EVENTS_LOST"]

#: ``type`` of the gRPC stream's gap marker (``radixkv.service.wire.events.EVENTS_LOST``).
EVENTS_LOST = "EventsLost"
_U64 = 1 << 64


class StateAwareScore(NamedTuple):
    """One manager's score for a request: ``kv_blocks``, the leading blocks whose KV it holds
    (what a plain KV index credits); ``blocks``, the deepest of those with a live state (what
    a hybrid engine can actually reuse, ``<= kv_blocks``)."""

    kv_blocks: int
    blocks: int


def _check_worker(worker: object) -> int:
    if isinstance(worker, bool) or not isinstance(worker, (int, np.integer)) or not 0 <= int(worker) < _U64:
        raise InvalidArgumentError(f"worker must be an int in [0, 2**64) (Dynamo worker id), got {worker!r}")
    return int(worker)


class StateAwareIndex:
    """Router index over many managers' event streams, scoring what each can really reuse.

    Args:
        page_size: the managers' page size (one block = one page).
        index: the KV index: ``"auto"`` (Dynamo's ``RadixTree`` if installed, else Python),
            ``"python"``, ``"dynamo"``, or an object with ``apply_event`` and ``scores``.
        seed: the managers' block-hash seed (default :data:`~radixkv.cache.block_hash.DEFAULT_SEED`).
        namespace_fn: ``extra_key -> DynamoNamespace`` for the KV index (as the adapter's).

    Workers are Dynamo worker ids (ints in ``[0, 2**64)``). Raises ``InvalidArgumentError`` for a
    bad argument; an event the KV adapter refuses raises its typed error, state index unchanged.
    """

    def __init__(self, page_size: int, index: str | KVIndex = "auto", seed: Seed = DEFAULT_SEED,
                 namespace_fn: Callable[[Hashable], DynamoNamespace] = default_namespace):
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise InvalidArgumentError(f"page_size must be an int >= 1, got {page_size!r}")
        if not callable(namespace_fn):
            raise InvalidArgumentError("namespace_fn must be callable")
        chain_root(seed)  # validates the seed
        if isinstance(index, str):
            from radixkv.bench.router_index import make_index

            index = make_index(index)
        elif not (callable(getattr(index, "apply_event", None)) and callable(getattr(index, "scores", None))):
            raise InvalidArgumentError("index must be 'auto', 'python', 'dynamo' or have apply_event() and scores()")
        self.page_size = page_size
        self.seed = seed
        self.namespace_fn = namespace_fn
        self.kv_index: KVIndex = index
        self.states = StateIndex()
        self._adapters: dict[int, DynamoEventAdapter] = {}
        self._desynced: set[int] = set()

    # ------------------------------------------------------------------ feeding
    def apply(self, worker: int, event: CacheEvent | dict[str, object]) -> None:
        """Apply one event of ``worker``: an event object or its ``to_dict()`` dict (KV or
        state kind), or the gap marker dict ``{"type": "EventsLost", ...}``."""
        w = _check_worker(worker)
        if isinstance(event, dict):
            if event.get("type") == EVENTS_LOST:
                self._lose(w)
                return
            event = any_event_from_dict(event)
        if w in self._desynced:
            if not isinstance(event, AllBlocksCleared):
                return
            self._desynced.discard(w)
        adapter = self._adapters.get(w)
        if adapter is None:
            adapter = self._adapters[w] = DynamoEventAdapter(self.page_size, self.namespace_fn)
        raw = adapter.encode(event)  # validates first; None for a state event
        if raw is not None:
            self.kv_index.apply_event(w, raw)
        self.states.apply(w, event)

    def apply_all(self, worker: int, events: Iterable[CacheEvent | dict[str, object]]) -> None:
        """:meth:`apply` of each event, in order."""
        for e in events:
            self.apply(worker, e)

    def _lose(self, w: int) -> None:
        self._forget(w)
        self._desynced.add(w)

    def _forget(self, w: int) -> None:
        adapter = self._adapters.pop(w, None)
        raw = None if adapter is None else adapter.encode(AllBlocksCleared())  # never None for a KV event
        if raw is not None:
            self.kv_index.apply_event(w, raw)
        self.states.remove_worker(w)

    def remove_worker(self, worker: int) -> None:
        """Forget ``worker`` (it died, or the caller resubscribes it from scratch)."""
        w = _check_worker(worker)
        self._forget(w)
        self._desynced.discard(w)

    # ------------------------------------------------------------------ queries
    def scores(self, tokens: object, extra_key: Hashable = None) -> dict[int, StateAwareScore]:
        """Per manager with a KV overlap, its :class:`StateAwareScore` for a request of
        ``tokens`` (the full blocks of them) in namespace ``extra_key``."""
        toks = int32_tokens(tokens, "tokens")
        toks = toks[:toks.size - toks.size % self.page_size]
        if not toks.size:
            return {}
        kv = self.kv_index.scores(tokens_hashes(toks, self.page_size, extra_key, self.namespace_fn))
        if not kv:
            return {}
        chain = block_hashes(toks, self.page_size, None, extra_key, self.seed)
        return {w: StateAwareScore(n, self.states.usable(w, chain, n).blocks) for w, n in kv.items() if n}

    def best(self, tokens: object, extra_key: Hashable = None) -> int | None:
        """The manager with the most reusable blocks (ties: the lowest id), ``None`` when no
        manager can reuse any."""
        sc = self.scores(tokens, extra_key)
        top = max((s.blocks for s in sc.values()), default=0)
        return min(w for w, s in sc.items() if s.blocks == top) if top else None

    def workers(self) -> list[int]:
        """Managers with a live mirror (events applied since their last loss)."""
        return sorted(self._adapters)

    def desynced(self, worker: int) -> bool:
        """Whether ``worker`` lost events and waits for its next ``AllBlocksCleared``."""
        return _check_worker(worker) in self._desynced

    def check_invariants(self) -> None:
        """Every adapter's and the state index's own audit; no desynced manager keeps blocks
        or states; every live state sits on a block its manager's adapter holds. Raises
        ``InvariantError`` naming the managers / block hashes."""
        for a in self._adapters.values():
            a.check_invariants()
        self.states.check_invariants()
        stale = sorted(w for w in self._desynced if w in self._adapters or self.states.num_states(w))
        if stale:
            raise InvariantError(f"desynced managers {describe_ids(stale)} still hold blocks or states")
        for w in self.states.workers():
            a = self._adapters.get(w)  # type: ignore[call-overload]  # the states' workers: ints here
            held = self.states.live(w)
            orphans = [h for h in held if a is None or not a.holds(h)]
            if orphans:
                raise InvariantError(f"manager {w}: states on blocks it does not hold: {describe_ids(orphans)}")
