"""The request id a unary call may carry (metadata ``radixkv-request-id``): the key and its form.

A client sends it so that a retried call gets the first reply again; the manager's reply
cache (:mod:`radixkv.service.server.idempotency`) describes what it guarantees.
"""
from __future__ import annotations

from radixkv.errors import InvalidArgumentError

__all__ = ["REQUEST_ID_KEY", "MAX_REQUEST_ID_LEN", "check_request_id"]

REQUEST_ID_KEY = "radixkv-request-id"
MAX_REQUEST_ID_LEN = 64


def check_request_id(value: object) -> str:
    """A request id: 1..64 printable ASCII characters. Raises ``InvalidArgumentError``."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise InvalidArgumentError("a request id must be printable ASCII") from None
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_REQUEST_ID_LEN \
            or not (value.isascii() and value.isprintable()) or " " in value:  # 0x21..0x7E, no loop
        raise InvalidArgumentError(f"a request id must be 1..{MAX_REQUEST_ID_LEN} printable ASCII characters")
    return value
