"""The auth token: where it comes from, how it travels, how the server checks it.

* Travels as gRPC metadata ``authorization: Bearer <token>`` on every call.
* The server checks it in :class:`~radixkv.service.server.auth.TokenAuthInterceptor` with ``hmac.compare_digest`` (no
  early exit on the first differing byte); a missing or wrong token ends the call with
  ``UNAUTHENTICATED`` before any handler runs. Only the gRPC health service is exempt.
* Never logged: :class:`Token` hides its value from ``repr``/``str``, and messages about a
  rejected call name the method, not the token.
* Given on the command line (``--token``), from a file (``--token-file``, so it is not in
  ``ps``) or from an environment variable (``RADIXKV_TOKEN`` by default): see
  :func:`resolve_token`.
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from typing import Any

from radixkv.errors import InvalidArgumentError, PermissionDeniedError

METADATA_KEY = "authorization"
SCHEME = "Bearer "
#: Call metadata as the client sends it: (key, value) pairs.
Metadata = tuple[tuple[str, str], ...]
TOKEN_ENV = "RADIXKV_TOKEN"
_MIN_LEN = 8


class Token:
    """A secret string whose ``repr``/``str`` never show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        if not isinstance(value, str) or not value or value != value.strip():
            raise InvalidArgumentError("an auth token must be a non-empty string without surrounding blanks")
        if any(ord(c) < 0x21 or ord(c) > 0x7E for c in value):
            raise InvalidArgumentError("an auth token must be printable ASCII without spaces")
        self._value = value

    def reveal(self) -> str:
        return self._value

    def matches(self, presented: str | None) -> bool:
        """Constant-time comparison with what a caller presented."""
        if presented is None:
            return False
        return hmac.compare_digest(self._value.encode(), presented.encode("utf-8", "replace"))

    def metadata(self) -> Metadata:
        """The call metadata carrying this token."""
        return ((METADATA_KEY, SCHEME + self._value),)

    def __repr__(self) -> str:
        return "Token(<hidden>)"

    __str__ = __repr__


def resolve_token(token: str | None = None, token_file: str | None = None,
                  env_var: str = TOKEN_ENV, *, allow_readable: bool = True) -> Token:
    """The token from (first match) ``token``, the file ``token_file`` (stripped), or ``env_var``.
    ``allow_readable=False`` (the manager's default): a token file that group or others may
    read is refused.

    Raises:
        InvalidArgumentError: none given, the file is unreadable/empty, or the token is too
            short (< 8 characters) or not printable ASCII.
        PermissionDeniedError: the file is readable by group or others and ``allow_readable``
            is False.
    """
    if token_file:
        try:
            with open(token_file, encoding="utf-8") as f:
                mode = os.fstat(f.fileno()).st_mode
                token = f.read().strip()
        except OSError as e:
            raise InvalidArgumentError(f"cannot read the token file {token_file!r}: {e.strerror}") from None
        if not allow_readable and mode & 0o044:
            raise PermissionDeniedError(
                f"the token file {token_file!r} is readable by others (mode {oct(mode & 0o777)}): "
                f"chmod 600 it, or pass --allow-readable-token-file")
    elif token is None:
        token = os.environ.get(env_var)
    if not token:
        raise InvalidArgumentError(
            f"an auth token is required: --token, --token-file or the {env_var} environment variable")
    if len(token) < _MIN_LEN:
        raise InvalidArgumentError(f"an auth token must have at least {_MIN_LEN} characters")
    return Token(token)


def presented_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token a call presented in its metadata, or None."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            if isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            if isinstance(value, str) and value.startswith(SCHEME):
                return value[len(SCHEME):]
            return None
    return None
