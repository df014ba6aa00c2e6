"""Turns of the manager loop's engine work, shared round-robin across sessions.

A worker's engine work runs inside a turn (:meth:`FairShare.turn`): a unary call's body, a
Step message with its replay, each slice of a large ``Match``. Units never await, so one turn
runs at a time; when it ends the next goes to the next waiting session in round-robin order,
so a session sending many or large calls waits behind one turn of each other waiting session
instead of holding the loop ahead of them. Between its slices a call passes its turn
(:meth:`FairShare.pass_turn`): with nobody waiting it first lets the loop run
:data:`YIELD_ITERATIONS` times, so a call that arrived meanwhile reaches the queue first (poll,
read, task wake-up). O(1) per turn; a turn nobody waits for awaits nothing. The story:
``docs/reliability.md``, "Load with an attacker present".
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from radixkv.errors import InvariantError

__all__ = ["FairShare", "YIELD_ITERATIONS", "turn_key", "yield_to_loop"]

#: Loop iterations a call passing its turn waits when nobody waits: a Step-socket frame needs
#: two after the poll that sees it (the read, then its task) to ask for a turn.
YIELD_ITERATIONS = 3


async def yield_to_loop() -> None:
    """Let the loop run :data:`YIELD_ITERATIONS` times (a frame that arrived gets to its turn)."""
    for _ in range(YIELD_ITERATIONS):
        await asyncio.sleep(0)


def turn_key(request: object) -> str:
    """Whose turn a request takes: its session id ('' for calls without a session)."""
    session = getattr(request, "session", None)
    return str(getattr(session, "session_id", "")) if session is not None else ""


class FairShare:
    """Round-robin turns across sessions on one event loop (module doc). ``granted``: turns
    given; ``waited``: turns that had to queue (a measure of contention)."""

    def __init__(self) -> None:
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._held: str | None = None  # whose turn runs (granted, maybe not started yet)
        self.granted = 0
        self.waited = 0

    @asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        """Hold a turn for session ``key`` for the block (which must not await, but for
        :meth:`pass_turn`)."""
        await self._acquire(key)
        try:
            yield
        finally:
            self._release()

    async def pass_turn(self, key: str) -> None:
        """Inside a turn of ``key``: let every other waiting session (or, with none, the loop)
        go first, then hold a turn again."""
        self._release()
        if not self._waiting:
            await yield_to_loop()
        await self._acquire(key)

    async def _acquire(self, key: str) -> None:
        self.granted += 1
        if self._held is None and not self._waiting:
            self._held = key
            return
        self.waited += 1
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # granted, then cancelled before it ran: pass it on
            else:
                self._drop(key, fut)
            raise

    def _drop(self, key: str, fut: asyncio.Future[None]) -> None:
        q = self._waiting.get(key)
        if q is not None and fut in q:
            q.remove(fut)
            if not q:
                del self._waiting[key]

    def _release(self) -> None:
        self._held = None
        while self._waiting:
            key, q = next(iter(self._waiting.items()))
            fut = q.popleft()
            if q:
                self._waiting.move_to_end(key)  # the next turn goes to the next session
            else:
                del self._waiting[key]
            if not fut.done():
                self._held = key
                fut.set_result(None)
                return

    def waiting(self) -> dict[str, int]:
        """Turns waiting, by session, in the order they will be served first. O(sessions)."""
        return {k: len(q) for k, q in self._waiting.items()}

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` naming the session of an empty or settled queue entry,
        or waiters while no turn is held."""
        for key, q in self._waiting.items():
            if not q or any(f.done() for f in q):
                raise InvariantError(f"fair share: session {key!r} has an empty or settled wait queue")
        if self._waiting and self._held is None:
            raise InvariantError(f"fair share: {len(self._waiting)} session(s) wait while no turn is held")
