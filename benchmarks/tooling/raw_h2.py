"""A raw HTTP/2 client (``h2``) that opens the manager's ``Step`` stream and leaves a gRPC
message unfinished: what no ``grpcio`` client can send (issue 34, item 5). For the transport
abuse benchmark and the tests; not a client of the service."""
from __future__ import annotations

import socket
import time
from typing import Any

import h2.config
import h2.connection
import h2.events

__all__ = ["PartialStep"]

STEP_PATH = "/radixkv.v1.CacheManager/Step"


class PartialStep:
    """One Unix-socket connection whose ``Step`` stream announces an ``announce``-byte gRPC
    message (token ``token`` in the metadata) and then sends its body, at most all but one
    byte, while the server's flow-control window lets it, for up to ``budget_s`` (``method``:
    another method's path, e.g. a unary one).
    ``sent``: the body bytes the kernel took. Cost: one 1 MiB buffer, a socket."""

    def __init__(self, path: str, token: str, announce: int, budget_s: float, method: str = STEP_PATH):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.sid = sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "localhost"),
                                     (":path", method), ("content-type", "application/grpc"),
                                     ("te", "trailers"), ("authorization", "Bearer " + token)])
        self.conn.send_data(sid, b"\x00" + announce.to_bytes(4, "big"))
        self.sock.sendall(self.conn.data_to_send())
        self.events: list[Any] = []
        self.sent, zeros, deadline = 0, b"\x00" * (1 << 20), time.monotonic() + budget_s
        self.sock.settimeout(0.2)
        while self.sent < announce - 1 and time.monotonic() < deadline and not self.ended():
            n = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size,
                    announce - 1 - self.sent)
            if n > 0:
                self.conn.send_data(sid, zeros[:n])
                self.sent += n
            elif not self._read():
                break
            try:
                self.sock.sendall(self.conn.data_to_send())
            except OSError:
                break

    def _read(self) -> bool:
        """Take what the server sent (acking its pings); False once the connection is gone."""
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            return True
        except OSError:
            return False
        if not data:
            return False
        self.events += self.conn.receive_data(data)
        return True

    def ended(self) -> bool:
        """Whether the server ended the stream (trailers or RST_STREAM) or the connection."""
        return any(isinstance(e, (h2.events.StreamEnded, h2.events.StreamReset, h2.events.ConnectionTerminated))
                   for e in self.events)

    def wait_end(self, wait_s: float) -> bool:
        """Read (acking pings) until the server ends the stream, the connection is gone or
        ``wait_s`` passed; returns ``ended()``."""
        deadline = time.monotonic() + wait_s
        while not self.ended() and time.monotonic() < deadline and self._read():
            try:
                self.sock.sendall(self.conn.data_to_send())
            except OSError:
                break
        return self.ended()

    def status(self) -> str | None:
        """The ``grpc-status`` the server's trailers gave, if any."""
        for e in self.events:
            if isinstance(e, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
                for k, v in e.headers:
                    if k in (b"grpc-status", "grpc-status"):
                        return v.decode() if isinstance(v, bytes) else str(v)
        return None

    def close(self) -> None:
        self.sock.close()
