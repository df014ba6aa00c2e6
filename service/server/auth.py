"""The manager's token check: a gRPC interceptor that ends a call without the right token
``UNAUTHENTICATED`` before any handler runs (the token itself: :mod:`radixkv.service.wire.auth`).

With an operator token (``--operator-token-file``), the operator calls (:data:`OPERATOR_METHODS`:
``Flush`` empties the tree every worker shares, ``CheckInvariants`` walks every structure)
need it: a worker's token gets ``PERMISSION_DENIED`` for them. The operator token is accepted
for every other call too. Without one, the worker token may make them (the manager warns at
start-up).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from radixkv.service.wire.auth import Token, presented_token

__all__ = ["HEALTH_PREFIX", "OPERATOR_METHODS", "TokenAuthInterceptor"]

#: The gRPC health service's methods: the only calls that need no token.
HEALTH_PREFIX = "/grpc.health.v1.Health/"
#: The calls that need the operator token when the manager has one.
OPERATOR_METHODS = frozenset(f"/radixkv.v1.CacheManager/{m}" for m in ("Flush", "CheckInvariants"))


def _rejecting_handler(handler: grpc.RpcMethodHandler, method: str,
                       code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with ``code``
    (UNAUTHENTICATED: no or a wrong token; PERMISSION_DENIED: an operator call without the
    operator token)."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        message, kind = f"missing or wrong auth token for {method}", "UnauthenticatedError"
    else:
        message, kind = f"{method} needs the operator token", "PermissionDeniedError"
    trailing = (("radixkv-error-type", kind),)

    async def reject_unary(request_or_iterator, context):
        await context.abort(code, message, trailing_metadata=trailing)

    async def reject_stream(request_or_iterator, context):
        await context.abort(code, message, trailing_metadata=trailing)
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
    sees the token). ``operator_token``: see the module doc.
    """

    def __init__(self, token: Token, on_reject: Callable[[str], None] | None = None,
                 operator_token: Token | None = None):
        self._token = token
        self._on_reject = on_reject
        self._operator = operator_token

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        presented = presented_token(handler_call_details.invocation_metadata)
        if self._operator is not None and self._operator.matches(presented):
            return handler
        if self._token.matches(presented):
            if self._operator is not None and method in OPERATOR_METHODS:
                return _rejecting_handler(handler, method, grpc.StatusCode.PERMISSION_DENIED)
            return handler
        if self._on_reject is not None:
            self._on_reject(method)
        return _rejecting_handler(handler, method)
