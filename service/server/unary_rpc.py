"""How one unary RPC of the cache manager runs, around its handler body.

The servicer's dispatch table (``CacheManagerServicer.RPCS``: method -> :class:`UnaryRpc`)
names each call's body; every unary call goes through :func:`unary_handler`: count and parse
the raw request (:func:`parse`: bytes that are not a valid message are
``InvalidArgumentError``, answered INVALID_ARGUMENT, never INTERNAL), fence the sessions
whose lease ran out, run the body in its session's turn (``servicer.share``,
:mod:`~radixkv.service.server.fair_share`) through ``servicer.answer_async`` (reply cache of a call
with ``radixkv-request-id``, :func:`request_id_of`; the event pump after it), map any
exception to its status (:func:`radixkv.service.wire.errors.status_of`; a non-radixkv one
is logged and answered INTERNAL) and time the call into ``servicer.metrics``.

Every function here is O(request size). The steps in full: ``docs/service.md``, "One unary
call, start to end".
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message
from radixkv.service.server.fair_share import turn_key
from radixkv.service.wire.errors import status_of
from radixkv.service.wire.request_id import REQUEST_ID_KEY, check_request_id

from radixkv.errors import InvalidArgumentError, RadixKVError

if TYPE_CHECKING:
    from radixkv.service.server.servicer import CacheManagerServicer

__all__ = ["STREAM_END", "Body", "RawContext", "UnaryRpc", "parse", "request_id_of", "unary_handler"]

log = logging.getLogger("radixkv.service")


M = TypeVar("M", bound=Message)

#: What a raw-bytes handler gets as context: requests and replies are bytes (the handlers
#: parse and serialize themselves).
RawContext: TypeAlias = grpc.aio.ServicerContext[bytes, bytes]
#: What a stream's ``context.read()`` returns at the end (typeshed's ``read()`` leaves it out,
#: hence ``object``: a read's bytes are compared with it by identity).
STREAM_END: object = grpc.aio.EOF
#: A handler body: ``body(servicer, parsed request) -> reply message``.
Body: TypeAlias = Callable[[Any, Any], Message]


def parse(cls: type[M], raw: object, method: str) -> M:
    """``raw`` bytes as a ``cls`` message. Raises ``InvalidArgumentError`` when they are not one."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"{method}: expected serialized bytes")
    try:
        return cls.FromString(bytes(raw))
    except Exception as e:  # DecodeError, invalid UTF-8, recursion limit ...
        raise InvalidArgumentError(f"{method}: the request is not a valid {cls.DESCRIPTOR.name} "
                                   f"({type(e).__name__})") from None


def request_id_of(context: RawContext) -> str | None:
    """The ``radixkv-request-id`` of a call, checked, or None."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return check_request_id(value)
    return None


@dataclass(frozen=True)
class UnaryRpc:
    """One entry of the servicer's dispatch table (``CacheManagerServicer.RPCS``): a call's
    ``body(servicer, parsed request) -> reply``, its request type, and whether a request id
    makes it idempotent (``False``: the id is ignored, nothing kept)."""

    body: Body
    request_cls: type[Message]
    idempotent: bool = True


def unary_handler(servicer: CacheManagerServicer, name: str, rpc: UnaryRpc) -> Callable[[bytes, RawContext],
                                                                                       Awaitable[bytes]]:
    """The aio handler over raw bytes of the unary call ``name`` (the steps of the module
    docstring); the ``Step`` paths run the same ``rpc`` (:mod:`radixkv.service.server.step_stream`)."""
    body, request_cls, idempotent = rpc.body, rpc.request_cls, rpc.idempotent

    async def handler(raw: bytes, context: RawContext) -> bytes:
        t0 = time.perf_counter()
        code = "OK"
        try:
            request = await servicer.parse_request_async(request_cls, raw, name)
            servicer.quarantine.fence_due()
            rid = request_id_of(context) if idempotent else None
            async with servicer.share.turn(turn_key(request)):
                reply, delay = await servicer.answer_async(name, body, request, raw, rid)
            if delay:  # fault injection: the reply is late (the client may time out)
                await asyncio.sleep(delay)
            return reply
        except Exception as exc:  # mapped, never leaked as a traceback
            st = status_of(exc)
            code = st.code.name
            if not isinstance(exc, RadixKVError):
                log.exception("internal error in %s", name)
            await context.abort(st.code, st.details, st.trailing_metadata)
        finally:
            servicer.metrics.observe(name, code, time.perf_counter() - t0)

    handler.__name__ = handler.__qualname__ = name
    return handler
