"""The manager's side of the ``Step`` stream: each message runs as its unary call would,
through the same entry of the servicer's dispatch table (``CacheManagerServicer.RPCS``).

The stream, its messages and its error form are described in :mod:`radixkv.service.wire.step`;
the worker's side is :mod:`radixkv.service.client.step_lane`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from radixkv.service.server.fair_share import turn_key
from radixkv.service.server.periodic_count import PeriodicCount
from radixkv.service.server.unary_rpc import STREAM_END, parse
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.auth import presented_token
from radixkv.service.wire.errors import RpcStatus, status_of
from radixkv.service.wire.request_id import check_request_id
from radixkv.service.wire.step import STEP_METHODS, error_to_msg

from radixkv.errors import InvalidArgumentError, PermissionDeniedError, RadixKVError

if TYPE_CHECKING:
    from radixkv.service.server.servicer import CacheManagerServicer
    from radixkv.service.server.unary_rpc import RawContext, UnaryRpc

__all__ = ["serve_step_stream", "answer_step", "StepStreams"]

log = logging.getLogger("radixkv.service")


#: The calls a Step message may carry (each runs its entry of ``CacheManagerServicer.RPCS``).
_STEP_METHODS = frozenset(STEP_METHODS)


#: Step methods that need the operator token when the manager has one (the unary calls'
#: check is the interceptor's, ``server/auth.py``; a stream is opened once, so it is checked here).
OPERATOR_STEP_METHODS = frozenset({"Evict"})


async def answer_step(servicer: CacheManagerServicer, raw: bytes, operator: bool = True) -> bytes:
    """Run one StepRequest (the replay riding on it first, then the call, each as its unary
    call would run, in one turn of its session with no await between them) and return the StepResponse bytes.
    ``operator``: whether the stream may make operator calls. (The Step socket,
    :mod:`~radixkv.service.server.step_socket`, runs its frames through this too.)"""
    t0 = time.perf_counter()
    name, code, replayed = "Step", "OK", False
    try:
        step = parse(pb.StepRequest, raw, "Step")
        if step.method not in _STEP_METHODS:
            raise InvalidArgumentError(f"Step: {step.method!r:.80} is not a step method {list(STEP_METHODS)}")
        name = step.method
        if not operator and name in OPERATOR_STEP_METHODS:
            raise PermissionDeniedError(f"/radixkv.v1.CacheManager/{name} needs the operator token")
        rpc = servicer.RPCS[name]
        raw_request = step.request  # each read of a bytes field is a copy: read it once
        request = await servicer.parse_request_async(rpc.request_cls, raw_request, name)
        servicer.quarantine.fence_due()
        rid = check_request_id(step.request_id) if step.request_id else None
        async with servicer.share.turn(turn_key(request)):  # the replay and the call: one turn
            if step.replay:
                failed = _replay(servicer, servicer.RPCS["ApplyDecodes"], step)
                if failed is not None:  # the call does not run: it ends with the replay's error
                    code, out = failed
                    return out
                replayed = True
            reply, delay = await servicer.answer_async(name, rpc.body, request, raw_request, rid)
        if delay:  # fault injection, as on the unary path
            await asyncio.sleep(delay)
        return pb.StepResponse(reply=reply, rides_replay=True, replayed=replayed).SerializeToString()
    except Exception as exc:  # mapped, never leaked as a traceback
        st = status_of(exc)
        code = st.code.name
        if not isinstance(exc, RadixKVError):
            log.exception("internal error in Step/%s", name)
        return _error_bytes(st, replayed)
    finally:
        servicer.metrics.observe(name, code, time.perf_counter() - t0)


def _replay(servicer: CacheManagerServicer, rpc: UnaryRpc, step: pb.StepRequest) -> tuple[str, bytes] | None:
    """Run the ``ApplyDecodes`` riding on ``step`` as its unary call would run (request id
    ``step.replay_request_id``, same reply cache). None when every replayed call applied;
    (status code name, StepResponse bytes) of its error when one failed at call k >= 1
    (answered in its reply). Raises what the call raises (a failure at call 0: nothing changed)."""
    t0 = time.perf_counter()
    code = "OK"
    try:
        raw = step.replay  # read once (a copy each time)
        request = servicer.parse_request(rpc.request_cls, raw, "ApplyDecodes")  # limits first
        rid = check_request_id(step.replay_request_id) if step.replay_request_id else None
        reply, _ = servicer.answer("ApplyDecodes", rpc.body, request, raw, rid)
        got = pb.ApplyDecodesResponse.FromString(reply)
        if not got.HasField("error"):
            return None
        code = _NAMES.get(got.error.code, grpc.StatusCode.UNKNOWN.name)
        return code, pb.StepResponse(error=got.error, rides_replay=True).SerializeToString()
    except Exception as exc:
        code = status_of(exc).code.name
        raise
    finally:
        servicer.metrics.observe("ApplyDecodes", code, time.perf_counter() - t0)


_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def _error_bytes(st: RpcStatus, replayed: bool) -> bytes:
    msg = error_to_msg(st)
    msg.rides_replay, msg.replayed = True, replayed
    return msg.SerializeToString()


async def serve_step_stream(servicer: CacheManagerServicer, request_iterator: AsyncIterator[bytes],
                            context: RawContext) -> None:
    """The ``Step`` handler: answer each message in order until the worker closes the stream,
    the manager starts closing (``servicer.closing``: the stream then ends with OK, and the
    worker falls back to unary calls) or no whole message arrived within the read deadline
    (:class:`StepStreams`: DEADLINE_EXCEEDED; the worker's lane falls back and reopens).

    Neither is a race against every read (that costs ~0.1 ms a message): one watchdog task
    per servicer cancels the streams' tasks. A message costs a clock read and two dict writes."""
    if servicer.closing.is_set():
        return
    token = getattr(servicer, "operator_token", None)
    operator = token is None or token.matches(presented_token(context.invocation_metadata()))
    streams = servicer.step_streams
    streams.start(servicer.closing)
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("the Step handler runs outside a task")
    reading = streams.reading
    try:
        while True:
            reading[task] = time.monotonic()
            raw = await context.read()
            reading[task] = 0.0
            if raw is STREAM_END:
                return
            await context.write(await answer_step(servicer, raw, operator))
    except asyncio.CancelledError:
        if servicer.closing.is_set():
            return  # ended by the shutdown: the stream ends OK
        if task in streams.expired:  # grpc core drops the partial message with the stream
            context.set_code(grpc.StatusCode.DEADLINE_EXCEEDED)
            context.set_details(f"Step: no whole message within {streams.read_deadline_s:.1f} s; open a new stream")
            return
        raise
    finally:
        reading.pop(task, None)
        streams.expired.discard(task)


#: How often the Step streams' watchdog looks for reads past their deadline.
_WATCH_S = 0.1


class StepStreams:
    """The open Step streams of one servicer (task -> when its pending read began, 0: none).

    grpc core takes a message announced within ``grpc.max_receive_message_length`` whole and
    holds its bytes, which Python never sees, until it is complete: a stream whose read waits
    longer than ``read_deadline_s`` (None: no deadline; ``CacheManagerServer`` sets
    ``--handshake-timeout-s`` + ``--max-message-bytes`` at ``MIN_FRAME_RATE``, as for a
    Step-socket frame) is ended, which frees them. An idle worker's stream ends too; its lane
    sends that call as a unary call and reopens. ``read_timeouts`` counts the ends (logged once a
    period). :meth:`start` (once per loop) starts the watchdog, which also ends every stream at
    shutdown. O(streams) per 100 ms."""

    def __init__(self, read_deadline_s: float | None = None):
        self.reading: dict[asyncio.Task[Any], float] = {}
        self.expired: set[asyncio.Task[Any]] = set()
        self.read_deadline_s = read_deadline_s
        self.read_timeouts = 0
        self._log = PeriodicCount(self._log_ended)
        self._watchdog: asyncio.Future[None] | None = None

    def start(self, closing: asyncio.Event) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch(closing))

    async def _watch(self, closing: asyncio.Event) -> None:
        while not closing.is_set():
            if self.read_deadline_s is None:
                await closing.wait()
                break
            try:
                await asyncio.wait_for(closing.wait(), _WATCH_S)
            except asyncio.TimeoutError:
                self.expire(time.monotonic())
        for t in list(self.reading):
            t.cancel()
        self._log.flush()

    def expire(self, now: float) -> int:
        """End (cancel) the streams whose read began more than ``read_deadline_s`` before
        ``now``; returns how many."""
        d = self.read_deadline_s
        if d is None:
            return 0
        late = [t for t, since in self.reading.items() if since and now - since > d and t not in self.expired]
        for t in late:
            self.expired.add(t)
            self.read_timeouts += 1
            self._log.add("read_deadline")
            t.cancel()
        return len(late)

    def _log_ended(self, n: int, last: str) -> None:
        log.info("Step stream: ended %d stream(s) with no whole message within %.1f s (their workers reopen)",
                 n, self.read_deadline_s or 0.0)

