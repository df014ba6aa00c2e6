"""The ``Step`` stream: the step calls of one worker over one persistent gRPC stream.

A unary RPC in Python gRPC pays a call set-up each time (a new HTTP/2 stream, headers,
deadline, the auth interceptor, trailers): about half the cost of a small call (measured
in ``docs/service.md``, "Benchmark": CPU and round trip per call, unary against a message of
an open stream). A scheduler makes ~10 calls per
step, so a client may instead send its step calls as messages of one long-lived
bidirectional stream (``connect(..., step_stream=True)``). It is the same protocol, not a
second one:

* a :class:`pb.StepRequest` carries the method name and the bytes of that method's *unary*
  request message; the manager parses them with the same parser, fences due sessions and
  runs the same handler body through ``CacheManagerServicer.answer`` (same validation, same
  engine call, same reply cache: ``request_id`` is the ``radixkv-request-id`` and the digest
  is over the same request bytes, so a call retried over the unary path after a broken
  stream gets the reply kept from the stream, and the other way round);
* the :class:`pb.StepResponse` carries the unary reply's bytes, or the status a failed unary
  call would end with (:class:`pb.StepError`: code, details, trailing metadata), which the
  client turns into the same ``radixkv.errors`` type with the one mapping
  (``radixkv.service.errors.error_from_rpc``). A failed call does not end the stream.

Only :data:`STEP_METHODS` travel on it (session-scoped, idempotent calls); anything else is
answered INVALID_ARGUMENT in the stream. The stream ends when the worker closes it or the
manager starts shutting down (``closing``); a worker whose stream broke sends the call over
the unary path with the same request id (safe: see the reply cache).

Deadlines: a stream message has none of its own, so :class:`StepStream` runs a watchdog that
cancels the stream when a call waits longer than the client's timeout; the call then fails
as a unary call past its deadline does (``DEADLINE_EXCEEDED`` ->
``ServiceUnavailableError``, retried by the client's retry policy).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable, Dict, Optional, Set, Tuple

import grpc

from radixkv.errors import InvalidArgumentError, RadixKVError
from radixkv.service._gen import cache_manager_pb2 as pb
from radixkv.service.errors import RpcStatus, status_of
from radixkv.service.idempotency import check_request_id

__all__ = ["STEP_METHODS", "REPLY_TYPES", "StepRpcError", "StepStream", "StepLane", "serve_step_stream",
           "error_to_msg"]

log = logging.getLogger("radixkv.service")

#: The methods a Step stream carries, with the reply message type of each.
REPLY_TYPES: Dict[str, Any] = {
    "Heartbeat": pb.HeartbeatResponse, "Match": pb.MatchResponse, "AllocExtend": pb.AllocExtendResponse,
    "AllocDecode": pb.AllocDecodeResponse, "ApplyDecodes": pb.ApplyDecodesResponse,
    "CacheUnfinished": pb.CacheResponse,
    "CacheFinished": pb.CacheResponse, "Release": pb.ReleaseResponse, "Evict": pb.EvictResponse,
}
STEP_METHODS = tuple(REPLY_TYPES)


# --------------------------------------------------------------------------- errors in the stream


def error_to_msg(st: RpcStatus) -> pb.StepResponse:
    """The StepResponse of a call that failed with status ``st``."""
    return pb.StepResponse(error=pb.StepError(code=int(st.code.value[0]), details=st.details,
                                              trailing_keys=[k for k, _ in st.trailing_metadata],
                                              trailing_values=[str(v) for _, v in st.trailing_metadata]))


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class StepRpcError(grpc.RpcError):
    """A failed step call, shaped as the ``grpc.RpcError`` of a failed unary call (``code``,
    ``details``, ``trailing_metadata``), so that ``error_from_rpc`` maps it."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Tuple[Tuple[str, str], ...] = ()):
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, trailing

    @classmethod
    def from_msg(cls, m: pb.StepError) -> "StepRpcError":
        return cls(_CODES.get(int(m.code), grpc.StatusCode.UNKNOWN), m.details,
                   tuple(zip(m.trailing_keys, m.trailing_values)))

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Tuple[Tuple[str, str], ...]:
        return self._trailing


# --------------------------------------------------------------------------- the manager's side


def _bodies(servicer: Any) -> Dict[str, Tuple[Callable[[Any, Any], Any], Any]]:
    """``{method: (body, request type)}`` of the servicer's unary handlers (cached)."""
    got = getattr(servicer, "_step_bodies", None)
    if got is None:
        cls = type(servicer)
        got = {m: (getattr(cls, m).body, getattr(cls, m).request_cls) for m in STEP_METHODS}
        servicer._step_bodies = got
    return got


async def _one(servicer: Any, raw: bytes) -> bytes:
    """Run one StepRequest (as its unary call would run) and return the StepResponse bytes."""
    from radixkv.service.servicer import parse

    t0 = time.perf_counter()
    name, code = "Step", "OK"
    try:
        step = parse(pb.StepRequest, raw, "Step")
        spec = _bodies(servicer).get(step.method)
        if spec is None:
            raise InvalidArgumentError(f"Step: {step.method!r:.80} is not a step method {list(STEP_METHODS)}")
        name = step.method
        body, request_cls = spec
        request = parse(request_cls, step.request, name)
        servicer.quarantine.fence_due()
        rid = check_request_id(step.request_id) if step.request_id else None
        reply, delay = servicer.answer(name, body, request, step.request, rid)
        if delay:  # fault injection, as on the unary path
            await asyncio.sleep(delay)
        return pb.StepResponse(reply=reply).SerializeToString()
    except Exception as exc:  # mapped, never leaked as a traceback
        st = status_of(exc)
        code = st.code.name
        if not isinstance(exc, RadixKVError):
            log.exception("internal error in Step/%s", name)
        return error_to_msg(st).SerializeToString()
    finally:
        servicer.metrics.observe(name, code, time.perf_counter() - t0)


async def serve_step_stream(servicer: Any, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
    """The ``Step`` handler: answer each message in order until the worker closes the stream
    or the manager starts closing (``servicer.closing``: the stream then ends with OK, and the
    worker falls back to unary calls).

    Shutdown does not race every read against ``closing`` (that costs ~0.1 ms a message):
    one task per servicer waits for ``closing`` and cancels the open streams' tasks."""
    if servicer.closing.is_set():
        return
    tasks = _stream_tasks(servicer)
    task = asyncio.current_task()
    tasks.add(task)
    try:
        while True:
            raw = await context.read()
            if raw is grpc.aio.EOF:
                return
            await context.write(await _one(servicer, raw))
    except asyncio.CancelledError:
        if servicer.closing.is_set():
            return  # ended by the shutdown: the stream ends OK
        raise
    finally:
        tasks.discard(task)


def _stream_tasks(servicer: Any) -> Set["asyncio.Task[Any]"]:
    """The servicer's open Step streams (and, once, the task that ends them at shutdown)."""
    tasks = getattr(servicer, "_step_tasks", None)
    if tasks is None:
        tasks = servicer._step_tasks = set()

        async def end_at_shutdown() -> None:
            await servicer.closing.wait()
            for t in list(tasks):
                t.cancel()

        servicer._step_closer = asyncio.ensure_future(end_at_shutdown())
    return tasks


# --------------------------------------------------------------------------- the worker's side

_END = object()


class StepStream:
    """One open ``Step`` stream of a client; :meth:`call` sends a call and waits for its
    answer. One call at a time (the caller holds a lock). A watchdog thread cancels the
    stream when a call waits longer than ``timeout_s``.

    Args:
        stub: the ``CacheManagerStub``.
        metadata: the call metadata (auth) the stream opens with.
        timeout_s: how long one call may wait for its answer.
    """

    def __init__(self, stub: Any, metadata: Any, timeout_s: float):
        self._requests: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._timeout = float(timeout_s)
        self._since: Optional[float] = None  # when the call in flight was sent
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

    def call(self, method: str, request: Any, request_id: str) -> Optional[Any]:
        """Send ``request`` (a unary request message of ``method``) and return the reply
        message; raise :class:`StepRpcError` when the call failed (in the stream, or past
        its deadline: ``DEADLINE_EXCEEDED``). Returns None when the stream broke otherwise
        (``broken`` is then set; the call may or may not have run: send it again with the
        same request id)."""
        if self.broken:
            return None
        self._since = time.monotonic()
        self._requests.put(pb.StepRequest(method=method, request=request.SerializeToString(),
                                          request_id=request_id))
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
        if resp.WhichOneof("result") == "error":
            raise StepRpcError.from_msg(resp.error)
        return REPLY_TYPES[method].FromString(resp.reply)

    unimplemented = False  # the manager has no Step method (an older one)

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

    Args: as :class:`StepStream`.
    """

    REOPEN_S = 1.0

    def __init__(self, stub: Any, metadata: Any, timeout_s: float):
        self._stub, self._md, self._timeout = stub, metadata, timeout_s
        self._lock = threading.Lock()
        self.stream: Optional[StepStream] = None
        self.enabled = True
        self.reopen_at = 0.0  # monotonic
        self.fallbacks = 0  # calls that found the stream broken (sent again over unary calls)

    def call(self, method: str, request: Any, request_id: str) -> Optional[Any]:
        """The reply of ``method`` over the stream, or None (busy, broken or not served:
        send it as a unary call with the same request id). Raises :class:`StepRpcError`."""
        if not self.enabled or not self._lock.acquire(blocking=False):
            return None
        try:
            s = self.stream
            if s is None:
                if time.monotonic() < self.reopen_at:
                    return None
                s = self.stream = StepStream(self._stub, self._md, self._timeout)
            reply = s.call(method, request, request_id)
            if reply is None:  # broken: this call goes over the unary path
                self.stream = None
                self.fallbacks += 1
                s.close()
                self.enabled = not s.unimplemented
                self.reopen_at = time.monotonic() + self.REOPEN_S
            return reply
        except StepRpcError:
            if s.broken:
                self.stream = None
                s.close()
                self.reopen_at = time.monotonic() + self.REOPEN_S
            raise
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self.enabled = False
            if self.stream is not None:
                self.stream.close()
                self.stream = None
