"""How one unary RPC of the cache manager runs, around its handler body.

Split out of :mod:`radixkv.service.server.servicer`. The handlers are registered with
raw-bytes (de)serializers, so every call goes through :func:`unary_rpc`'s wrapper:

1. count the request's entries and tokens on its raw bytes against the servicer's limits,
   then parse them (``servicer.parse_request``, :func:`parse`: bytes that are not a valid message -- garbage,
   truncated, invalid UTF-8 in a string -- are ``InvalidArgumentError``, answered
   INVALID_ARGUMENT, never INTERNAL);
2. fence the sessions whose lease ran out while their worker may still run
   (``servicer.quarantine.fence_due()``);
3. run the body through ``servicer.answer_async`` (a large ``Match`` in slices that yield
   to the loop; the reply cache of a call carrying
   ``radixkv-request-id`` metadata, :func:`request_id_of`; the event pump after the call);
4. map any exception to its status (:func:`radixkv.service.wire.errors.status_of`; a non-radixkv
   exception is logged with its traceback and answered INTERNAL) and time the call into
   ``servicer.metrics`` labelled with its status code.

Every function here is O(request size).
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message
from radixkv.service.wire.errors import status_of
from radixkv.service.wire.request_id import REQUEST_ID_KEY, check_request_id

from radixkv.errors import InvalidArgumentError, RadixKVError

if TYPE_CHECKING:
    from radixkv.service.server.servicer import CacheManagerServicer

__all__ = ["STREAM_END", "Body", "RawContext", "parse", "request_id_of", "unary_rpc"]

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


def unary_rpc(name: str, request_cls: type[Message],
              idempotent: bool = True) -> Callable[[Body], Callable[..., Awaitable[bytes]]]:
    """Wrap a synchronous ``body(servicer, request) -> response message`` as a unary aio
    handler over raw bytes (the steps of the module docstring). ``idempotent=False``:
    the request id is ignored (nothing kept). The handler carries ``request_cls`` and
    ``body`` (the ``Step`` stream runs the same body, :mod:`radixkv.service.server.step_stream`)."""

    def deco(body: Body) -> Callable[..., Awaitable[bytes]]:
        @functools.wraps(body)
        async def handler(self: CacheManagerServicer, raw: bytes, context: RawContext) -> bytes:
            t0 = time.perf_counter()
            code = "OK"
            try:
                request = self.parse_request(request_cls, raw, name)
                self.quarantine.fence_due()
                rid = request_id_of(context) if idempotent else None
                reply, delay = await self.answer_async(name, body, request, raw, rid)
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
                self.metrics.observe(name, code, time.perf_counter() - t0)

        handler.request_cls = request_cls  # type: ignore[attr-defined]
        handler.body = body  # type: ignore[attr-defined]
        return handler

    return deco
