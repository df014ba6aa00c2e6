"""``CallQueue``: the scheduler side's manager calls whose reply nobody waits for, sent in order
from one background thread.

A commit (``cache_finished``) or a ``release`` only frees or inserts rows the scheduler side
has already forgotten, so vLLM's step need not wait for its round trip. ``submit(fn)`` queues
it and returns at once; one thread sends the queued calls in order. A client is not shared
between threads: before any call of its own the caller ``wait()``s until the queue is empty,
so a call in the caller's thread never overlaps a queued one, and a match (``alloc_extend``)
sees every commit submitted before it (a prefix committed by this side is matched by its
next request, as with synchronous commits).

A queued call that raises is not retried (a failed commit or release leaves its rows to the
manager, which reclaims them with the session); its exception is kept with the client it
was sent with, and ``take_failures()`` hands it to the caller's thread (which calls the
link's ``fail``). ``counters``: ``sent``, ``failed``.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.integrations.vllm.link import ManagerClient

__all__ = ["CallQueue"]

_T = TypeVar("_T")


class CallQueue:
    """See the module doc."""

    def __init__(self, name: str = "radixkv-commit"):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._last: Future[Any] | None = None  # the last call's, whatever its result (only waited on)
        self._failures: list[tuple[ManagerClient, BaseException]] = []
        self._mu = threading.Lock()  # guards _failures and counters (the sender thread writes them)
        self.counters: dict[str, int] = {"sent": 0, "failed": 0}

    def submit(self, client: ManagerClient, fn: Callable[[], _T]) -> Future[_T | None]:
        """Queue ``fn()`` (a call on ``client``); returns at once. The future's result is
        ``fn()``'s, or ``None`` when it raised (the exception goes to ``take_failures``)."""
        self._last = self._pool.submit(self._run, client, fn)
        return self._last

    def _run(self, client: ManagerClient, fn: Callable[[], _T]) -> _T | None:
        try:
            out = fn()
        except Exception as e:  # kept for the caller's thread: the link is not the sender's
            with self._mu:
                self.counters["failed"] += 1
                self._failures.append((client, e))
            return None
        with self._mu:
            self.counters["sent"] += 1
        return out

    @property
    def busy(self) -> bool:
        """A queued call is not finished yet."""
        last = self._last
        return last is not None and not last.done()

    def wait(self) -> None:
        """Block until every call submitted so far has finished (at once when none is queued)."""
        last = self._last
        if last is not None:
            last.result()  # _run never raises

    def take_failures(self) -> list[tuple[ManagerClient, BaseException]]:
        """``(client, exception)`` of the queued calls that raised since the last take."""
        with self._mu:
            out, self._failures = self._failures, []
        return out

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        self._pool.shutdown(wait=True)
