"""The worker's side of the Step socket: its step calls as frames of one Unix socket.

The wire format is described in :mod:`radixkv.service.wire.step` and the proto; the manager's
side is :mod:`radixkv.service.server.step_socket`. :class:`StepSocket` has the interface of
:class:`~radixkv.service.client.step_lane.StepStream`, and :class:`~radixkv.service.client.step_lane.StepLane`
prefers it when the manager listens on one: a call is a blocking ``sendall`` and a read on
the calling thread, no queue and no gRPC thread in between.

Deadlines: the socket's timeout is the client's; a call that waits longer breaks the
connection and fails as a unary call past its deadline does (``DEADLINE_EXCEEDED``). A
connection that ends otherwise (the manager shut down, restarted) makes the call return
None, and the lane sends it again over the gRPC path with the same request ids, as after a
broken Step stream.
"""
from __future__ import annotations

import socket
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.auth import Token
from radixkv.service.wire.step import FRAME, SOCKET_VERSION, StepRpcError, step_reply, step_request

__all__ = ["StepSocket"]


class StepSocket:
    """One open connection to the manager's Step socket (build it with :meth:`open`); one
    call at a time (the caller holds a lock).

    Args:
        sock: the connected, greeted socket.
        timeout_s: how long one call may wait for its answer.
    """

    unimplemented = False  # as StepStream's: an older manager simply has no socket
    rides_replay = True  # said in the hello's answer

    def __init__(self, sock: socket.socket, timeout_s: float):
        self._sock = sock
        self._reader = sock.makefile("rb")
        self._timeout = float(timeout_s)
        self.broken = False
        self.calls = 0  # calls answered over this connection

    @classmethod
    def open(cls, path: str, token: Token, timeout_s: float) -> StepSocket | None:
        """Connect to the Step socket at ``path`` and greet it; None when nothing usable
        listens there (no such socket, refused, or the manager turned the hello down: the
        gRPC path then answers the call as it would, errors included)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(float(timeout_s))
        try:
            sock.connect(path)
            hello = pb.StepHello(token=token.reveal(), version=SOCKET_VERSION).SerializeToString()
            sock.sendall(FRAME.pack(len(hello)) + hello)
            lane = cls(sock, timeout_s)
            answer = pb.StepResponse.FromString(lane._read())
        except (OSError, EOFError, DecodeError):
            sock.close()
            return None
        if answer.WhichOneof("result") == "error":
            lane.close()
            return None
        return lane

    def _read(self) -> bytes:
        """One frame's bytes (raises EOFError when the manager closed the socket)."""
        r = self._reader
        head = r.read(FRAME.size)
        if len(head) < FRAME.size:
            raise EOFError("the Step socket closed")
        (n,) = FRAME.unpack(head)
        body = r.read(n)
        if len(body) < n:
            raise EOFError("the Step socket closed within a frame")
        return body

    def call(self, method: str, request: Any, request_id: str, replay: Any = None) -> Any | None:
        """As :meth:`StepStream.call <radixkv.service.client.step_lane.StepStream.call>`: the
        reply message, :class:`StepRpcError` for a failed call (or ``DEADLINE_EXCEEDED``), or
        None when the connection broke (send the call again over gRPC, same request ids)."""
        if self.broken:
            return None
        data = step_request(method, request, request_id, replay).SerializeToString()
        try:
            self._sock.sendall(FRAME.pack(len(data)) + data)
            resp = pb.StepResponse.FromString(self._read())
        except TimeoutError:  # socket.timeout: no answer within the client's timeout
            self.close()
            raise StepRpcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"Deadline Exceeded: no answer within {self._timeout} s") from None
        except (OSError, EOFError, DecodeError):
            self.close()
            return None
        self.calls += 1
        if replay is not None:
            replay.applied = resp.replayed
        return step_reply(resp, method)

    def close(self) -> None:
        """Close the connection (idempotent)."""
        self.broken = True
        try:
            self._reader.close()
        finally:
            self._sock.close()
