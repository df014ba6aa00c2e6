"""The client's gRPC channel to a cache manager: Unix socket or TCP, optional TLS, message
size limits, quick reconnects to a manager that is still starting, and a bounded wait for it
to answer. Split out of :mod:`radixkv.service.client` (the protocol calls)."""
from __future__ import annotations

import grpc
from radixkv.service.wire.errors import ServiceUnavailableError
from radixkv.service.wire.transport import DEFAULT_MAX_MESSAGE_BYTES, read_file, unix_socket_path

__all__ = ["open_channel"]


def open_channel(address: str, *, wait_s: float = 10.0, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 tls_server_name: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A channel to ``address`` (``unix:///dir/s.sock`` or ``host:port``), TLS with
    ``tls_ca`` (``tls_cert``/``tls_key`` for a client certificate), ready within ``wait_s``
    (0: do not wait). Raises ``InvalidArgumentError`` (unreadable TLS file) or
    ``ServiceUnavailableError`` (nothing answers within ``wait_s``)."""
    n = int(max_message_bytes)
    options = [("grpc.max_receive_message_length", n), ("grpc.max_send_message_length", n),
               ("grpc.enable_retries", 0),
               # a local manager that is still starting: retry connecting quickly
               ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    path = unix_socket_path(address)
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
    return channel
