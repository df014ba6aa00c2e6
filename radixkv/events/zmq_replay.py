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
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from radixkv.errors import InvalidArgumentError, InvariantError

if TYPE_CHECKING:  # pragma: no cover
    import zmq

__all__ = ["END_SEQ", "ReplayBuffer", "ReplayStats"]

log = logging.getLogger("radixkv.events.zmq_publisher")

#: The replay stream's end marker (the ``seq`` frame of the last reply): -1, signed, 8 bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


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
    :meth:`since` O(kept), :meth:`serve_one` O(batches answered).
    """

    def __init__(self, buffer_steps: int):
        if isinstance(buffer_steps, bool) or not isinstance(buffer_steps, int) or buffer_steps < 1:
            raise InvalidArgumentError(f"buffer_steps must be an int >= 1, got {buffer_steps!r}")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._published = 0
        self._requests = 0
        self._bad = 0

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
        """Receive one request on the ROUTER socket ``router`` and answer it (the protocol
        of the module docstring). Raises what the socket raises (``zmq.ZMQError``)."""
        frames = router.recv_multipart()
        with self._lock:
            self._requests += 1
        if len(frames) < 2:
            with self._lock:
                self._bad += 1
            return  # no envelope to answer
        ident = frames[0]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            with self._lock:
                self._bad += 1
            log.warning("malformed KV event replay request (%d frames)", len(frames))
            router.send_multipart((ident, b"", END_SEQ, b""))
            return
        start = int.from_bytes(frames[2], "big")
        for seq, payload in self.since(start):
            router.send_multipart((ident, b"", seq.to_bytes(8, "big"), payload))
        router.send_multipart((ident, b"", END_SEQ, b""))

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
