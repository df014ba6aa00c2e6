"""The replay side of the vLLM ZMQ outlet: the last published batches and the answers to
replay requests.

Split out of :mod:`radixkv.events.zmq_publisher`. The
protocol (vLLM's ``ZmqEventPublisher``): a subscriber that sees a gap in ``seq`` (or joins
late) sends one request to the ROUTER socket, ``[start_seq]`` (8 bytes big-endian) from a
REQ socket (or ``[b"", start_seq]`` from a DEALER); the ROUTER answers with one message
``[seq, payload]`` per kept batch whose ``seq >= start_seq``, oldest first, then the end
marker ``[END_SEQ, b""]``. Only the last ``buffer_steps`` batches are kept. A malformed
request (not 8 bytes) gets the end marker alone; a request without an envelope, nothing.

:class:`ReplayBuffer` is thread-safe (one lock): the sending thread records batches and
serves requests while other threads read its stats.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from radixkv.errors import InvalidArgumentError, InvariantError

if TYPE_CHECKING:  # pragma: no cover
    import zmq

__all__ = ["END_SEQ", "ReplayBuffer", "ReplayStats", "LOG_PERIOD_S", "MAX_PENDING"]

log = logging.getLogger("radixkv.events.zmq_publisher")

#: The replay stream's end marker (the ``seq`` frame of the last reply): -1, signed, 8 bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Malformed requests are logged at most once per this long (with the count).
LOG_PERIOD_S = 10.0
#: Answers being sent at once; more requests wait in the socket's queue.
MAX_PENDING = 64


class ReplayStats(NamedTuple):
    """``published``: batches recorded (sent on PUB); ``buffered``: kept, ``oldest_seq`` the
    first of them (``None`` when empty); ``requests`` served, ``bad_requests`` among them."""

    published: int
    buffered: int
    oldest_seq: int | None
    requests: int
    bad_requests: int


class ReplayBuffer:
    """The last ``buffer_steps`` ``(seq, payload)`` batches sent, and the replay answers.

    Raises ``InvalidArgumentError`` for ``buffer_steps < 1``. :meth:`record` O(1),
    :meth:`since` O(kept), :meth:`accept` O(kept) (a snapshot), :meth:`pump` O(budget).
    """

    def __init__(self, buffer_steps: int):
        if isinstance(buffer_steps, bool) or not isinstance(buffer_steps, int) or buffer_steps < 1:
            raise InvalidArgumentError(f"buffer_steps must be an int >= 1, got {buffer_steps!r}")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._published = 0
        self._requests = 0
        self._bad = 0
        self._pending: deque[tuple[bytes, list[tuple[int, bytes]], int]] = deque()  # (ident, answer, sent)
        self._bad_unlogged = 0
        self._next_log = float("-inf")

    def record(self, seq: int, payload: bytes) -> None:
        """Keep batch ``seq`` (just sent); the oldest goes past ``buffer_steps``."""
        with self._lock:
            self._buffer.append((seq, payload))
            self._published += 1

    @property
    def capacity(self) -> int:
        """Batches kept at most (``buffer_steps``)."""
        return self._buffer.maxlen or 0  # always set (deque(maxlen=buffer_steps))

    @property
    def published(self) -> int:
        with self._lock:
            return self._published

    def since(self, start_seq: int) -> list[tuple[int, bytes]]:
        """The kept ``(seq, payload)`` pairs with ``seq >= start_seq``, oldest first."""
        with self._lock:
            return [(s, p) for s, p in self._buffer if s >= start_seq]

    def serve_one(self, router: zmq.Socket[bytes]) -> None:
        """Receive one request and send its whole answer (:meth:`accept`, then :meth:`pump`
        without a budget). Raises what the socket raises (``zmq.ZMQError``)."""
        self.accept(router)
        self.pump(router, None)

    @property
    def pending(self) -> int:
        """Answers accepted and not fully sent."""
        return len(self._pending)

    def accept(self, router: zmq.Socket[bytes]) -> None:
        """Receive one request on the ROUTER socket ``router`` and queue its answer (the
        protocol of the module docstring); a malformed one is answered at once."""
        frames = router.recv_multipart()
        with self._lock:
            self._requests += 1
        if len(frames) < 2:
            self._malformed(len(frames))
            return  # no envelope to answer
        ident = frames[0]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self._malformed(len(frames))
            router.send_multipart((ident, b"", END_SEQ, b""))
            return
        self._pending.append((ident, self.since(int.from_bytes(frames[2], "big")), 0))

    def pump(self, router: zmq.Socket[bytes], budget: int | None) -> int:
        """Send at most ``budget`` messages (None: all) of the queued answers, oldest answer
        first, each ended by its end marker. Returns the messages sent."""
        sent = 0
        while self._pending and (budget is None or sent < budget):
            ident, answer, i = self._pending[0]
            n = len(answer) - i if budget is None else min(len(answer) - i, budget - sent)
            for seq, payload in answer[i:i + n]:
                router.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload))
            sent += n
            if i + n < len(answer):
                self._pending[0] = (ident, answer, i + n)
                break
            router.send_multipart((ident, b"", END_SEQ, b""))
            self._pending.popleft()
            sent += 1
        return sent

    def _malformed(self, frames: int) -> None:
        now = time.monotonic()
        with self._lock:
            self._bad += 1
            self._bad_unlogged += 1
            if now < self._next_log:
                return
            n, self._bad_unlogged, self._next_log = self._bad_unlogged, 0, now + LOG_PERIOD_S
        log.warning("%d malformed KV event replay request(s) (the last of %d frames); the next are counted "
                    "and logged at most once per %.0f s", n, frames, LOG_PERIOD_S)

    def stats(self) -> ReplayStats:
        with self._lock:
            return ReplayStats(self._published, len(self._buffer),
                               self._buffer[0][0] if self._buffer else None, self._requests, self._bad)

    def check_invariants(self) -> None:
        """Kept numbers are consecutive and end at the last batch recorded; at most
        ``buffer_steps`` kept. Raises ``InvariantError`` naming the missing / duplicated
        seqs."""
        with self._lock:
            seqs = [s for s, _ in self._buffer]
            published = self._published
        if seqs and seqs != list(range(seqs[0], seqs[0] + len(seqs))):
            gaps = sorted(set(range(seqs[0], seqs[-1] + 1)) - set(seqs))
            raise InvariantError(f"replay buffer not consecutive; missing seqs {gaps[:16]}, "
                                 f"duplicated {sorted({s for s in seqs if seqs.count(s) > 1})[:16]}")
        if seqs and seqs[-1] != published - 1:
            raise InvariantError(f"replay buffer ends at seq {seqs[-1]}, but {published} batches were sent")
        if len(seqs) > (self._buffer.maxlen or 0):
            raise InvariantError(f"replay buffer holds {len(seqs)} > {self._buffer.maxlen}")
