"""The RPC handlers: each decodes its request, makes one engine call, encodes the answer.

The engine (``radixkv.engine.CacheEngine``) is single-threaded; every handler runs on the
one asyncio event loop of the server and calls the engine synchronously (no ``await``
between decoding a request and answering it), so calls never interleave and no lock is
needed. Errors map to status codes in one place (:mod:`radixkv.service.errors`); every RPC's
latency goes to the metrics histogram labelled with its status code.

Streams:

* ``KeepAlive``: every message renews the lease; when the stream ends for any reason (the
  worker closed it, its connection dropped, it was killed) the session is detached and
  everything it held is reclaimed.
* ``WatchEvents``: drains the engine's KV events every poll interval and streams them
  (one queue for the engine: ``TakeEvents`` callers and other watchers compete for it).

Both end promptly when the server starts shutting down (``closing`` is set).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from typing import Any, Awaitable, Callable, List, Optional

import grpc

from radixkv.engine.protocol import Session
from radixkv.errors import InvariantError, RadixKVError, StaleSessionError
from radixkv.service import wire
from radixkv.service._gen import cache_manager_pb2 as pb
from radixkv.service._gen import cache_manager_pb2_grpc as pb_grpc
from radixkv.service.errors import status_of
from radixkv.service.metrics import ServiceMetrics
from radixkv.service.shm import SharedBuffers

log = logging.getLogger("radixkv.service")

DEFAULT_WATCH_POLL_S = 0.05


def _rpc(name: str) -> Callable:
    """Wrap a synchronous ``body(self, request) -> response`` as a unary aio handler that
    times the call and maps any exception to its status (see ``errors.status_of``)."""

    def deco(body: Callable[[Any, Any], Any]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(body)
        async def handler(self: "CacheManagerServicer", request: Any, context: grpc.aio.ServicerContext) -> Any:
            t0 = time.perf_counter()
            code = "OK"
            try:
                return body(self, request)
            except Exception as exc:  # mapped, never leaked as a traceback
                st = status_of(exc)
                code = st.code.name
                if not isinstance(exc, RadixKVError):
                    log.exception("internal error in %s", name)
                await context.abort(st.code, st.details, st.trailing_metadata)
            finally:
                self.metrics.observe(name, code, time.perf_counter() - t0)

        return handler

    return deco


class CacheManagerServicer(pb_grpc.CacheManagerServicer):
    """``radixkv.v1.CacheManager`` over one engine and its shared buffers.

    Args:
        engine: a ``CacheEngine`` whose pools live in ``shared``'s buffers.
        shared: the pools' shared buffers (their descriptors go out with ``Attach``).
        metrics: where RPC latencies and stats snapshots go.
        closing: set when the server starts shutting down (ends the streams).
    """

    def __init__(self, engine: Any, shared: SharedBuffers, metrics: ServiceMetrics, closing: asyncio.Event):
        self.engine = engine
        self.shared = shared
        self.metrics = metrics
        self.closing = closing
        layout = engine.layout()
        for p in layout.get("pools", {}).values():
            p.pop("mapping", None)  # mappings travel typed, per attach
        self._layout_json = json.dumps(layout, separators=(",", ":"))
        self.keepalive_streams = 0
        self.idle_failures: List[str] = []  # invariant checks that failed at an idle sweep

    # ------------------------------------------------------------------ sessions
    @_rpc("Attach")
    def Attach(self, request: pb.AttachRequest) -> pb.AttachResponse:
        info = self.engine.attach(request.worker_name)
        mappings = [wire.mapping_to_msg(pool, self.shared.descriptor(pool)) for pool in self.shared.descriptors]
        return pb.AttachResponse(session=wire.session_to_msg(info.session), layout_json=self._layout_json,
                                 mappings=mappings)

    @_rpc("Heartbeat")
    def Heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(lease_left_s=self.engine.heartbeat(wire.session_from_msg(request.session)))

    @_rpc("Detach")
    def Detach(self, request: pb.DetachRequest) -> pb.DetachResponse:
        self.engine.detach(wire.session_from_msg(request.session))
        return pb.DetachResponse()

    # ------------------------------------------------------------------ the step
    @_rpc("Match")
    def Match(self, request: pb.MatchRequest) -> pb.MatchResponse:
        infos = self.engine.match(wire.session_from_msg(request.session),
                                  wire.match_queries_from_msg(request.queries))
        return wire.match_infos_to_msg(infos)

    @_rpc("AllocExtend")
    def AllocExtend(self, request: pb.AllocExtendRequest) -> pb.AllocExtendResponse:
        results = self.engine.alloc_extend(wire.session_from_msg(request.session),
                                           wire.extend_items_from_msg(request.items))
        return wire.extend_results_to_msg(results)

    @_rpc("AllocDecode")
    def AllocDecode(self, request: pb.AllocDecodeRequest) -> pb.AllocDecodeResponse:
        result = self.engine.alloc_decode(wire.session_from_msg(request.session),
                                          wire.decode_items_from_msg(request))
        return wire.decode_result_to_msg(result)

    @_rpc("CacheUnfinished")
    def CacheUnfinished(self, request: pb.CacheRequest) -> pb.CacheResponse:
        return wire.cache_results_to_msg(
            self.engine.cache_unfinished(wire.session_from_msg(request.session), list(request.rids)))

    @_rpc("CacheFinished")
    def CacheFinished(self, request: pb.CacheRequest) -> pb.CacheResponse:
        return wire.cache_results_to_msg(
            self.engine.cache_finished(wire.session_from_msg(request.session), list(request.rids)))

    @_rpc("Release")
    def Release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        self.engine.release(wire.session_from_msg(request.session), list(request.rids))
        return pb.ReleaseResponse()

    @_rpc("Evict")
    def Evict(self, request: pb.EvictRequest) -> pb.EvictResponse:
        return wire.evict_result_to_msg(
            self.engine.evict(wire.session_from_msg(request.session), int(request.num_tokens),
                              int(request.num_states)))

    # ------------------------------------------------------------------ stats / admin
    @_rpc("Stats")
    def Stats(self, request: pb.StatsRequest) -> pb.StatsResponse:
        session = wire.session_from_msg(request.session) if request.HasField("session") else None
        stats = self.engine.stats(session)
        self.metrics.update(stats)
        return wire.stats_to_msg(stats)

    @_rpc("Flush")
    def Flush(self, request: pb.FlushRequest) -> pb.FlushResponse:
        return pb.FlushResponse(flushed=bool(self.engine.flush(wire.session_from_msg(request.session))))

    @_rpc("TakeEvents")
    def TakeEvents(self, request: pb.TakeEventsRequest) -> pb.TakeEventsResponse:
        events = self.engine.take_events(wire.session_from_msg(request.session), int(request.max_events))
        return pb.TakeEventsResponse(events=[wire.event_to_msg(e) for e in events])

    @_rpc("CheckInvariants")
    def CheckInvariants(self, request: pb.CheckInvariantsRequest) -> pb.CheckInvariantsResponse:
        self.check_all()
        return pb.CheckInvariantsResponse()

    def check_all(self) -> None:
        """The engine's invariants and the shared buffers' (raises ``InvariantError``), and
        no earlier idle check (``--check-idle``) failed."""
        if self.idle_failures:
            raise InvariantError(f"{len(self.idle_failures)} idle invariant check(s) failed; the first: "
                                 f"{self.idle_failures[0]}")
        self.engine.check_invariants()
        self.shared.check_invariants()

    # ------------------------------------------------------------------ streams
    async def KeepAlive(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        session: Optional[Session] = None
        closing = asyncio.ensure_future(self.closing.wait())
        self.keepalive_streams += 1
        try:
            while True:
                read = asyncio.ensure_future(context.read())
                done, _ = await asyncio.wait({read, closing}, return_when=asyncio.FIRST_COMPLETED)
                if read not in done:  # the server is shutting down
                    read.cancel()
                    return
                request = read.result()
                if request is grpc.aio.EOF:
                    return
                t0 = time.perf_counter()
                try:
                    session = wire.session_from_msg(request.session)
                    left = self.engine.heartbeat(session)
                except Exception as exc:
                    st = status_of(exc)
                    self.metrics.observe("KeepAlive", st.code.name, time.perf_counter() - t0)
                    await context.abort(st.code, st.details, st.trailing_metadata)
                self.metrics.observe("KeepAlive", "OK", time.perf_counter() - t0)
                await context.write(pb.HeartbeatResponse(lease_left_s=left))
        finally:
            self.keepalive_streams -= 1
            closing.cancel()
            if session is not None:
                self._end(session, "its keep-alive stream ended")

    def _end(self, session: Session, why: str) -> None:
        try:
            n = self.engine.reclaim(self.engine.sessions.lookup(session).session_id, why)
        except StaleSessionError:
            return  # detached or expired already
        log.info("session %s: %s; reclaimed %d request(s)", session.session_id, why, n)

    async def WatchEvents(self, request: pb.WatchEventsRequest, context: grpc.aio.ServicerContext):
        session = wire.session_from_msg(request.session)
        poll = request.poll_interval_s if request.poll_interval_s > 0 else DEFAULT_WATCH_POLL_S
        while not self.closing.is_set():
            try:
                events = self.engine.take_events(session, 0)
            except Exception as exc:
                st = status_of(exc)
                await context.abort(st.code, st.details, st.trailing_metadata)
            for e in events:
                yield wire.event_to_msg(e)
            try:
                await asyncio.wait_for(self.closing.wait(), timeout=poll)
            except asyncio.TimeoutError:
                pass

