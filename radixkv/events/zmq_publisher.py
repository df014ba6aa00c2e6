"""Publish KV event batches on vLLM's ZMQ wire: a PUB socket plus a replay ROUTER socket.

As vLLM's ``ZmqEventPublisher``: each batch is one PUB message ``[topic, seq (8 bytes BE),
payload]`` (payload: :mod:`radixkv.events.vllm_wire`); an optional ROUTER replays the last
``buffer_steps`` batches from a ``start_seq`` (:mod:`radixkv.events.zmq_replay`). The PUB
socket binds for ``*`` / ``::`` / ``ipc://`` / ``inproc://`` endpoints and connects
otherwise; the replay socket binds.

With ``background=True`` (default) a thread owns the sockets; :meth:`publish` (any thread)
validates and encodes in the caller before taking a number, so a bad batch raises there and
takes none. With ``background=False`` the caller sends and calls :meth:`serve_replay`.
:func:`add_arguments` / :func:`from_args` / :func:`config_from_args` give the CLI flags. The
wire, endpoints and flags: ``docs/events.md``, section 1.
"""
from __future__ import annotations

import enum
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable
from typing import Final, NamedTuple

import zmq

from radixkv.cache.kv_events import KVEventBatch
from radixkv.errors import CapacityError, InvalidArgumentError, InvariantError
from radixkv.events.vllm_wire import LAYOUTS, STATE_POLICIES, encode_batch
from radixkv.events.zmq_replay import ReplayBuffer

__all__ = ["ZmqEventPublisher", "PublisherStats", "should_bind"]

log = logging.getLogger(__name__)


class _Stop(enum.Enum):
    """The sentinel that ends the sending thread (an enum member, so mypy tells it apart)."""

    STOP = "stop"


_STOP: Final = _Stop.STOP


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6-any, ``ipc://`` or ``inproc://`` endpoint, else connect."""
    return ("*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")
            or endpoint.startswith("inproc://"))


class PublisherStats(NamedTuple):
    """``published``: batches sent on PUB; ``next_seq``: the number the next batch gets;
    ``buffered``: batches kept for replay, ``oldest_seq`` the first of them (``None`` when
    empty); ``queued``: batches waiting for the thread; ``replay_requests`` served (and
    ``bad_replay_requests`` among them)."""

    published: int
    next_seq: int
    buffered: int
    oldest_seq: int | None
    queued: int
    replay_requests: int
    bad_replay_requests: int


def _check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


class ZmqEventPublisher:
    """vLLM-compatible KV event publisher (PUB + replay ROUTER, bounded replay buffer).

    Args: ``endpoint`` (PUB, ``tcp://*:5557`` by default); ``replay_endpoint`` (``None``: no
    replay); ``topic``; ``buffer_steps`` (batches kept for replay); ``hwm`` (PUB send
    high-water mark); ``max_queue_size`` / ``put_timeout_s`` (the background queue; full:
    ``CapacityError``); ``data_parallel_rank``; ``layout`` (``"array"`` / ``"map"``);
    ``state_events`` (``"drop"`` / ``"inline"`` / ``"error"``); ``background``; ``linger_ms``
    (drain time at ``close``); ``context`` (default: a private one, terminated by ``close``).

    Raises InvalidArgumentError for a bad argument or an endpoint that cannot be bound or
    connected (nothing left open).
    """

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None, topic: str = "",
                 *, buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000,
                 data_parallel_rank: int | None = 0, layout: str = "array", state_events: str = "drop",
                 background: bool = True, linger_ms: int = 100, put_timeout_s: float = 1.0,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None):
        if not isinstance(endpoint, str) or not endpoint:
            raise InvalidArgumentError(f"endpoint must be a non-empty str, got {endpoint!r}")
        if replay_endpoint is not None and (not isinstance(replay_endpoint, str) or not replay_endpoint):
            raise InvalidArgumentError(f"replay_endpoint must be a non-empty str or None, got {replay_endpoint!r}")
        if not isinstance(topic, str):
            raise InvalidArgumentError(f"topic must be a str, got {topic!r}")
        _check_int("buffer_steps", buffer_steps, 1)
        _check_int("hwm", hwm, 0)
        _check_int("max_queue_size", max_queue_size, 1)
        _check_int("linger_ms", linger_ms, 0)
        if data_parallel_rank is not None:
            _check_int("data_parallel_rank", data_parallel_rank, 0)
        if layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if state_events not in STATE_POLICIES:
            raise InvalidArgumentError(f"state_events must be one of {STATE_POLICIES}, got {state_events!r}")
        if isinstance(put_timeout_s, bool) or not isinstance(put_timeout_s, (int, float)) or put_timeout_s < 0:
            raise InvalidArgumentError(f"put_timeout_s must be a number >= 0, got {put_timeout_s!r}")
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self.layout = layout
        self.state_events = state_events
        self.data_parallel_rank = data_parallel_rank
        self.background = bool(background)
        self._hwm, self._linger = hwm, linger_ms
        self._put_timeout = float(put_timeout_s)
        self._want = (endpoint, replay_endpoint)
        self.endpoint: str = endpoint  # the bound address once open (a ``*`` port resolved)
        self.replay_endpoint: str | None = None
        self._own_ctx = context is None
        self._ctx = zmq.Context() if context is None else context
        self._kept = ReplayBuffer(buffer_steps)
        self._seq_lock = threading.Lock()
        self._next_seq = 0
        self._closed = False
        self._pub: zmq.Socket[bytes] | None = None
        self._ipc_files: list[str] = []  # socket files of bound ipc:// endpoints, removed at close
        self._replay: zmq.Socket[bytes] | None = None
        self._queue: queue.Queue[tuple[int, bytes] | _Stop] = queue.Queue(maxsize=max_queue_size)
        self._thread: threading.Thread | None = None
        if self.background:
            ready = threading.Event()
            err: list[BaseException] = []
            self._thread = threading.Thread(target=self._run, args=(ready, err), daemon=True,
                                            name="radixkv-kv-events")
            self._thread.start()
            ready.wait()
            if err:
                self._thread.join()
                self._term()
                raise err[0]
        else:
            try:
                self._open()
            except BaseException:
                self._term()
                raise

    # ------------------------------------------------------------------ sockets
    def _open(self) -> None:
        endpoint, replay_endpoint = self._want
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.setsockopt(zmq.LINGER, self._linger)
            self._pub = pub
            if should_bind(endpoint):
                pub.bind(endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
                self._note_ipc(self.endpoint)
            else:
                pub.connect(endpoint)
                self.endpoint = endpoint
            if replay_endpoint is not None:
                rep = self._ctx.socket(zmq.ROUTER)
                rep.setsockopt(zmq.LINGER, self._linger)
                self._replay = rep
                rep.bind(replay_endpoint)
                self.replay_endpoint = rep.getsockopt_string(zmq.LAST_ENDPOINT)
                self._note_ipc(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise InvalidArgumentError(f"cannot open KV event endpoints {self._want}: {e}") from None

    def _note_ipc(self, endpoint: str) -> None:
        path = endpoint[len("ipc://"):] if endpoint.startswith("ipc://") else ""
        if path and not path.startswith("@"):  # "@name": Linux abstract namespace, no file
            self._ipc_files.append(path)

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=self._linger)
        self._pub = self._replay = None
        for path in self._ipc_files:  # libzmq leaves the socket files of bound ipc endpoints
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._ipc_files = []

    def _term(self) -> None:
        if self._own_ctx:
            self._ctx.term()

    # ------------------------------------------------------------------ publishing
    def publish(self, events: KVEventBatch | Iterable[object], ts: float | None = None) -> int:
        """Publish one batch; returns its sequence number.

        ``events``: a ``KVEventBatch`` or a sequence of events / ``to_dict()`` dicts. An empty
        batch (also one emptied by the ``state_events`` policy) is published and numbered all the
        same. The batch is validated and encoded here before it takes a number.

        Raises: InvalidArgumentError (bad events, or the publisher is closed),
        CapacityError (background queue full for ``put_timeout_s``; the number is not used).
        O(tokens in the batch).
        """
        rank = None
        if not hasattr(events, "data_parallel_rank") or events.data_parallel_rank is None:
            rank = self.data_parallel_rank
        payload = encode_batch(events, ts=ts, data_parallel_rank=rank, layout=self.layout,
                               state_events=self.state_events)
        with self._seq_lock:
            if self._closed:
                raise InvalidArgumentError("the publisher is closed")
            seq = self._next_seq
            if self.background:
                try:
                    self._queue.put((seq, payload), timeout=self._put_timeout)
                except queue.Full:
                    raise CapacityError(f"KV event queue full ({self._queue.maxsize} batches)",
                                        requested=1, available=0) from None
            else:
                self._send(seq, payload)
            self._next_seq = seq + 1
        return seq

    def _send(self, seq: int, payload: bytes) -> None:
        # called only while open (publish checks _closed under the lock; close joins the sender)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))  # type: ignore[union-attr]
        self._kept.record(seq, payload)

    # ------------------------------------------------------------------ replay
    @property
    def buffer_steps(self) -> int:
        """Batches kept for replay at most."""
        return self._kept.capacity

    def buffered_since(self, start_seq: int) -> list[tuple[int, bytes]]:
        """The kept ``(seq, payload)`` pairs with ``seq >= start_seq``, oldest first."""
        return self._kept.since(start_seq)

    def _serve_one(self, replay: zmq.Socket[bytes]) -> None:
        self._kept.serve_one(replay)

    def serve_replay(self, timeout_ms: int = 0) -> int:
        """Answer the replay requests waiting (waiting up to ``timeout_ms`` for the first);
        returns how many. Only with ``background=False`` (the thread serves them otherwise)."""
        if self.background:
            raise InvalidArgumentError("serve_replay is for background=False publishers")
        if self._closed or self._replay is None:
            return 0
        n = 0
        while self._replay.poll(timeout_ms if n == 0 else 0):
            self._serve_one(self._replay)
            n += 1
        return n

    # ------------------------------------------------------------------ thread
    def _run(self, ready: threading.Event, err: list[BaseException]) -> None:
        try:
            self._open()
        except BaseException as e:  # reported by the constructor
            err.append(e)
            ready.set()
            return
        ready.set()
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        try:
                            self._serve_one(self._replay)
                        except zmq.ZMQError as e:  # a vanished client must not stop publishing
                            log.warning("KV event replay failed: %s", e)
                try:
                    item = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                try:
                    self._send(*item)
                except zmq.ZMQError as e:
                    log.error("KV event batch %d not sent: %s", item[0], e)
        finally:
            self._close_sockets()

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued batch is sent (background); ``True`` when done in time."""
        if not self.background:
            return True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._kept.published >= self._next_seq:
                return True
            time.sleep(0.002)
        return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued (up to ``timeout_s``), close the sockets (removing the files
        of bound ``ipc://`` endpoints) and, when private, the context. Idempotent;
        ``publish`` raises afterwards."""
        with self._seq_lock:  # no publish is half done past this point
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            try:
                self._queue.put(_STOP, timeout=timeout_s)
            except queue.Full:
                log.error("KV event queue still full at close; dropping what is queued")
                self._drain_queue()
                self._queue.put_nowait(_STOP)
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.error("KV event thread did not finish in %.1fs; dropping what is queued", timeout_s)
                self._drain_queue()
                self._queue.put_nowait(_STOP)
                self._thread.join()
        else:
            self._close_sockets()
        self._term()

    def _drain_queue(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ audit
    def stats(self) -> PublisherStats:
        k = self._kept.stats()
        return PublisherStats(k.published, self._next_seq, k.buffered, k.oldest_seq, self._queue.qsize(),
                              k.requests, k.bad_requests)

    def check_invariants(self) -> None:
        """Buffered numbers are consecutive and end at the last sent one; nothing sent that
        was not numbered; the buffer holds at most ``buffer_steps``."""
        self._kept.check_invariants()
        published = self._kept.published
        if published > self._next_seq:
            raise InvariantError(f"{published} batches sent but only {self._next_seq} numbered")
