"""THE one place radixkv errors map to gRPC status codes, and back.

Server side, :func:`status_of` gives ``(StatusCode, details, trailing metadata)``: the
exception's ``code``, its exact type (``radixkv-error-type``) and, for a
:class:`~radixkv.errors.CapacityError`, ``radixkv-requested`` / ``radixkv-available``;
anything not a ``RadixKVError`` is ``INTERNAL``. Client side, :func:`error_from_rpc`
rebuilds the named type when it is one of :mod:`radixkv.errors` (or this module) and its code
matches, else the status's base type: the remote client raises what the embedded engine
raises. Transport failures: :class:`MessageTooLargeError` (a ``CapacityError``) and
:class:`ServiceUnavailableError`.
"""
from __future__ import annotations

import re
from typing import Any, NamedTuple

import grpc

from radixkv import errors as E

ERROR_TYPE_KEY = "radixkv-error-type"
REQUESTED_KEY = "radixkv-requested"
AVAILABLE_KEY = "radixkv-available"


class MessageTooLargeError(E.CapacityError):
    """A gRPC message over the configured maximum size (``requested``/``available`` in
    bytes when the transport said them)."""


class RequestLimitError(E.CapacityError):
    """A call with more entries or tokens than the manager's per-call limits allow (checked
    before the request is decoded; the message names the limit, ``requested``/``available``
    say by how much)."""


class SessionSecretError(E.PermissionDeniedError):
    """A call naming a live session without that session's secret (the one its ``Attach``
    returned): the session id alone is no credential. Nothing was done for it."""


class ServiceUnavailableError(E.RadixKVError):
    """The manager cannot be reached (down, restarting, or the call timed out)."""

    code = "UNAVAILABLE"


def _all_error_types() -> dict[str, type[E.RadixKVError]]:
    found: dict[str, type[E.RadixKVError]] = {}
    for mod_types in (vars(E).values(), (MessageTooLargeError, RequestLimitError, SessionSecretError,
                                           ServiceUnavailableError)):
        for t in mod_types:
            if isinstance(t, type) and issubclass(t, E.RadixKVError):
                found[t.__name__] = t
    return found


#: Error types the client may rebuild by name (no other name is ever looked up).
KNOWN_ERRORS: dict[str, type[E.RadixKVError]] = _all_error_types()

#: The type a status code means when the server named none (or an unknown one).
BASE_BY_CODE: dict[grpc.StatusCode, type[E.RadixKVError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: E.InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: E.InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: E.CapacityError,
    grpc.StatusCode.FAILED_PRECONDITION: E.StaleSessionError,
    grpc.StatusCode.NOT_FOUND: E.NotFoundError,
    grpc.StatusCode.PERMISSION_DENIED: E.PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: E.UnauthenticatedError,
    grpc.StatusCode.UNAVAILABLE: ServiceUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: ServiceUnavailableError,
    # The client never cancels its own unary calls, so a CANCELLED status comes from the
    # server: a manager shutting down cancels the calls still in flight after its grace.
    grpc.StatusCode.CANCELLED: ServiceUnavailableError,
}


class RpcStatus(NamedTuple):
    """What the server aborts a call with."""

    code: grpc.StatusCode
    details: str
    trailing_metadata: tuple[tuple[str, str], ...]


def status_code_of(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status for ``exc``: ``StatusCode[exc.code]`` for radixkv errors, else INTERNAL."""
    if isinstance(exc, E.RadixKVError):
        code = getattr(grpc.StatusCode, str(type(exc).code), None)
        if isinstance(code, grpc.StatusCode):
            return code
    return grpc.StatusCode.INTERNAL


def status_of(exc: BaseException) -> RpcStatus:
    """Map a server-side exception to the status the call ends with. O(1)."""
    code = status_code_of(exc)
    if isinstance(exc, E.RadixKVError):
        details = str(exc) or type(exc).__name__
        meta: list[tuple[str, str]] = [(ERROR_TYPE_KEY, type(exc).__name__)]
        if isinstance(exc, E.CapacityError):
            if exc.requested is not None:
                meta.append((REQUESTED_KEY, str(int(exc.requested))))
            if exc.available is not None:
                meta.append((AVAILABLE_KEY, str(int(exc.available))))
    else:  # a bug in the manager: say what, never how (no traceback on the wire)
        details = f"internal error: {type(exc).__name__}: {exc}"
        meta = [(ERROR_TYPE_KEY, "RadixKVError")]
    return RpcStatus(code, details, tuple(meta))


_SIZE_RE = re.compile(r"larger than max \((\d+) vs\. (\d+)\)")


def _meta_dict(rpc_error: grpc.RpcError) -> dict[str, str]:
    try:
        # (key, value) pairs; the stubs type grpc's pair class as attributes only
        md: Any = rpc_error.trailing_metadata() or ()
    except Exception:  # some RpcErrors (channel-level) carry none
        md = ()
    return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in md}


def _int_or_none(s: str | None) -> int | None:
    try:
        return int(s) if s is not None else None
    except ValueError:
        return None


def error_from_rpc(rpc_error: grpc.RpcError) -> E.RadixKVError:
    """The radixkv error a failed call stands for (see the module doc). O(1)."""
    try:
        code = rpc_error.code()
        details = rpc_error.details() or ""
    except Exception:
        code, details = grpc.StatusCode.UNKNOWN, str(rpc_error)
    meta = _meta_dict(rpc_error)
    cls = KNOWN_ERRORS.get(meta.get(ERROR_TYPE_KEY, ""))
    if cls is not None and getattr(grpc.StatusCode, cls.code, None) != code:
        cls = None  # the name and the status disagree: trust the status
    if cls is None and code == grpc.StatusCode.RESOURCE_EXHAUSTED and _SIZE_RE.search(details):
        cls = MessageTooLargeError
    if cls is None:
        cls = BASE_BY_CODE.get(code, E.RadixKVError)
    message = details or code.name
    if issubclass(cls, E.CapacityError):
        requested = _int_or_none(meta.get(REQUESTED_KEY))
        available = _int_or_none(meta.get(AVAILABLE_KEY))
        m = _SIZE_RE.search(details)
        if m and requested is None and available is None:
            requested, available = int(m.group(1)), int(m.group(2))
        return cls(message, requested=requested, available=available)
    if cls is E.RadixKVError and code != grpc.StatusCode.INTERNAL:
        message = f"{code.name}: {message}"
    return cls(message)
