"""What both ends of a connection agree on: the message size limit, the ``unix:`` address
form, and how a PEM file (certificate, key, CA) is read.

The manager binds (:mod:`radixkv.service.server.listen`), the worker dials
(:mod:`radixkv.service.client.channel`); both use these.
"""
from __future__ import annotations

from radixkv.errors import InvalidArgumentError

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "unix_socket_path", "read_file"]

#: The largest gRPC message either side sends or accepts unless configured otherwise.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


def unix_socket_path(address: str) -> str | None:
    """The file path of a ``unix:`` address (``unix:///abs``, ``unix:/abs``, ``unix:rel``), or None."""
    if address.startswith("unix://"):
        return address[len("unix://"):]
    if address.startswith("unix:"):
        return address[len("unix:"):]
    return None


def read_file(path: str) -> bytes:
    """The bytes of a PEM file (certificate, key, CA). Raises ``InvalidArgumentError``."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {path!r}: {e.strerror}") from None
