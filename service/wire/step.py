"""The ``Step`` stream: the step calls of one worker over one persistent gRPC stream.

A unary RPC pays a call set-up each time (about half the cost of a small call), so a client
sends its step calls as messages of one long-lived stream. Same protocol, not a second one:
a :class:`pb.StepRequest` carries a method name and that method's *unary* request bytes, run
through the same handler, validation and reply cache (same request id and digest, so a retry
may cross between stream and unary); a :class:`pb.StepResponse` carries the unary reply or
the status a failed call would end with (:class:`pb.StepError`); a failed call does not end
the stream. A request may carry a replay of locally answered decodes, run first (only once
the manager said ``rides_replay``). Only :data:`STEP_METHODS` travel on it. The Step socket
carries the same messages as length-prefixed frames of a Unix socket
(:func:`step_socket_path`), opened with a token-bearing :class:`pb.StepHello`. This module
holds what both sides share: the methods, the error form and the framing (server:
``step_stream`` / ``step_socket``; client: ``step_lane`` / ``step_socket``). Why and how:
``docs/service.md``, "The Step stream and the Step socket".
"""
from __future__ import annotations

import struct
from typing import Any

import grpc
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.errors import RpcStatus

__all__ = ["STEP_METHODS", "REPLY_TYPES", "StepRpcError", "error_to_msg", "step_request", "step_reply",
           "FRAME", "HELLO_MAX_BYTES", "SOCKET_VERSION", "step_socket_path"]

#: The methods a Step stream carries, with the reply message type of each.
REPLY_TYPES: dict[str, Any] = {
    "Heartbeat": pb.HeartbeatResponse, "Match": pb.MatchResponse, "AllocExtend": pb.AllocExtendResponse,
    "AllocDecode": pb.AllocDecodeResponse, "ApplyDecodes": pb.ApplyDecodesResponse,
    "CacheUnfinished": pb.CacheResponse,
    "CacheFinished": pb.CacheResponse, "Release": pb.ReleaseResponse, "Evict": pb.EvictResponse,
}
STEP_METHODS = tuple(REPLY_TYPES)


# --------------------------------------------------------------------------- errors in the stream


def error_to_msg(st: RpcStatus) -> pb.StepResponse:
    """The StepResponse of a call that failed with status ``st``."""
    return pb.StepResponse(error=pb.StepError(code=int(st.code.value[0]), details=st.details,
                                              trailing_keys=[k for k, _ in st.trailing_metadata],
                                              trailing_values=[str(v) for _, v in st.trailing_metadata]))


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class StepRpcError(grpc.RpcError):
    """A failed step call, shaped as the ``grpc.RpcError`` of a failed unary call (``code``,
    ``details``, ``trailing_metadata``), so that ``error_from_rpc`` maps it."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()):
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, trailing

    @classmethod
    def from_msg(cls, m: pb.StepError) -> StepRpcError:
        return cls(_CODES.get(int(m.code), grpc.StatusCode.UNKNOWN), m.details,
                   tuple(zip(m.trailing_keys, m.trailing_values)))

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    # grpc's own pairs are tuples too; its stubs name a class that exists only in them
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:  # type: ignore[override]
        return self._trailing


# --------------------------------------------------------------------------- the worker's messages


def step_request(method: str, request: Any, request_id: str, replay: Any = None) -> pb.StepRequest:
    """The StepRequest of ``request`` (a unary request message of ``method``), with ``replay``
    (an object with ``request``, an ApplyDecodesRequest, and ``request_id``) riding on it."""
    msg = pb.StepRequest(method=method, request=request.SerializeToString(), request_id=request_id)
    if replay is not None:
        msg.replay = replay.request.SerializeToString()
        msg.replay_request_id = replay.request_id
    return msg


def step_reply(resp: pb.StepResponse, method: str) -> Any:
    """The reply message of ``method`` in ``resp``; raises :class:`StepRpcError` for its error."""
    if resp.WhichOneof("result") == "error":
        raise StepRpcError.from_msg(resp.error)
    return REPLY_TYPES[method].FromString(resp.reply)


# --------------------------------------------------------------------------- the Step socket

#: A frame's header: the length of the message that follows (unsigned 32-bit, little-endian).
FRAME = struct.Struct("<I")
#: The largest hello the manager reads (a token is at most a few hundred bytes).
HELLO_MAX_BYTES = 4096
#: ``StepHello.version`` of this wire format.
SOCKET_VERSION = 1
#: What the Step socket's path adds to the gRPC socket's.
SOCKET_SUFFIX = ".step"


def step_socket_path(grpc_socket_path: str) -> str:
    """The Step socket beside the gRPC socket at ``grpc_socket_path`` (same directory)."""
    return grpc_socket_path + SOCKET_SUFFIX
