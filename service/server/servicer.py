"""The RPC handlers: each parses its request, makes one engine call, encodes the answer.

The engine (``radixkv.engine.CacheEngine``) is single-threaded; every handler runs on the
one asyncio event loop of the server and calls the engine synchronously (no ``await``
between decoding a request and answering it), so calls never interleave and no lock is
needed. How a unary call runs around its body: :mod:`radixkv.service.server.unary_rpc`.
A call's new events reach the event hub and its outlets before its reply leaves (with
events off: one attribute test per call). Streams: ``KeepAlive`` (renews the lease; a
dropped stream reclaims or quarantines the session), ``WatchEvents`` (numbered events from
the hub), ``Step`` (a worker's step calls, each through its unary body,
:mod:`radixkv.service.server.step_stream`); all end promptly on ``closing``.
The rules in full: ``docs/service.md``, "The servicer: handlers, events and streams".
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

import grpc
import numpy as np
from google.protobuf.message import Message
from radixkv.service.server.event_hub import EventHub, HubRecord, engine_event_source
from radixkv.service.server.fair_share import FairShare, yield_to_loop
from radixkv.service.server.idempotency import ReplyCache, digest
from radixkv.service.server.metrics import ServiceMetrics
from radixkv.service.server.quarantine import Quarantine
from radixkv.service.server.session_keys import SessionKeys
from radixkv.service.server.sliced_match import match_in_slices, needs_slices
from radixkv.service.server.step_stream import StepStreams, serve_step_stream
from radixkv.service.server.unary_rpc import (
    STREAM_END,
    Body,
    M,
    RawContext,
    UnaryRpc,
    parse,
    unary_handler,
)
from radixkv.service.wire import codec as wire
from radixkv.service.wire import events as event_wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.auth import Token
from radixkv.service.wire.errors import status_of
from radixkv.service.wire.limits import CallLimits, check_raw, check_raw_steps, limits_for
from radixkv.service.wire.shm import SharedBuffers
from radixkv.service.wire.step import error_to_msg

from radixkv.engine.protocol import DecodeItem, Session
from radixkv.errors import InvalidArgumentError, InvariantError, RadixKVError, StaleSessionError

if TYPE_CHECKING:
    from radixkv.engine.embedded import CacheEngine

__all__ = ["CacheManagerServicer", "add_to_server", "encode_record", "SERVICE_NAME",
           "UNARY_METHODS", "STREAM_METHODS"]

log = logging.getLogger("radixkv.service")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CacheManager"].full_name
DEFAULT_WATCH_POLL_S = 0.05
#: The shortest poll a watcher may ask for: events are pushed as they come (the hub wakes its
#: waiters), so the poll only renews the watcher's lease; 200 watchers at 1 ms took the
#: manager to 98 % CPU (issue 17, item 6).
MIN_WATCH_POLL_S = 0.05
#: Events one WatchEvents read hands to the stream before it looks again (bounded work).
WATCH_CHUNK = 256
#: Encoded events one TakeEvents reply carries at most (the rest wait for the next call).
TAKE_MAX_BYTES = 8 << 20
#: Requests larger than this are counted against the limits in steps (``parse_request_async``).
STEPPED_CHECK_BYTES = 64 << 10
#: An idempotent Attach's ``client_nonce``: at least this many bytes (and at most 64).
MIN_CLIENT_NONCE = 16


class CacheManagerServicer:
    """``radixkv.v1.CacheManager`` over one engine and its shared buffers.

    ``engine``: a ``CacheEngine`` whose pools live in ``shared``'s buffers (their descriptors
    go out with ``Attach``); ``metrics``: RPC latencies and stats snapshots; ``closing``: set
    when the server starts shutting down; ``quarantine_s``: how long what an expired session
    held may stay quarantined while its worker runs (0: none); ``replies``: the reply cache
    of idempotent calls (default: 64 per session, 64 MiB); ``events``: the event hub over the
    engine's tree (``TakeEvents`` / ``WatchEvents`` read it); ``limits``: entries and tokens
    one call may carry (default: :func:`~radixkv.service.wire.limits.limits_for`), checked on
    the raw request before it is decoded (:meth:`parse_request`).
    """

    def __init__(self, engine: CacheEngine, shared: SharedBuffers, metrics: ServiceMetrics, closing: asyncio.Event,
                 quarantine_s: float = 0.0, replies: ReplyCache | None = None,
                 events: EventHub | None = None, limits: CallLimits | None = None,
                 operator_token: Token | None = None):
        self.engine = engine
        self.operator_token = operator_token  # the Step stream's operator calls check it (step_stream.py)
        cfg = engine.config
        self.limits = limits if limits is not None else limits_for(cfg.kv_tokens, cfg.request_rows,
                                                                   cfg.decode_reserve)
        self.shared = shared
        self.metrics = metrics
        self.closing = closing
        self.quarantine = Quarantine(engine, quarantine_s)
        self.session_keys = SessionKeys()
        #: Turns of engine work, round-robin across sessions (unary and Step paths, Match slices).
        self.share = FairShare()
        self.replies = replies if replies is not None else ReplyCache()
        layout = engine.layout()
        for p in layout.get("pools", {}).values():
            p.pop("mapping", None)  # mappings travel typed, per attach
        self._layout_json = json.dumps(layout, separators=(",", ":"))
        self.keepalive_streams = 0
        #: The open Step streams: their read deadline and the end of them at ``closing`` (step_stream.py).
        self.step_streams = StepStreams()
        #: Fault injection (tests, soak): ``{method: seconds}`` an idempotent call's reply is
        #: held back after the engine ran it, as if the network lost time.
        self.reply_delays: dict[str, float] = {}
        self.idle_failures: list[str] = []  # invariant checks that failed at an idle sweep
        self.events = events if events is not None else EventHub(engine_event_source(engine), encode=encode_record)
        self._take_cursor = self.events.subscribe("TakeEvents", 0)  # one queue for every TakeEvents caller
        #: Pump the hub after each call (False when the engine records no events: no work then).
        self.pump_after_calls = bool(getattr(engine, "events_enabled", False))

    def answer(self, name: str, body: Body, request: Message, raw: bytes,
               rid: str | None) -> tuple[bytes, float]:
        """Run ``body`` on a parsed request (after the fence) and serialize its reply; with a
        request id ``rid``, answer a retry from the reply cache and keep a fresh reply.
        Returns ``(reply bytes, seconds to hold it back)`` (fault injection, else 0). Raises
        whatever the body raises (nothing kept). Shared by the unary handlers and the Step
        stream, so both run a call identically. Afterwards (also when the body raised) the
        engine's new events, if any, are pumped into the hub (:meth:`pump_events`)."""
        try:
            if rid is None:
                return body(self, request).SerializeToString(), 0.0
            scope = reply_scope(name, request)
            key = digest(name, bytes(raw))
            kept = self.replies.lookup(scope, rid, key)
            if kept is not None:
                return kept, 0.0
            reply = body(self, request).SerializeToString()
            self.replies.store(scope, rid, key, reply)
            return reply, float(self.reply_delays.get(name) or 0.0)
        finally:
            if self.pump_after_calls:
                self.pump_events()

    def parse_request(self, cls: type[M], raw: object, method: str) -> M:
        """``raw`` as a ``cls`` message, after its entries and tokens were counted on the raw
        bytes against :attr:`limits` (``RequestLimitError`` naming the limit, before any
        decoding). Raises ``InvalidArgumentError`` for bytes that are not a message."""
        if isinstance(raw, (bytes, bytearray, memoryview)):
            check_raw(method, raw, self.limits)
        return parse(cls, raw, method)

    async def parse_request_async(self, cls: type[M], raw: object, method: str) -> M:
        """:meth:`parse_request`, except that a request over :data:`STEPPED_CHECK_BYTES` is
        counted in steps with turns of the loop between them (``check_raw_steps``): the count
        of the largest Match took 1.2-2.8 ms in one block (docs/reliability.md)."""
        if isinstance(raw, (bytes, bytearray, memoryview)) and len(raw) > STEPPED_CHECK_BYTES:
            for _ in check_raw_steps(method, raw, self.limits):
                await yield_to_loop()
            return parse(cls, raw, method)
        return self.parse_request(cls, raw, method)

    def session_of(self, msg: pb.SessionRef) -> Session:
        """The session a request names, once it is live and the request carries its secret
        (:mod:`radixkv.service.server.session_keys`): ``StaleSessionError`` /
        ``SessionSecretError`` before any work is done for it. O(1)."""
        return self.session_keys.check(self.engine, msg)

    def live_session(self, msg: pb.SessionRef) -> Session:
        """The session a request names, checked live and its secret (:meth:`session_of`), and
        its lease renewed, before any work is done for it: a stale session's call costs O(1),
        whatever it carries."""
        session = self.session_of(msg)
        self.engine.heartbeat(session)
        return session

    async def answer_async(self, name: str, body: Body, request: Message, raw: bytes,
                           rid: str | None) -> tuple[bytes, float]:
        """:meth:`answer`, except that a large ``Match`` runs in slices that yield to the loop
        (:mod:`radixkv.service.server.sliced_match`), with the same reply cache."""
        if name != "Match" or not isinstance(request, pb.MatchRequest) or not needs_slices(request):
            return self.answer(name, body, request, raw, rid)
        try:
            scope, key = reply_scope(name, request), digest(name, bytes(raw))
            if rid is not None:
                kept = self.replies.lookup(scope, rid, key)
                if kept is not None:
                    return kept, 0.0
            reply = (await match_in_slices(self, request)).SerializeToString()
            if rid is None:
                return reply, 0.0
            self.replies.store(scope, rid, key, reply)
            return reply, float(self.reply_delays.get(name) or 0.0)
        finally:
            if self.pump_after_calls:
                self.pump_events()

    def pump_events(self) -> int:
        """Append the engine's pending events to the hub and run its outlets, when there
        are any (one O(1) test otherwise). Returns how many were appended."""
        if self.engine.pending_events() and not self.events.closed:
            return self.events.pump()
        return 0

    # ------------------------------------------------------------------ sessions
    def Attach(self, request: pb.AttachRequest) -> pb.AttachResponse:
        pid = Quarantine.check_pid(int(request.pid))
        info = self.engine.attach(request.worker_name)
        self.quarantine.register(info.session.session_id, pid)
        mappings = [wire.mapping_to_msg(pool, self.shared.descriptor(pool)) for pool in self.shared.descriptors]
        return pb.AttachResponse(session=self.session_keys.ref(info.session), layout_json=self._layout_json,
                                 mappings=mappings)

    def Heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(lease_left_s=self.engine.heartbeat(self.session_of(request.session)))

    def Detach(self, request: pb.DetachRequest) -> pb.DetachResponse:
        self.engine.detach(self.session_of(request.session))
        return pb.DetachResponse()

    # ------------------------------------------------------------------ the step
    def Match(self, request: pb.MatchRequest) -> pb.MatchResponse:
        session = self.live_session(request.session)
        return wire.match_infos_to_msg(self.engine.match(session, wire.match_queries_from_msg(request.queries)))

    def AllocExtend(self, request: pb.AllocExtendRequest) -> pb.AllocExtendResponse:
        session = self.live_session(request.session)
        self.engine.sessions.check_batch(len(request.rid_lens_i32) // 4)  # O(1), before decoding
        return wire.extend_results_to_msg(self.engine.alloc_extend(session, wire.extend_items_from_msg(request)))

    def AllocDecode(self, request: pb.AllocDecodeRequest) -> pb.AllocDecodeResponse:
        session = self.live_session(request.session)
        return wire.decode_result_to_msg(self.engine.alloc_decode(session, wire.decode_items_from_msg(request)))

    def ApplyDecodes(self, request: pb.ApplyDecodesRequest) -> pb.ApplyDecodesResponse:
        """Replay decode steps a client answered from its reserves: ``alloc_decode`` for
        each call in order (see ``radixkv.service.client.local_decode``), the leading calls
        that need no allocator call in one batched update
        (``CacheEngine.replay_decodes``), the rest one by one. An error
        at call ``k`` names ``ApplyDecodes call k`` in its message; at ``k == 0`` (nothing
        changed) it fails the RPC, at ``k >= 1`` it is answered in the reply (``applied = k``
        and ``error``) so the reply cache keeps it and a retry cannot apply calls ``0 .. k-1``
        twice. A request whose packed fields disagree fails whole. O(total items)."""
        n = len(request.call_lens_i32) // 4
        try:
            session = self.live_session(request.session)
        except RadixKVError as e:  # stale: call 0 cannot run
            if n:
                e.args = (f"ApplyDecodes call 0 of {n}: {e}",) + e.args[1:]
            raise
        rids, lens, idx, toks = wire.apply_decodes_from_msg(request)
        done = self.engine.replay_decodes(session, rids, lens, idx, toks)
        if done == n:
            return pb.ApplyDecodesResponse(applied=n)
        ends = np.cumsum(lens, dtype=np.int64).tolist()
        for k in range(done, n):
            a = ends[k - 1] if k else 0
            items = [DecodeItem(rids[i], t) for i, t in zip(idx[a:ends[k]].tolist(), toks[a:ends[k]].tolist())]
            try:
                self.engine.alloc_decode(session, items)
            except RadixKVError as e:
                e.args = (f"ApplyDecodes call {k} of {n}: {e}",) + e.args[1:]
                if k == 0:
                    raise
                return pb.ApplyDecodesResponse(applied=k, error=error_to_msg(status_of(e)).error)
        return pb.ApplyDecodesResponse(applied=n)

    def CacheUnfinished(self, request: pb.CacheRequest) -> pb.CacheResponse:
        return wire.cache_results_to_msg(
            self.engine.cache_unfinished(self.session_of(request.session), list(request.rids)))

    def CacheFinished(self, request: pb.CacheRequest) -> pb.CacheResponse:
        return wire.cache_results_to_msg(
            self.engine.cache_finished(self.session_of(request.session), list(request.rids)))

    def Release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        self.engine.release(self.session_of(request.session), list(request.rids))
        return pb.ReleaseResponse()

    def Evict(self, request: pb.EvictRequest) -> pb.EvictResponse:
        return wire.evict_result_to_msg(
            self.engine.evict(self.session_of(request.session), int(request.num_tokens),
                              int(request.num_states)))

    # ------------------------------------------------------------------ stats / admin
    def Stats(self, request: pb.StatsRequest) -> pb.StatsResponse:
        session = self.session_of(request.session) if request.HasField("session") else None
        stats = self.engine.stats(session)
        self.metrics.update(stats)
        self.metrics.update_tiers(self.engine.tier_stats())  # a scrape after Stats sees the same counters
        return wire.stats_to_msg(stats)

    def Flush(self, request: pb.FlushRequest) -> pb.FlushResponse:
        return pb.FlushResponse(flushed=bool(self.engine.flush(self.session_of(request.session))))

    def TakeEvents(self, request: pb.TakeEventsRequest) -> pb.TakeEventsResponse:
        """The events no TakeEvents caller has taken, oldest first, up to ``max_events``
        (0: all, within ``TAKE_MAX_BYTES``); an ``events_lost`` marker first when the ring
        dropped some before anyone took them."""
        self.engine.heartbeat(self.session_of(request.session))
        n = int(request.max_events)
        if n < 0:
            raise InvalidArgumentError(f"max_events must be >= 0, got {n}")
        hub = self.events
        hub.pump()
        res = hub.read(self._take_cursor, n, TAKE_MAX_BYTES)
        resp = pb.TakeEventsResponse()
        if res.lost is not None:
            resp.events.append(event_wire.lost_to_msg(*res.lost))
        for r in res.records:
            resp.events.add().MergeFromString(hub.encoded(r))
        return resp

    def CheckInvariants(self, request: pb.CheckInvariantsRequest) -> pb.CheckInvariantsResponse:
        self.check_all()
        return pb.CheckInvariantsResponse()

    def check_all(self) -> None:
        """The engine's invariants, the shared buffers', the quarantine's, the reply
        cache's, the event hub's and the fair share's (raises ``InvariantError``), and no earlier idle check
        (``--check-idle``) failed."""
        if self.idle_failures:
            raise InvariantError(f"{len(self.idle_failures)} idle invariant check(s) failed; the first: "
                                 f"{self.idle_failures[0]}")
        self.engine.check_invariants()
        self.shared.check_invariants()
        self.quarantine.check_invariants()
        self.replies.check_invariants()
        self.events.check_invariants()
        self.share.check_invariants()

    def housekeeping(self) -> tuple[list[str], list[str]]:
        """One sweep: fence due sessions that must be held, reclaim the other expired
        ones, release the quarantined ones whose process is gone or whose hold ran out,
        drop what ended sessions left in the reply cache. Returns ``(expired, released)``."""
        self.quarantine.fence_due()
        expired = self.engine.sweep()
        released = self.quarantine.release_ready()
        self.quarantine.forget_ended()
        sessions = self.engine.sessions
        self.replies.retain((f"s:{sid}" for sid in sessions.session_ids()), sessions.now(),
                            grace_s=sessions.lease_ttl_s)
        return expired, released

    # ------------------------------------------------------------------ streams
    async def KeepAlive(self, request_iterator: AsyncIterator[bytes], context: RawContext) -> None:
        session: Session | None = None
        closing = asyncio.ensure_future(self.closing.wait())
        self.keepalive_streams += 1
        closed_by_worker = False
        try:
            while True:
                read = asyncio.ensure_future(context.read())
                done, _ = await asyncio.wait({read, closing}, return_when=asyncio.FIRST_COMPLETED)
                if read not in done:  # the server is shutting down
                    read.cancel()
                    return
                raw = read.result()
                if raw is STREAM_END:
                    closed_by_worker = True
                    return
                t0 = time.perf_counter()
                try:
                    request = parse(pb.HeartbeatRequest, raw, "KeepAlive")
                    this = self.session_of(request.session)
                    if session is not None and this[:2] != session[:2]:
                        raise InvalidArgumentError("a keep-alive stream serves one session")
                    self.quarantine.fence_due()
                    left = self.engine.heartbeat(this)
                    session = this
                except Exception as exc:
                    st = status_of(exc)
                    self.metrics.observe("KeepAlive", st.code.name, time.perf_counter() - t0)
                    await context.abort(st.code, st.details, st.trailing_metadata)
                self.metrics.observe("KeepAlive", "OK", time.perf_counter() - t0)
                await context.write(pb.HeartbeatResponse(lease_left_s=left).SerializeToString())
        finally:
            self.keepalive_streams -= 1
            closing.cancel()
            if session is not None and not self.closing.is_set():
                self._end(session, closed_by_worker)

    def _end(self, session: Session, closed_by_worker: bool) -> None:
        try:
            sid = self.engine.sessions.lookup(session).session_id
        except StaleSessionError:
            return  # detached, expired or fenced already
        if closed_by_worker:
            why = "its keep-alive stream was closed"
            n = self.engine.reclaim(sid, why)
        else:
            why = "its keep-alive stream was dropped"
            n = self.quarantine.end(sid, why)
        log.info("session %s: %s; reclaimed %d request(s)", session.session_id, why, n)

    async def WatchEvents(self, raw: bytes, context: RawContext) -> AsyncIterator[bytes]:
        """Stream the hub's events from this watcher's own cursor until the server closes
        or the watcher cancels. Every poll interval (or as soon as events arrive) the
        session's lease is renewed (a stale session ends the stream with its error) and the
        hub pumped. A watcher the ring left behind gets an ``events_lost`` marker."""
        hub, cursor = self.events, None
        try:
            try:
                request = parse(pb.WatchEventsRequest, raw, "WatchEvents")
                session = self.session_of(request.session)
                self.quarantine.fence_due()
                self.engine.heartbeat(session)
                hub.pump()
                cursor = hub.subscribe("WatchEvents", None if request.from_now else int(request.start_seq))
            except Exception as exc:
                st = status_of(exc)
                await context.abort(st.code, st.details, st.trailing_metadata)
            poll = watch_poll_s(request.poll_interval_s)
            while not self.closing.is_set():
                res = hub.read(cursor, WATCH_CHUNK)
                if res.lost is not None:
                    yield event_wire.lost_to_msg(*res.lost).SerializeToString()
                for r in res.records:
                    yield hub.encoded(r)
                if not res.more:
                    await hub.wait(cursor, poll, self.closing)
                if self.closing.is_set():
                    break
                try:
                    self.quarantine.fence_due()
                    self.engine.heartbeat(session)
                except Exception as exc:
                    st = status_of(exc)
                    await context.abort(st.code, st.details, st.trailing_metadata)
                hub.pump()
        finally:
            if cursor is not None:
                hub.unsubscribe(cursor)


    # ------------------------------------------------------------------ the dispatch table
    #: Every unary call: method -> its body (above: ``body(servicer, parsed request) -> reply``),
    #: request type and idempotence. The one table both paths read: the unary handlers
    #: (:func:`add_to_server`, :func:`~radixkv.service.server.unary_rpc.unary_handler`) and the
    #: Step paths (:func:`~radixkv.service.server.step_stream.answer_step`: the gRPC Step stream
    #: and the Step socket).
    RPCS: ClassVar[Mapping[str, UnaryRpc]] = MappingProxyType({
        "Attach": UnaryRpc(Attach, pb.AttachRequest),
        "Heartbeat": UnaryRpc(Heartbeat, pb.HeartbeatRequest),
        "Detach": UnaryRpc(Detach, pb.DetachRequest),
        "Match": UnaryRpc(Match, pb.MatchRequest),
        "AllocExtend": UnaryRpc(AllocExtend, pb.AllocExtendRequest),
        "AllocDecode": UnaryRpc(AllocDecode, pb.AllocDecodeRequest),
        "ApplyDecodes": UnaryRpc(ApplyDecodes, pb.ApplyDecodesRequest),
        "CacheUnfinished": UnaryRpc(CacheUnfinished, pb.CacheRequest),
        "CacheFinished": UnaryRpc(CacheFinished, pb.CacheRequest),
        "Release": UnaryRpc(Release, pb.ReleaseRequest),
        "Evict": UnaryRpc(Evict, pb.EvictRequest),
        "Stats": UnaryRpc(Stats, pb.StatsRequest, idempotent=False),
        "Flush": UnaryRpc(Flush, pb.FlushRequest),
        "TakeEvents": UnaryRpc(TakeEvents, pb.TakeEventsRequest),
        "CheckInvariants": UnaryRpc(CheckInvariants, pb.CheckInvariantsRequest, idempotent=False),
    })


def reply_scope(name: str, request: Any) -> str:
    """The reply-cache scope of an idempotent call: its session, or for ``Attach`` (no
    session yet) its ``client_nonce`` (hashed), so two clients using one request id never
    share a reply, i.e. a session and its secret. Raises ``InvalidArgumentError`` for an
    idempotent Attach without a nonce of 16..64 bytes."""
    if name != "Attach":
        return f"s:{request.session.session_id}"
    nonce = bytes(request.client_nonce)
    if not MIN_CLIENT_NONCE <= len(nonce) <= 64:
        raise InvalidArgumentError(f"an Attach with a request id needs a client_nonce of {MIN_CLIENT_NONCE}..64 "
                                   f"random bytes (the same for its retries), got {len(nonce)}")
    return "a:" + hashlib.blake2b(nonce, digest_size=16).hexdigest()


def watch_poll_s(asked: float) -> float:
    """The poll interval of a watcher that asked for ``asked`` seconds: clamped to
    ``[MIN_WATCH_POLL_S, 60]``; NaN, inf and ``<= 0`` get the default."""
    if not 0 < asked <= 60:
        return DEFAULT_WATCH_POLL_S
    return max(MIN_WATCH_POLL_S, float(asked))


def encode_record(record: HubRecord) -> bytes:
    """A hub record as its serialized ``KVEvent`` (what every event stream sends)."""
    return event_wire.event_to_msg(record.event, record.seq).SerializeToString()


UNARY_METHODS = tuple(CacheManagerServicer.RPCS)
STREAM_METHODS = ("KeepAlive", "WatchEvents", "Step")


def add_to_server(servicer: CacheManagerServicer, server: grpc.aio.Server) -> None:
    """Register every method of ``radixkv.v1.CacheManager`` with raw-bytes requests and
    replies (the handlers parse and serialize themselves, see the module docstring)."""
    handlers: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
        m: grpc.unary_unary_rpc_method_handler(unary_handler(servicer, m, rpc))
        for m, rpc in CacheManagerServicer.RPCS.items()}
    handlers["KeepAlive"] = grpc.stream_stream_rpc_method_handler(servicer.KeepAlive)
    handlers["WatchEvents"] = grpc.unary_stream_rpc_method_handler(servicer.WatchEvents)
    handlers["Step"] = grpc.stream_stream_rpc_method_handler(functools.partial(serve_step_stream, servicer))
    declared = {m.name for m in pb.DESCRIPTOR.services_by_name["CacheManager"].methods}
    if declared != set(handlers):  # pragma: no cover - a proto edit without a handler
        raise InvariantError(f"handlers {sorted(handlers)} do not match the proto's methods {sorted(declared)}")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
