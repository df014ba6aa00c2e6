"""The manager's token check: a gRPC interceptor that ends a call without the right token
``UNAUTHENTICATED`` before any handler runs (the token itself: :mod:`radixkv.service.wire.auth`).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from radixkv.service.wire.auth import Token, presented_token

__all__ = ["HEALTH_PREFIX", "TokenAuthInterceptor"]

#: The gRPC health service's methods: the only calls that need no token.
HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _rejecting_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call UNAUTHENTICATED."""
    message = f"missing or wrong auth token for {method}"

    async def reject_unary(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message,
                            trailing_metadata=(("radixkv-error-type", "UnauthenticatedError"),))

    async def reject_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message,
                            trailing_metadata=(("radixkv-error-type", "UnauthenticatedError"),))
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer,
              response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(reject_unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(reject_stream, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(reject_unary, **kw)
    return grpc.stream_stream_rpc_method_handler(reject_stream, **kw)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call without the right token, except the health service's.

    ``on_reject(method)`` (optional) is told of each rejection (for metrics/logs; it never
    sees the token).
    """

    def __init__(self, token: Token, on_reject: Callable[[str], None] | None = None):
        self._token = token
        self._on_reject = on_reject

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        if self._token.matches(presented_token(handler_call_details.invocation_metadata)):
            return handler
        if self._on_reject is not None:
            self._on_reject(method)
        return _rejecting_handler(handler, method)
