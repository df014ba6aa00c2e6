"""The client's gRPC channel to a cache manager: Unix socket or TCP, optional TLS, message
size limits, quick reconnects to a manager that is still starting, and a bounded wait for it
to answer. Split out of :mod:`radixkv.service.client` (the protocol calls).

A Unix socket is checked before the token is ever sent (:func:`check_socket_directory`,
:func:`check_socket_peer`): the client trusts only a socket in a directory of its own user
with mode 0700, under no world-writable directory without the sticky bit, whose listening
process runs as the manager's uid (``SO_PEERCRED``; default: this user). A fake manager on a
socket in a shared directory gets neither the token nor a chance to name files to map.
"""
from __future__ import annotations

import os
import socket
import stat
import struct

import grpc
from radixkv.service.wire.errors import ServiceUnavailableError
from radixkv.service.wire.transport import DEFAULT_MAX_MESSAGE_BYTES, read_file, unix_socket_path

from radixkv.errors import PermissionDeniedError

__all__ = ["check_socket_directory", "check_socket_peer", "open_channel"]


def check_socket_directory(path: str) -> None:
    """Raise ``PermissionDeniedError`` unless the directory of the socket ``path`` is this
    user's with mode 0700 and every directory above it that others may write has the sticky
    bit. A directory that does not exist (yet) is not checked here (nothing listens in it)."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(d)
    except FileNotFoundError:
        return
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionDeniedError(
            f"the socket directory {d!r} must be this user's (uid {os.getuid()}) with mode 0700 "
            f"(uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}): its socket could be anyone's")
    while True:
        parent = os.path.dirname(d)
        if parent == d:
            return
        d = parent
        mode = os.stat(d).st_mode
        if mode & 0o002 and not mode & stat.S_ISVTX:
            raise PermissionDeniedError(f"{d!r}, above the socket directory, is world-writable without "
                                        "the sticky bit: anyone could replace the socket directory")


def check_socket_peer(path: str, manager_uid: int | None = None) -> int:
    """The pid of the process listening on the Unix socket ``path``; raises
    ``PermissionDeniedError`` when it runs as another uid than ``manager_uid`` (default this
    user's), ``ServiceUnavailableError`` when nothing listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sk:
        try:
            sk.connect(path)
        except OSError as e:
            raise ServiceUnavailableError(f"no cache manager listens on {path!r}: {e.strerror}") from None
        pid, uid, _ = struct.unpack("3i", sk.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    want = os.getuid() if manager_uid is None else int(manager_uid)
    if uid != want:
        raise PermissionDeniedError(f"the process listening on {path!r} (pid {pid}) runs as uid {uid}, "
                                    f"not the manager's uid {want}")
    return int(pid)


def open_channel(address: str, *, wait_s: float = 10.0, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 manager_uid: int | None = None) -> grpc.Channel:
    """A channel to ``address`` (``unix:///dir/s.sock`` or ``host:port``), TLS with
    ``tls_ca`` (``tls_cert``/``tls_key`` for a client certificate), ready within ``wait_s``
    (0: do not wait). A Unix socket's directory is checked first and, once it answers (at
    once with ``wait_s`` 0 when the socket is there), its peer (module doc). Raises
    ``InvalidArgumentError`` (unreadable TLS file), ``PermissionDeniedError`` (a socket that
    could be anyone's) or ``ServiceUnavailableError`` (nothing answers within ``wait_s``)."""
    n = int(max_message_bytes)
    options: list[tuple[str, int | str]] = [("grpc.max_receive_message_length", n), ("grpc.max_send_message_length", n),
               ("grpc.enable_retries", 0),
               # a local manager that is still starting: retry connecting quickly
               ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    path = unix_socket_path(address)
    if path is not None:
        check_socket_directory(path)
    target = f"unix:{path}" if path is not None else address
    if tls_ca:
        creds = grpc.ssl_channel_credentials(read_file(tls_ca), read_file(tls_key) if tls_key else None,
                                             read_file(tls_cert) if tls_cert else None)
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    if wait_s and wait_s > 0:
        try:
            grpc.channel_ready_future(channel).result(timeout=wait_s)
        except grpc.FutureTimeoutError:
            channel.close()
            raise ServiceUnavailableError(f"no cache manager answers at {address!r} within {wait_s} s") from None
    waited = bool(wait_s and wait_s > 0)
    if path is not None and (waited or os.path.exists(path)):
        try:
            check_socket_peer(path, manager_uid)
        except ServiceUnavailableError:
            if waited:  # it answered a moment ago: a restart; else not started yet (wait_s 0)
                channel.close()
                raise
        except BaseException:
            channel.close()
            raise
    return channel
