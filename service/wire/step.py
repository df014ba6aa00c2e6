"""The ``Step`` stream: the step calls of one worker over one persistent gRPC stream.

A unary RPC in Python gRPC pays a call set-up each time (a new HTTP/2 stream, headers,
deadline, the auth interceptor, trailers): about half the cost of a small call (measured
in ``docs/service.md``, "Benchmark": CPU and round trip per call, unary against a message of
an open stream). A scheduler makes ~10 calls per
step, so a client may instead send its step calls as messages of one long-lived
bidirectional stream (``connect(..., step_stream=True)``). It is the same protocol, not a
second one:

* a :class:`pb.StepRequest` carries the method name and the bytes of that method's *unary*
  request message; the manager parses them with the same parser, fences due sessions and
  runs the same handler body through ``CacheManagerServicer.answer`` (same validation, same
  engine call, same reply cache: ``request_id`` is the ``radixkv-request-id`` and the digest
  is over the same request bytes, so a call retried over the unary path after a broken
  stream gets the reply kept from the stream, and the other way round);
* the :class:`pb.StepResponse` carries the unary reply's bytes, or the status a failed unary
  call would end with (:class:`pb.StepError`: code, details, trailing metadata), which the
  client turns into the same ``radixkv.errors`` type with the one mapping
  (``radixkv.service.wire.errors.error_from_rpc``). A failed call does not end the stream.

A :class:`pb.StepRequest` may also carry a replay (``replay``: an ``ApplyDecodesRequest``,
``replay_request_id``: its own request id), the session's locally answered decode steps: the
manager runs it first, as the ``ApplyDecodes`` call would run, then the call, with no other
call between them, so the replay costs no message of its own. A failed replay is the
message's error (the call does not run). The manager sets ``rides_replay`` in every answer; a
worker sends a replay only on a stream whose manager said so (an older one would ignore it).

Only :data:`STEP_METHODS` travel on it (session-scoped, idempotent calls); anything else is
answered INVALID_ARGUMENT in the stream. The stream ends when the worker closes it or the
manager starts shutting down (``closing``); a worker whose stream broke sends the call over
the unary path with the same request id (safe: see the reply cache).

The same messages also travel without gRPC, over the **Step socket**: a plain Unix stream
socket beside the manager's gRPC socket (:func:`step_socket_path`), each message a frame (its
length as 4 little-endian bytes, then its bytes), opened with a :class:`pb.StepHello` that
carries the token (the wire format is in the proto, above ``StepHello``). It saves gRPC's
thread hand-offs on both sides, which cost most of a small message's CPU. A worker uses it
when it can connect to it and falls back to the gRPC stream otherwise.

This module holds what both sides share: the methods a stream carries, the error form of
a failed call and the Step socket's framing. The manager's side is
:mod:`radixkv.service.server.step_stream` (and :mod:`~radixkv.service.server.step_socket`),
the worker's :mod:`radixkv.service.client.step_lane` (and :mod:`~radixkv.service.client.step_socket`).
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
