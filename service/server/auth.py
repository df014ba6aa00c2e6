"""The manager's token check: a gRPC interceptor that ends a call without the right token
``UNAUTHENTICATED`` before any handler runs (the token itself: :mod:`radixkv.service.wire.auth`).

Budgets: token-bearing calls count against ``call_budget`` (``--max-concurrent-rpcs``),
token-free ones (health) against ``health_budget``; one more is RESOURCE_EXHAUSTED at once.
gRPC's own limit is their sum, so unauthenticated streams never take a worker's slot. With
an operator token, :data:`OPERATOR_METHODS` (``Flush``, ``Evict``, ``CheckInvariants``)
need it (a worker's token: PERMISSION_DENIED); it is accepted for every other call. Without
one, the worker token may make them (the manager warns). Details: ``docs/service.md``,
"Token check and call budgets".
"""
from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from radixkv.service.wire.auth import Token, presented_token

__all__ = ["DEFAULT_HEALTH_BUDGET", "HEALTH_PREFIX", "OPERATOR_METHODS", "CallBudget", "TokenAuthInterceptor"]

#: Health calls (no token needed) in flight at once, by default.
DEFAULT_HEALTH_BUDGET = 8

#: The gRPC health service's methods: the only calls that need no token.
HEALTH_PREFIX = "/grpc.health.v1.Health/"
#: The calls that need the operator token when the manager has one.
OPERATOR_METHODS = frozenset(f"/radixkv.v1.CacheManager/{m}" for m in ("Flush", "Evict", "CheckInvariants"))


def _rejecting_handler(handler: grpc.RpcMethodHandler[Any, Any], method: str,
                       code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as ``handler`` that ends the call with ``code``
    (UNAUTHENTICATED: no or a wrong token; PERMISSION_DENIED: an operator call without the
    operator token)."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        message, kind = f"missing or wrong auth token for {method}", "UnauthenticatedError"
    else:
        message, kind = f"{method} needs the operator token", "PermissionDeniedError"
    trailing = (("radixkv-error-type", kind),)

    async def reject_unary(request_or_iterator: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, message, trailing_metadata=trailing)

    async def reject_stream(request_or_iterator: object,
                            context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[None]:
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


class CallBudget:
    """Calls of one kind in flight, at most ``limit``: one more is answered
    RESOURCE_EXHAUSTED at once (never queued)."""

    def __init__(self, limit: int, what: str):
        self.limit, self.what, self.in_flight, self.refused = int(limit), what, 0, 0

    async def _enter(self, context: grpc.aio.ServicerContext[Any, Any], method: str) -> None:
        if self.in_flight >= self.limit:
            self.refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{method}: more than {self.limit} {self.what} in flight",
                                trailing_metadata=(("radixkv-error-type", "CapacityError"),))
        self.in_flight += 1

    def _counted(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        budget = self
        if inspect.isasyncgenfunction(behavior):
            async def gen(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                await budget._enter(context, method)
                try:
                    async for item in behavior(request, context):
                        yield item
                finally:
                    budget.in_flight -= 1
            return gen

        async def coro(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            await budget._enter(context, method)
            try:
                return await behavior(request, context)
            finally:
                budget.in_flight -= 1
        return coro

    def wrap(self, handler: grpc.RpcMethodHandler[Any, Any], method: str) -> grpc.RpcMethodHandler[Any, Any]:
        """``handler`` (any of the four kinds; coroutine or async-generator behaviour)
        counted against this budget."""
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        for kind, make in (("unary_unary", grpc.unary_unary_rpc_method_handler),
                           ("unary_stream", grpc.unary_stream_rpc_method_handler),
                           ("stream_unary", grpc.stream_unary_rpc_method_handler),
                           ("stream_stream", grpc.stream_stream_rpc_method_handler)):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(self._counted(behavior, method), **kw)
        return handler  # pragma: no cover - a handler of no kind


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call without the right token, except the health service's.

    ``on_reject(method)`` (optional) is told of each rejection (for metrics/logs; it never
    sees the token). ``operator_token``: see the module doc.
    """

    def __init__(self, token: Token, on_reject: Callable[[str], None] | None = None,
                 operator_token: Token | None = None, health_budget: int = DEFAULT_HEALTH_BUDGET,
                 call_budget: int | None = None):
        self._token = token
        self.health = CallBudget(health_budget, "unauthenticated (health) calls")
        self.calls = CallBudget(call_budget, "calls") if call_budget is not None else None
        self._on_reject = on_reject
        self._operator = operator_token

    def _counted(self, handler: grpc.RpcMethodHandler[Any, Any], method: str) -> grpc.RpcMethodHandler[Any, Any]:
        return self.calls.wrap(handler, method) if self.calls is not None else handler

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method or ""
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        if method.startswith(HEALTH_PREFIX):
            return self.health.wrap(handler, method)
        presented = presented_token(handler_call_details.invocation_metadata)
        if self._operator is not None and self._operator.matches(presented):
            return self._counted(handler, method)
        if self._token.matches(presented):
            if self._operator is not None and method in OPERATOR_METHODS:
                return _rejecting_handler(handler, method, grpc.StatusCode.PERMISSION_DENIED)
            return self._counted(handler, method)
        if self._on_reject is not None:
            self._on_reject(method)
        return _rejecting_handler(handler, method)
