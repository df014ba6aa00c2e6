"""The session table: sessions, their epoch and leases, and which session owns which request.

Pure bookkeeping (no pools, no tensors); time from an injectable monotonic ``clock``. A
session is ``(session_id, epoch, lease_ttl_s)``; another epoch's is stale. Every call renews
the lease; :meth:`due` lists expired sessions, oldest first, for the engine to reclaim and
:meth:`close`. Rids are scoped per session (another session's rid is unknown: no probing). A
*fenced* session (:meth:`fence`) is refused as stale and not listed as due, but keeps its
rids until closed: the service's quarantine.

Costs: lookups and renewals O(1) (a heap entry per renewal, compacted); :meth:`due`
O(k log n) for k popped; request bookkeeping O(rids in the call). Not thread-safe (the
engine is single-threaded). See ``docs/internals.md``, "Sessions and leases".
"""
from __future__ import annotations

import heapq
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from radixkv.engine.protocol import Session
from radixkv.errors import (
    CapacityError,
    InvalidArgumentError,
    InvariantError,
    NotFoundError,
    StaleSessionError,
)

__all__ = ["SessionRecord", "SessionTable", "Clock"]

Clock = Callable[[], float]
_ENDED_MEMORY = 1024  # how many ended session ids are remembered for error messages


class SessionRecord:
    """One live session: its id, worker name, lease deadline and the rids it owns
    (insertion-ordered)."""

    __slots__ = ("session_id", "worker_name", "created_at", "expires_at", "rids", "fenced_at",
                 "fence_reason")

    def __init__(self, session_id: str, worker_name: str, now: float, ttl: float):
        self.session_id = session_id
        self.worker_name = worker_name
        self.created_at = now
        self.expires_at = now + ttl
        self.rids: dict[str, None] = {}
        self.fenced_at: float | None = None  # set by SessionTable.fence
        self.fence_reason = ""

    def __repr__(self) -> str:
        fenced = "" if self.fenced_at is None else f", fenced_at={self.fenced_at:.3f}"
        return (f"SessionRecord({self.session_id!r}, worker={self.worker_name!r}, "
                f"expires_at={self.expires_at:.3f}, rids={len(self.rids)}{fenced})")


class SessionTable:
    """Live sessions, their leases, and request ownership.

    Args:
        lease_ttl_s: lease length in seconds (> 0).
        max_sessions: live sessions at once (``open`` raises ``CapacityError`` beyond).
        max_requests_per_session: rids one session may own at once.
        clock: seconds, non-decreasing (default ``time.monotonic``).
        epoch: this table's epoch (default: a random 62-bit int).
    """

    def __init__(self, lease_ttl_s: float, max_sessions: int, max_requests_per_session: int,
                 clock: Clock | None = None, epoch: int | None = None):
        if isinstance(lease_ttl_s, bool) or not isinstance(lease_ttl_s, (int, float)) or not lease_ttl_s > 0:
            raise InvalidArgumentError(f"lease_ttl_s must be a number > 0, got {lease_ttl_s!r}")
        for name, v in (("max_sessions", max_sessions), ("max_requests_per_session", max_requests_per_session)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        if clock is not None and not callable(clock):
            raise InvalidArgumentError("clock must be a callable returning seconds")
        if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, int)):
            raise InvalidArgumentError(f"epoch must be an int, got {epoch!r}")
        self.lease_ttl_s = float(lease_ttl_s)
        self.max_sessions = max_sessions
        self.max_requests_per_session = max_requests_per_session
        self.clock: Clock = clock if clock is not None else time.monotonic
        self.epoch = epoch if epoch is not None else secrets.randbits(62) + 1
        self._sessions: dict[str, SessionRecord] = {}
        self._heap: list[tuple[float, int, str]] = []  # (expires_at, seq, sid); stale entries allowed
        self._seq = 0
        self._ended: OrderedDict[str, str] = OrderedDict()  # sid -> why it ended

    # ------------------------------------------------------------------ sessions
    def __len__(self) -> int:
        return len(self._sessions)

    def now(self) -> float:
        return float(self.clock())

    def open(self, worker_name: str = "") -> Session:
        """Open a session with a fresh lease. O(log n).

        Raises ``InvalidArgumentError`` (worker_name not a str of <= 256 chars) or
        ``CapacityError`` when ``max_sessions`` are live (expired ones count until closed:
        reclaim :meth:`due` sessions first)."""
        if not isinstance(worker_name, str) or len(worker_name) > 256:
            raise InvalidArgumentError("worker_name must be a str of at most 256 characters")
        if len(self._sessions) >= self.max_sessions:
            raise CapacityError(f"{len(self._sessions)} sessions live, the limit is {self.max_sessions}",
                                requested=1, available=0)
        sid = secrets.token_hex(8)
        while sid in self._sessions or sid in self._ended:  # pragma: no cover - 64 random bits
            sid = secrets.token_hex(8)
        rec = SessionRecord(sid, worker_name, self.now(), self.lease_ttl_s)
        self._sessions[sid] = rec
        self._push(rec)
        return Session(sid, self.epoch, self.lease_ttl_s)

    def lookup(self, session: Session) -> SessionRecord:
        """The live record of ``session``; changes nothing.

        Raises ``InvalidArgumentError`` (not a session), ``StaleSessionError`` (another
        epoch, unknown, ended, or its lease has run out)."""
        sid, epoch = _session_fields(session)
        if epoch != self.epoch:
            raise StaleSessionError(f"session {sid!r} is from epoch {epoch}, the manager is at epoch "
                                    f"{self.epoch} (it restarted): attach again")
        rec = self._sessions.get(sid)
        if rec is None:
            why = self._ended.get(sid)
            raise StaleSessionError(f"session {sid!r} {why}" if why else f"unknown session {sid!r}")
        if rec.fenced_at is not None:
            raise StaleSessionError(f"session {sid!r} {rec.fence_reason}")
        if self.now() >= rec.expires_at:
            raise StaleSessionError(f"session {sid!r}: its lease expired")
        return rec

    def renew(self, session_id: str) -> float:
        """Restart the lease of a live session; returns the seconds it now has. O(log n).

        Raises ``StaleSessionError`` for an unknown or fenced session."""
        rec = self._live(session_id)
        if rec.fenced_at is not None:
            raise StaleSessionError(f"session {session_id!r} {rec.fence_reason}")
        rec.expires_at = self.now() + self.lease_ttl_s
        self._push(rec)
        return self.lease_ttl_s

    def time_left(self, session_id: str) -> float:
        """Seconds until the lease of ``session_id`` runs out (<= 0 when expired)."""
        return self._live(session_id).expires_at - self.now()

    def due(self, now: float | None = None) -> list[str]:
        """Ids of the live sessions whose lease has run out at ``now`` (default
        ``clock()``), earliest deadline first. Changes nothing visible (drops stale heap
        entries)."""
        t = self.now() if now is None else float(now)
        out: list[str] = []
        heap = self._heap
        while heap and heap[0][0] <= t:
            exp, _, sid = heap[0]
            rec = self._sessions.get(sid)
            if rec is None or rec.expires_at != exp or rec.fenced_at is not None:
                heapq.heappop(heap)  # stale: renewed, closed or fenced since
                continue
            if sid in out:  # two entries at one deadline (renewed twice at the same time)
                heapq.heappop(heap)
                continue
            out.append(sid)
            heapq.heappop(heap)
        for sid in out:  # keep their entries so a later call still sees them until closed
            self._push(self._sessions[sid])
        return out

    def close(self, session_id: str, reason: str = "was detached") -> list[str]:
        """End a live session: forget it and its rids; returns those rids (in the order
        they were added) so the caller can reclaim what they hold. O(rids).

        Raises ``StaleSessionError`` when the session is not live."""
        rec = self._live(session_id)
        rids = list(rec.rids)
        del self._sessions[session_id]
        self._ended[session_id] = reason
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)
        return rids

    def fence(self, session_id: str, reason: str = "expired (its lease ran out)") -> None:
        """Refuse ``session_id`` from now on without freeing anything: lookups raise
        ``StaleSessionError`` quoting ``reason``, renewals are refused, :meth:`due` skips
        it; it keeps its rids until :meth:`close`. Idempotent. O(1).

        Raises ``StaleSessionError`` when the session is not live,
        ``InvalidArgumentError`` when ``reason`` is not a str."""
        if not isinstance(reason, str):
            raise InvalidArgumentError("a fence reason must be a str")
        rec = self._live(session_id)
        if rec.fenced_at is None:
            rec.fenced_at = self.now()
            rec.fence_reason = reason

    def fenced(self) -> list[str]:
        """Ids of the fenced sessions (not yet closed), in the order they were opened. O(n)."""
        return [sid for sid, rec in self._sessions.items() if rec.fenced_at is not None]

    def session_ids(self) -> list[str]:
        return list(self._sessions)

    def record(self, session_id: str) -> SessionRecord:
        return self._live(session_id)

    # ------------------------------------------------------------------ requests
    def request_count(self) -> int:
        """Requests of all live sessions. O(sessions)."""
        return sum(len(rec.rids) for rec in self._sessions.values())

    def rids(self, session_id: str) -> list[str]:
        return list(self._live(session_id).rids)

    def classify(self, session_id: str, rids: Sequence[str], must_exist: bool) -> list[bool]:
        """For each rid, whether ``session_id`` owns it; changes nothing. O(len(rids)).

        With ``must_exist`` raises ``NotFoundError`` for a rid it does not own (another
        session's rid included: ids are per session)."""
        own = self._live(session_id).rids
        out = [rid in own for rid in rids]
        if must_exist and not all(out):
            raise NotFoundError(f"unknown request {rids[out.index(False)]!r}")
        return out

    def check_batch(self, n: int) -> None:
        """Raise ``CapacityError`` when one call names ``n`` rids, more than any session may own:
        refused before its items are decoded or checked (a hostile batch costs O(1)). O(1)."""
        if n > self.max_requests_per_session:
            raise CapacityError(f"a call naming {n} requests exceeds max_requests_per_session "
                                f"{self.max_requests_per_session}",
                                requested=n, available=self.max_requests_per_session)

    def check_room(self, session_id: str, new: int) -> None:
        """Raise ``CapacityError`` unless ``session_id`` may own ``new`` more rids."""
        rec = self._live(session_id)
        if len(rec.rids) + new > self.max_requests_per_session:
            raise CapacityError(
                f"session {session_id!r} owns {len(rec.rids)} requests, {new} more exceed the limit "
                f"{self.max_requests_per_session}",
                requested=new, available=self.max_requests_per_session - len(rec.rids))

    def add_requests(self, session_id: str, rids: Iterable[str]) -> None:
        """Record that ``session_id`` owns ``rids`` (validated first, all or nothing).

        Raises ``InvalidArgumentError`` (a rid it already owns, or repeated),
        ``CapacityError`` (over ``max_requests_per_session``)."""
        rids = list(rids)
        rec = self._live(session_id)
        taken = [r for r in rids if r in rec.rids]
        if taken or len(set(rids)) != len(rids):
            raise InvalidArgumentError(f"request ids already in use or repeated: {taken or rids}")
        self.check_room(session_id, len(rids))
        for rid in rids:
            rec.rids[rid] = None

    def remove_requests(self, session_id: str, rids: Iterable[str]) -> None:
        """Forget that ``session_id`` owns ``rids`` (validated first, all or nothing).

        Raises ``NotFoundError`` for a rid it does not own."""
        rids = list(rids)
        rec = self._live(session_id)
        self.classify(session_id, rids, must_exist=True)
        if len(set(rids)) != len(rids):
            raise InvalidArgumentError(f"request ids repeated: {rids}")
        for rid in rids:
            del rec.rids[rid]

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Every session is within its limits, none is both live and ended, and every live
        session has a heap entry at its deadline. Raises ``InvariantError`` naming the
        sessions. (Whether each rid has its request is the engine's audit.)"""
        if len(self._sessions) > self.max_sessions:
            raise InvariantError(f"{len(self._sessions)} sessions live, limit {self.max_sessions}")
        for sid, rec in self._sessions.items():
            if rec.session_id != sid:
                raise InvariantError(f"session filed under {sid!r} is {rec.session_id!r}")
            if len(rec.rids) > self.max_requests_per_session:
                raise InvariantError(f"session {sid!r} owns {len(rec.rids)} requests, limit "
                                     f"{self.max_requests_per_session}")
            if sid in self._ended:
                raise InvariantError(f"session {sid!r} is both live and ended")
        filed = {(sid, exp) for exp, _, sid in self._heap}
        missing = [sid for sid, rec in self._sessions.items()
                   if rec.fenced_at is None and (sid, rec.expires_at) not in filed]
        if missing:
            raise InvariantError(f"live sessions without a lease deadline entry: {missing}")

    # ------------------------------------------------------------------ helpers
    def _live(self, session_id: str) -> SessionRecord:
        rec = self._sessions.get(session_id)
        if rec is None:
            raise StaleSessionError(f"unknown session {session_id!r}")
        return rec

    def _push(self, rec: SessionRecord) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (rec.expires_at, self._seq, rec.session_id))
        if len(self._heap) > 4 * len(self._sessions) + 64:
            self._heap = [(r.expires_at, i, r.session_id) for i, r in enumerate(self._sessions.values())]
            heapq.heapify(self._heap)


def _session_fields(session: Session) -> tuple[str, int]:
    """``(session_id, epoch)`` of a ``Session`` (or a 3- or 4-tuple shaped like one)."""
    if not isinstance(session, tuple) or len(session) not in (3, 4):
        raise InvalidArgumentError(f"expected a Session, got {type(session).__name__}")
    sid, epoch = session[0], session[1]
    if not isinstance(sid, str) or isinstance(epoch, bool) or not isinstance(epoch, int):
        raise InvalidArgumentError("a Session is (session_id: str, epoch: int, lease_ttl_s: float)")
    return sid, int(epoch)
