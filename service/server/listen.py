"""Where the cache manager listens: Unix-socket and TCP addresses, socket-directory safety,
TLS credentials.

A Unix socket by default (:func:`default_address`: ``$XDG_RUNTIME_DIR/radixkv-manager/manager.sock``,
else ``<temp dir>/radixkv-manager-<uid>/manager.sock``; the directory name is no importable
package name, so a process started in the temp directory never imports it as ``radixkv``).
The directory is created 0700 when missing, and refused when it is not ours or allows
group/other access; a stale socket file (nobody listening) is replaced, a live one refused.
TCP (``host:port``) on request: with TLS (``tls_cert``/``tls_key``, and ``tls_ca`` to require
client certificates), or without it on loopback only unless ``allow_insecure_tcp``.

Pure host-side helpers; :class:`~radixkv.service.server.manager.CacheManagerServer` calls
:func:`bind` once at start-up.
"""
from __future__ import annotations

import os
import socket
import stat
import tempfile
from typing import TYPE_CHECKING, NamedTuple

import grpc
from radixkv.service.wire.transport import read_file, unix_socket_path

from radixkv.errors import InvalidArgumentError, PermissionDeniedError

if TYPE_CHECKING:
    from radixkv.service.server.manager import ServeOptions

__all__ = ["LOOPBACK", "Bound", "default_socket_dir", "default_address", "prepare_unix_socket", "bind"]

#: Hosts a plaintext TCP listener may bind without ``allow_insecure_tcp``.
LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


def default_socket_dir() -> str:
    """This user's directory for the manager's socket: ``$XDG_RUNTIME_DIR/radixkv-manager``
    when that runtime directory exists (per user, 0700, cleared at logout), else
    ``<temp dir>/radixkv-manager-<uid>``. Neither name is a valid Python identifier."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return os.path.join(runtime, "radixkv-manager")
    return os.path.join(tempfile.gettempdir(), f"radixkv-manager-{os.getuid()}")


def default_address() -> str:
    """``unix://`` + :func:`default_socket_dir` + ``/manager.sock``."""
    return f"unix://{default_socket_dir()}/manager.sock"


class Bound(NamedTuple):
    """What :func:`bind` bound: the address clients use, and the socket file (Unix) or None."""

    address: str
    socket_path: str | None


def prepare_unix_socket(path: str) -> str:
    """Make ``path``'s directory safe for the socket and clear a stale socket file.

    Returns the absolute path. Raises ``PermissionDeniedError`` (the directory is not ours,
    or group/other may enter it) or ``InvalidArgumentError`` (a live server already listens
    there, or something else than a socket is in the way).
    """
    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
    st = os.stat(directory)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionDeniedError(
            f"socket directory {directory!r} must be owned by this user with mode 0700, has "
            f"uid {st.st_uid} mode {oct(st.st_mode & 0o777)}")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise InvalidArgumentError(f"{path!r} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: nobody listens
        else:
            raise InvalidArgumentError(f"a server already listens on {path!r}")
        finally:
            probe.close()
    return path


def bind(server: grpc.aio.Server, options: ServeOptions) -> Bound:
    """Add the listening port of ``options`` (a ``ServeOptions``: ``address``, ``tls_*``,
    ``allow_insecure_tcp``) to the ``grpc.aio`` ``server`` (not started yet).

    Raises ``PermissionDeniedError`` / ``InvalidArgumentError`` (unsafe socket directory, a
    live socket, an unparsable address, half a TLS pair, plaintext TCP off loopback, a port
    that cannot be bound)."""
    o = options
    path = unix_socket_path(o.address)
    if path is not None:
        path = prepare_unix_socket(path)
        server.add_insecure_port(f"unix:{path}")
        return Bound(f"unix://{path}", path)
    address = o.address[len("tcp://"):] if o.address.startswith("tcp://") else o.address
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgumentError(f"address {o.address!r} is neither unix:PATH nor HOST:PORT")
    if o.tls_cert or o.tls_key:
        if not (o.tls_cert and o.tls_key):
            raise InvalidArgumentError("TLS needs both --tls-cert and --tls-key")
        creds = grpc.ssl_server_credentials(
            [(read_file(o.tls_key), read_file(o.tls_cert))],
            root_certificates=read_file(o.tls_ca) if o.tls_ca else None,
            require_client_auth=bool(o.tls_ca))
        bound = server.add_secure_port(address, creds)
    else:
        if host not in LOOPBACK and not o.allow_insecure_tcp:
            raise InvalidArgumentError(
                f"refusing plaintext TCP on {host!r}: give --tls-cert/--tls-key, bind a loopback "
                "address, or pass --allow-insecure-tcp")
        bound = server.add_insecure_port(address)
    if not bound:
        raise InvalidArgumentError(f"cannot bind {address!r}")
    return Bound(f"{host}:{bound}", None)
