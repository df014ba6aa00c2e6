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

__all__ = ["serve_step_stream", "answer_step"]

log = logging.getLogger("radixkv.service")


#: The calls a Step message may carry (each runs its entry of ``CacheManagerServicer.RPCS``).
_STEP_METHODS = frozenset(STEP_METHODS)


#: Step methods that need the operator token when the manager has one (the unary calls'
#: check is the interceptor's, ``server/auth.py``; a stream is opened once, so it is checked here).
OPERATOR_STEP_METHODS = frozenset({"Evict"})


async def answer_step(servicer: CacheManagerServicer, raw: bytes, operator: bool = True) -> bytes:
    """Run one StepRequest (the replay riding on it first, then the call, each as its unary
    call would run, with no await between them) and return the StepResponse bytes.
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
        request = servicer.parse_request(rpc.request_cls, raw_request, name)
        servicer.quarantine.fence_due()
        rid = check_request_id(step.request_id) if step.request_id else None
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
    """The ``Step`` handler: answer each message in order until the worker closes the stream
    or the manager starts closing (``servicer.closing``: the stream then ends with OK, and the
    worker falls back to unary calls).

    Shutdown does not race every read against ``closing`` (that costs ~0.1 ms a message):
    one task per servicer waits for ``closing`` and cancels the open streams' tasks."""
    if servicer.closing.is_set():
        return
    token = getattr(servicer, "operator_token", None)
    operator = token is None or token.matches(presented_token(context.invocation_metadata()))
    tasks = _stream_tasks(servicer)
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("the Step handler runs outside a task")
    tasks.add(task)
    try:
        while True:
            raw = await context.read()
            if raw is STREAM_END:
                return
            await context.write(await answer_step(servicer, raw, operator))
    except asyncio.CancelledError:
        if servicer.closing.is_set():
            return  # ended by the shutdown: the stream ends OK
        raise
    finally:
        tasks.discard(task)


def _stream_tasks(servicer: CacheManagerServicer) -> set[asyncio.Task[Any]]:
    """The servicer's open Step streams (and, once, the task that ends them at shutdown)."""
    tasks = servicer.step_tasks
    if servicer.step_closer is None:

        async def end_at_shutdown() -> None:
            await servicer.closing.wait()
            for t in list(tasks):
                t.cancel()

        servicer.step_closer = asyncio.ensure_future(end_at_shutdown())
    return tasks

