"""One error hierarchy for radixkv.

Every error carries a ``code``: the name of the gRPC status it maps to. The service maps
errors to status codes in exactly one place (``radixkv.service.wire.errors``) by reading this
attribute, so the embedded engine and the remote client raise the same types.

Validation raises these (never ``assert``, which ``python -O`` strips), and every raising
operation leaves the state it was called on unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import SupportsInt


class RadixKVError(Exception):
    """Base of every error radixkv raises on purpose."""

    code = "INTERNAL"


class InvalidArgumentError(RadixKVError, ValueError):
    """Bad input: wrong length, dtype, alignment, shape or value."""

    code = "INVALID_ARGUMENT"


class InvalidIndexError(InvalidArgumentError, IndexError):
    """An index out of range, or the reserved padding slot/row/page 0."""


class DoubleFreeError(InvalidArgumentError):
    """An index freed that is already free (or freed twice in one call)."""


class LengthMismatchError(InvalidArgumentError):
    """Two arrays that must have equal lengths do not."""


class AlignmentError(InvalidArgumentError):
    """A length or index that must be a multiple of the page size is not."""


class CapacityError(RadixKVError):
    """Out of capacity even after eviction (or a request larger than the pool)."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, requested: int | None = None, available: int | None = None):
        super().__init__(message)
        self.requested = requested
        self.available = available


class NotFoundError(RadixKVError, KeyError):
    """An unknown request, session or node."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class PermissionDeniedError(RadixKVError):
    """An operation the caller is not allowed: a wrong session secret, an operator call
    without the operator token, an unsafe file or socket. (Another session's request is a
    ``NotFoundError``: request ids are per session.)"""

    code = "PERMISSION_DENIED"


class StaleSessionError(RadixKVError):
    """A call under an expired session or an old epoch."""

    code = "FAILED_PRECONDITION"


class UnauthenticatedError(RadixKVError):
    """A missing or wrong auth token."""

    code = "UNAUTHENTICATED"


class InvariantError(RadixKVError, AssertionError):
    """``check_invariants()`` found a broken invariant; the message names the exact ids."""

    code = "INTERNAL"


class MissingDependencyError(RadixKVError, ImportError):
    """A feature asked for whose optional package is not installed; the message names the
    extra (``pip install 'radixkv[EXTRA]'``) or system package that provides it."""

    code = "FAILED_PRECONDITION"


def describe_ids(ids: Iterable[SupportsInt], limit: int = 16) -> str:
    """Format a collection of ids for an error message (first ``limit`` of them, sorted)."""
    srt = sorted(int(i) for i in ids)
    head = ", ".join(str(i) for i in srt[:limit])
    more = f", ... ({len(srt)} in all)" if len(srt) > limit else ""
    return f"[{head}{more}]"
