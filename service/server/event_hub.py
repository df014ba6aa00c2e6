"""The manager's event hub: drain the cache's events once, number them, fan them out.

:meth:`EventHub.pump` drains the engine's one (destructive) event queue, numbers each event
(0, 1, 2, ... per manager start, KV and state events alike) and appends it to a bounded ring
of ``capacity``. Readers never take events out: each has its own :class:`Cursor`
(``WatchEvents`` streams, the shared ``TakeEvents`` cursor), and outlets
(:meth:`EventHub.add_outlet`) get each pump's new records as one batch. A cursor that falls
behind the ring is told the lost range (:class:`Lost`) before the events it can still have,
and the loss is counted. Pure bookkeeping on the engine's event loop (no locks, no gRPC);
a record's wire form is encoded at most once.

Costs: ``pump`` O(new events + outlets); ``read`` O(events returned); ``subscribe`` O(1);
``check_invariants`` O(capacity + cursors). See ``docs/service.md``, "The event hub".
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from radixkv.cache.hybrid.state_events import STATE_EVENT_TYPES
from radixkv.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.errors import CapacityError, InvalidArgumentError, InvariantError, describe_ids

if TYPE_CHECKING:
    from radixkv.engine.embedded import CacheEngine

__all__ = ["EventHub", "engine_event_source", "Cursor", "HubRecord", "Lost", "ReadResult", "HubStats",
           "DEFAULT_RING_SIZE", "KIND_KV", "KIND_STATE"]

log = logging.getLogger("radixkv.service")

#: Events the ring keeps by default.
DEFAULT_RING_SIZE = 65_536
KIND_KV = "kv"
KIND_STATE = "state"
_KV_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


class HubRecord(NamedTuple):
    """One numbered event: ``kind`` is ``"kv"`` (BlockStored / BlockRemoved /
    AllBlocksCleared) or ``"state"`` (StateStored / StateRemoved, hybrid models)."""

    seq: int
    kind: str
    event: Any


class Lost(NamedTuple):
    """Events ``first_seq .. first_seq + count - 1`` were dropped from the ring before this
    cursor read them."""

    first_seq: int
    count: int  # type: ignore[assignment]  # shadows tuple.count: the field is the wire's name


class ReadResult(NamedTuple):
    """What :meth:`EventHub.read` gives: ``lost`` (or ``None``), then ``records`` in seq
    order; ``next_seq`` is the cursor afterwards; ``more`` tells that the read stopped at its
    limit with events left."""

    lost: Lost | None
    records: list[HubRecord]
    next_seq: int
    more: bool


class HubStats(NamedTuple):
    """``next_seq``: the number the next event gets (= events numbered so far);
    ``oldest_seq``: the oldest one the ring holds (= ``next_seq`` when empty);
    ``kv_events`` / ``state_events``: numbered per kind; ``cursors``: readers subscribed;
    ``lost``: events skipped by cursors that fell behind the ring; ``outlet_retries``:
    outlet calls refused for lack of room (retried by the next pump); ``outlet_errors``:
    outlet calls that failed otherwise (their records dropped for that outlet)."""

    next_seq: int
    oldest_seq: int
    retained: int
    capacity: int
    kv_events: int
    state_events: int
    pumps: int
    cursors: int
    lost: int
    outlet_retries: int
    outlet_errors: int


class Cursor:
    """A reader's position: ``next_seq`` is the first event it has not read. Made by
    :meth:`EventHub.subscribe`; ``lost`` counts the events it missed."""

    __slots__ = ("cid", "name", "next_seq", "lost")

    def __init__(self, cid: int, name: str, next_seq: int):
        self.cid = cid
        self.name = name
        self.next_seq = next_seq
        self.lost = 0

    def __repr__(self) -> str:
        return f"Cursor({self.cid}, {self.name!r}, next_seq={self.next_seq}, lost={self.lost})"


class _Outlet(NamedTuple):
    name: str
    fn: Callable[[list[HubRecord]], Any]
    cursor: Cursor


def _kind(event: Any) -> str | None:
    if isinstance(event, _KV_TYPES):
        return KIND_KV
    if isinstance(event, STATE_EVENT_TYPES):
        return KIND_STATE
    return None


def engine_event_source(engine: CacheEngine) -> Callable[[], list[Any]]:
    """The source of a ``CacheEngine``'s events for the hub: its session-less
    ``drain_events`` (the hub is the engine queue's one consumer: nobody else may call
    ``take_events`` on it)."""
    return engine.drain_events


def _check_seq(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidArgumentError(f"{name} must be an int >= 0, got {v!r}")
    return v


class EventHub:
    """Numbered, bounded, fan-out event log over one destructive event source.

    Args:
        source: called by :meth:`pump`; returns the events recorded since its last call
            (event objects, oldest first), e.g. ``engine.drain_events``.
        capacity: events the ring keeps (>= 1).
        encode: ``encode(record) -> wire form``, computed once per record by :meth:`encoded`.

    Raises ``InvalidArgumentError`` for a bad argument.
    """

    def __init__(self, source: Callable[[], Sequence[Any]], capacity: int = DEFAULT_RING_SIZE,
                 encode: Callable[[HubRecord], Any] | None = None):
        if not callable(source):
            raise InvalidArgumentError("source must be callable")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= 1 << 26:
            raise InvalidArgumentError(f"capacity must be an int in [1, 2**26], got {capacity!r}")
        self._source = source
        self._encode = encode
        self.capacity = capacity
        self._records: list[HubRecord | None] = [None] * capacity
        self._wire: list[Any] = [None] * capacity
        self._next = 0
        self._kinds = {KIND_KV: 0, KIND_STATE: 0}
        self._pumps = 0
        self._cursors: dict[int, Cursor] = {}
        self._ids = itertools.count()
        self._outlets: list[_Outlet] = []
        self._lost = 0
        self._retries = 0
        self._errors = 0
        self._changed = asyncio.Event()
        self.closed = False

    # ------------------------------------------------------------------ writing
    @property
    def next_seq(self) -> int:
        return self._next

    @property
    def oldest_seq(self) -> int:
        return max(0, self._next - self.capacity)

    def pump(self) -> int:
        """Drain the source once, number and keep its events, run the outlets, wake the
        waiters. Returns how many events were new (0 when closed)."""
        if self.closed:
            return 0
        self._pumps += 1
        n = self.append(self._source())
        if self._outlets:
            self.run_outlets()
        return n

    def append(self, events: Iterable[Any]) -> int:
        """Number and keep ``events`` (event objects, KV or state kinds) without draining
        the source; does not run the outlets (``pump`` does). Raises
        ``InvalidArgumentError`` naming the first event of an unknown kind, keeping none of
        them. Returns how many were kept."""
        if self.closed:
            raise InvalidArgumentError("the event hub is closed")
        events = list(events)
        kinds: list[str] = []
        for i, e in enumerate(events):
            k = _kind(e)
            if k is None:
                raise InvalidArgumentError(f"event {i} of the batch is not a KV or state event: "
                                           f"{type(e).__name__}")
            kinds.append(k)
        if not events:
            return 0
        cap, seq = self.capacity, self._next
        for e, k in zip(events, kinds):
            self._records[seq % cap] = HubRecord(seq, k, e)
            self._wire[seq % cap] = None
            self._kinds[k] += 1
            seq += 1
        self._next = seq
        self._wake()
        return len(events)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ reading
    def subscribe(self, name: str, start_seq: int | None = None) -> Cursor:
        """A new cursor at ``start_seq`` (``None``: the next event). A ``start_seq`` the ring
        no longer holds is accepted: the first read reports the loss. Raises
        ``InvalidArgumentError`` for a ``start_seq`` beyond the next event. O(1)."""
        start = self._next if start_seq is None else _check_seq("start_seq", start_seq)
        if start > self._next:
            raise InvalidArgumentError(f"start_seq {start} is ahead of the next event ({self._next})")
        cur = Cursor(next(self._ids), str(name), start)
        self._cursors[cur.cid] = cur
        return cur

    def unsubscribe(self, cursor: Cursor) -> None:
        """Forget ``cursor`` (idempotent)."""
        self._cursors.pop(cursor.cid, None)

    def read(self, cursor: Cursor, max_events: int = 0, max_bytes: int = 0) -> ReadResult:
        """The events at ``cursor`` (at most ``max_events``; 0: all), advancing it. When
        the ring dropped events the cursor had not read, ``lost`` names them and the cursor
        jumps to the oldest kept event. ``max_bytes`` (0: no limit) stops before the
        encoded records exceed it (at least one record is returned). Raises
        ``InvalidArgumentError`` for a cursor of another hub (or unsubscribed) or a bad
        ``max_events`` / ``max_bytes``. O(events returned)."""
        if self._cursors.get(cursor.cid) is not cursor:
            raise InvalidArgumentError(f"{cursor!r} is not subscribed to this hub")
        n = _check_seq("max_events", max_events)
        budget = _check_seq("max_bytes", max_bytes)
        if budget and self._encode is None:
            raise InvalidArgumentError("max_bytes needs a hub with an encoder")
        lost = None
        oldest = self.oldest_seq
        if cursor.next_seq < oldest:
            lost = Lost(cursor.next_seq, oldest - cursor.next_seq)
            cursor.lost += lost.count
            self._lost += lost.count
            cursor.next_seq = oldest
        end = self._next if n == 0 else min(self._next, cursor.next_seq + n)
        cap = self.capacity
        # every seq in [oldest, _next) has its record in the ring
        records = cast(list[HubRecord], [self._records[s % cap] for s in range(cursor.next_seq, end)])
        if budget:
            used = 0
            for i, r in enumerate(records):
                used += len(self.encoded(r))
                if used > budget and i:
                    del records[i:]
                    end = cursor.next_seq + i
                    break
        cursor.next_seq = end
        return ReadResult(lost, records, end, end < self._next)

    def encoded(self, record: HubRecord) -> Any:
        """``encode(record)``, computed once while the ring holds the record. O(event)."""
        i = record.seq % self.capacity
        held = self._records[i]
        if self._encode is None:
            raise InvalidArgumentError("this hub has no encoder")
        if held is not record:  # dropped from the ring meanwhile: encode without caching
            return self._encode(record)
        w = self._wire[i]
        if w is None:
            w = self._wire[i] = self._encode(record)
        return w

    async def wait(self, cursor: Cursor, timeout_s: float, stop: asyncio.Event | None = None) -> bool:
        """Until the hub has events beyond ``cursor``, ``stop`` is set, the hub closes, or
        ``timeout_s`` passes. Returns whether events are waiting."""
        if cursor.next_seq < self._next or self.closed:
            return cursor.next_seq < self._next
        waits = [asyncio.ensure_future(self._changed.wait())]
        if stop is not None:
            waits.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return cursor.next_seq < self._next

    # ------------------------------------------------------------------ outlets
    def add_outlet(self, name: str, fn: Callable[[list[HubRecord]], Any], start_seq: int | None = None) -> None:
        """Call ``fn(records)`` with every new batch (from ``start_seq``, default the next
        event), in seq order, from :meth:`pump` / :meth:`run_outlets`. ``fn`` raising
        ``CapacityError`` (no room now) gets the same records again, with later ones, next
        time; any other exception drops that batch for this outlet (logged, counted)."""
        if not callable(fn):
            raise InvalidArgumentError("an outlet must be callable")
        self._outlets.append(_Outlet(str(name), fn, self.subscribe(f"outlet:{name}", start_seq)))

    def run_outlets(self) -> int:
        """Hand every outlet the records it has not had. Returns the records handed out."""
        handed = 0
        for out in self._outlets:
            cur = out.cursor
            if cur.next_seq >= self._next:
                continue
            before = cur.next_seq
            res = self.read(cur)
            if res.lost is not None:
                log.error("event outlet %s fell %d event(s) behind the ring; they are not sent",
                          out.name, res.lost.count)
            try:
                out.fn(res.records)
            except CapacityError:
                self._retries += 1
                cur.next_seq = max(before, self.oldest_seq)  # the same records next time
                continue
            except Exception:
                self._errors += 1
                log.exception("event outlet %s failed; events %d..%d dropped for it", out.name,
                              res.records[0].seq, res.records[-1].seq)
            handed += len(res.records)
        return handed

    # ------------------------------------------------------------------ lifecycle / audit
    def close(self) -> None:
        """Stop taking events; waiters wake. Idempotent."""
        if not self.closed:
            self.closed = True
            self._wake()

    def stats(self) -> HubStats:
        return HubStats(self._next, self.oldest_seq, self._next - self.oldest_seq, self.capacity,
                        self._kinds[KIND_KV], self._kinds[KIND_STATE], self._pumps, len(self._cursors),
                        self._lost, self._retries, self._errors)

    def cursors(self) -> list[Cursor]:
        return list(self._cursors.values())

    def check_invariants(self) -> None:
        """The ring holds exactly the seqs ``oldest_seq .. next_seq - 1``, each at its slot,
        of a known kind; per-kind counts add up to ``next_seq``; no cursor is ahead of the
        next event or negative; every outlet's cursor is subscribed. Raises
        ``InvariantError`` naming the offending seqs / cursors."""
        cap, oldest = self.capacity, self.oldest_seq
        misplaced, wrong_kind = [], []
        for s in range(oldest, self._next):
            r = self._records[s % cap]
            if r is None or r.seq != s:
                misplaced.append(s)
            elif r.kind != _kind(r.event):
                wrong_kind.append(s)
        if misplaced:
            raise InvariantError(f"event ring: seqs {describe_ids(misplaced)} are missing or misplaced")
        if wrong_kind:
            raise InvariantError(f"event ring: seqs {describe_ids(wrong_kind)} carry the wrong kind")
        if sum(self._kinds.values()) != self._next:
            raise InvariantError(f"event ring: {self._kinds} numbered, but next_seq is {self._next}")
        bad = [c.cid for c in self._cursors.values() if not 0 <= c.next_seq <= self._next]
        if bad:
            raise InvariantError(f"event cursors {describe_ids(bad)} point outside 0..{self._next}")
        orphans = [o.name for o in self._outlets if self._cursors.get(o.cursor.cid) is not o.cursor]
        if orphans:
            raise InvariantError(f"event outlets {orphans} have no subscribed cursor")
