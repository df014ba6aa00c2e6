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

This module holds what both sides share: the methods a stream carries and the error form of
a failed call. The manager's side is :mod:`radixkv.service.server.step_stream`, the worker's
:mod:`radixkv.service.client.step_lane`.
"""
from __future__ import annotations

from typing import Any

import grpc
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.errors import RpcStatus

__all__ = ["STEP_METHODS", "REPLY_TYPES", "StepRpcError", "error_to_msg"]

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

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


# --------------------------------------------------------------------------- the manager's side
