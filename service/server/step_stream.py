"""The manager's side of the ``Step`` stream: each message runs as its unary call would.

The stream, its messages and its error form are described in :mod:`radixkv.service.wire.step`;
the worker's side is :mod:`radixkv.service.client.step_lane`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.errors import status_of
from radixkv.service.wire.request_id import check_request_id
from radixkv.service.wire.step import STEP_METHODS, error_to_msg

from radixkv.errors import InvalidArgumentError, RadixKVError

__all__ = ["serve_step_stream"]

log = logging.getLogger("radixkv.service")


def _bodies(servicer: Any) -> dict[str, tuple[Callable[[Any, Any], Any], Any]]:
    """``{method: (body, request type)}`` of the servicer's unary handlers (cached)."""
    got = getattr(servicer, "_step_bodies", None)
    if got is None:
        cls = type(servicer)
        got = {m: (getattr(cls, m).body, getattr(cls, m).request_cls) for m in STEP_METHODS}
        servicer._step_bodies = got
    return got


async def _one(servicer: Any, raw: bytes) -> bytes:
    """Run one StepRequest (as its unary call would run) and return the StepResponse bytes."""
    from radixkv.service.server.servicer import parse

    t0 = time.perf_counter()
    name, code = "Step", "OK"
    try:
        step = parse(pb.StepRequest, raw, "Step")
        spec = _bodies(servicer).get(step.method)
        if spec is None:
            raise InvalidArgumentError(f"Step: {step.method!r:.80} is not a step method {list(STEP_METHODS)}")
        name = step.method
        body, request_cls = spec
        request = servicer.parse_request(request_cls, step.request, name)
        servicer.quarantine.fence_due()
        rid = check_request_id(step.request_id) if step.request_id else None
        reply, delay = await servicer.answer_async(name, body, request, step.request, rid)
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


def _stream_tasks(servicer: Any) -> set[asyncio.Task[Any]]:
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

