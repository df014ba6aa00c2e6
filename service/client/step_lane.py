"""The worker's side of the ``Step`` stream: its step calls as messages of one open stream.

The stream, its messages and its error form are described in :mod:`radixkv.service.wire.step`;
the manager's side is :mod:`radixkv.service.server.step_stream`.

Deadlines: a stream message has none of its own, so :class:`StepStream` runs a watchdog that
cancels the stream when a call waits longer than the client's timeout; the call then fails
as a unary call past its deadline does (``DEADLINE_EXCEEDED`` ->
``ServiceUnavailableError``, retried by the client's retry policy).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import grpc
from radixkv.service.client.step_socket import StepSocket
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire._gen.cache_manager_pb2_grpc import CacheManagerStub
from radixkv.service.wire.auth import Metadata, Token
from radixkv.service.wire.step import StepRpcError, step_reply, step_request

__all__ = ["StepStream", "StepLane", "Replay"]

_END = object()

class Replay:
    """An ``ApplyDecodesRequest`` riding on a call, its own request id, and whether the
    manager said it applied every call (set by whoever sent it)."""

    __slots__ = ("request", "request_id", "applied")

    def __init__(self, request: pb.ApplyDecodesRequest, request_id: str):
        self.request, self.request_id, self.applied = request, request_id, False


class StepStream:
    """One open ``Step`` stream of a client; :meth:`call` sends a call and waits for its
    answer. One call at a time (the caller holds a lock). A watchdog thread cancels the
    stream when a call waits longer than ``timeout_s``.

    Args:
        stub: the ``CacheManagerStub``.
        metadata: the call metadata (auth) the stream opens with.
        timeout_s: how long one call may wait for its answer.
    """

    def __init__(self, stub: CacheManagerStub, metadata: Metadata, timeout_s: float):
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._timeout = float(timeout_s)
        self._since: float | None = None  # when the call in flight was sent
        self._timed_out = False
        self._closed = threading.Event()
        self.broken = False
        self.calls = 0  # calls answered over this stream
        self._call = stub.Step(iter(self._requests.get, _END), metadata=metadata)
        self._watchdog = threading.Thread(target=self._watch, name="radixkv-step-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        tick = max(0.005, min(0.1, self._timeout / 10))
        while not self._closed.wait(tick):
            since = self._since
            if since is not None and time.monotonic() - since > self._timeout:
                self._timed_out = True
                self._call.cancel()
                return

    def call(self, method: str, request: Any, request_id: str, replay: Replay | None = None) -> Any | None:
        """Send ``request`` (a unary request message of ``method``), with ``replay`` (an
        ``ApplyDecodes`` request and its request id) riding on it when given, and return the
        reply message; raise :class:`StepRpcError` when the call (or the replay before it)
        failed (in the stream, or past its deadline: ``DEADLINE_EXCEEDED``). Returns None
        when the stream broke otherwise (``broken`` is then set; the replay and the call may
        or may not have run: send them again with the same request ids)."""
        if self.broken:
            return None
        self._since = time.monotonic()
        self._requests.put(step_request(method, request, request_id, replay))
        try:
            resp = next(self._call)
        except (grpc.RpcError, StopIteration) as e:
            self._break()
            if self._timed_out:
                raise StepRpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"Deadline Exceeded: no answer within {self._timeout} s") from None
            self.unimplemented = isinstance(e, grpc.RpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED
            return None
        finally:
            self._since = None
        self.calls += 1
        self.rides_replay = resp.rides_replay
        if replay is not None:
            replay.applied = resp.replayed
        return step_reply(resp, method)

    unimplemented = False  # the manager has no Step method (an older one)
    rides_replay = False  # the manager runs a replay riding on a call (said in its answers)

    def _break(self) -> None:
        self.broken = True
        self._closed.set()
        self._requests.put(_END)
        self._call.cancel()

    def close(self) -> None:
        """End the stream (idempotent)."""
        if not self.broken:
            self._break()
        self._watchdog.join(1.0)


class StepLane:
    """A client's use of a Step stream: opened on first use, one call at a time (a caller
    that finds it busy gets None and makes a unary call), a broken stream replaced by a new
    one no sooner than ``REOPEN_S`` later, and none at all once the manager answered that
    it has no Step method (an older manager).

    With ``socket_path`` (the manager's Step socket, :mod:`~radixkv.service.client.step_socket`)
    and ``token``, each (re)opening tries that socket first and opens a gRPC stream only
    when nothing usable listens there (``socket_misses`` counts those).

    Args: as :class:`StepStream`, and ``socket_path`` / ``token``.
    """

    REOPEN_S = 1.0

    def __init__(self, stub: CacheManagerStub, metadata: Metadata, timeout_s: float, socket_path: str | None = None,
                 token: Token | None = None):
        self._stub, self._md, self._timeout = stub, metadata, timeout_s
        self._socket_path = socket_path if token is not None else None
        self._token = token
        self.socket_misses = 0
        self._lock = threading.Lock()
        self.stream: StepStream | StepSocket | None = None
        self.enabled = True
        self.reopen_at = 0.0  # monotonic
        self.fallbacks = 0  # calls that found the stream broken (sent again over unary calls)

    @property
    def rides_replay(self) -> bool:
        """The open stream's manager runs a replay riding on a call (False before its first
        answer, and for an older manager, which would ignore the replay)."""
        s = self.stream
        return self.enabled and s is not None and s.rides_replay

    def call(self, method: str, request: Any, request_id: str, replay: Replay | None = None) -> Any | None:
        """The reply of ``method`` over the stream (``replay`` riding on it, see
        :meth:`StepStream.call`), or None (busy, broken or not served: send the replay, then
        the call, as unary calls with the same request ids). Raises :class:`StepRpcError`."""
        if not self.enabled or not self._lock.acquire(blocking=False):
            return None
        try:
            s = self.stream
            if s is None:
                if time.monotonic() < self.reopen_at:
                    return None
                s = self._open()
                self.stream = s
            reply = s.call(method, request, request_id, replay)
            if reply is None:  # broken: this call goes over the unary path
                self.stream = None
                self.fallbacks += 1
                s.close()
                self.enabled = not s.unimplemented
                self.reopen_at = time.monotonic() + self.REOPEN_S
            return reply
        except StepRpcError:
            if s is not None and s.broken:
                self.stream = None
                s.close()
                self.reopen_at = time.monotonic() + self.REOPEN_S
            raise
        finally:
            self._lock.release()

    def _open(self) -> StepStream | StepSocket:
        if self._socket_path is not None and self._token is not None:
            sock = StepSocket.open(self._socket_path, self._token, self._timeout)
            if sock is not None:
                return sock
            self.socket_misses += 1
        return StepStream(self._stub, self._md, self._timeout)

    def close(self) -> None:
        with self._lock:
            self.enabled = False
            if self.stream is not None:
                self.stream.close()
                self.stream = None
