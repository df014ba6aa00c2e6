"""The worker side: :func:`connect` returns a :class:`RemoteCacheEngine`, the cache-engine
protocol (``radixkv.engine.protocol.CacheEngineAPI``) run against a cache-manager server.

Every call carries the whole batch as packed int32/int64 bytes. Step calls go over one lane
per client: the manager's Step socket (``unix:`` addresses), else one gRPC ``Step`` stream,
else unary RPCs (``step_socket=False`` / ``step_stream=False``). Failures raise the embedded
engine's :mod:`radixkv.errors` types; input the wire cannot carry is rejected here by the
engine's validators, after a ``Heartbeat`` so a stale session still raises
``StaleSessionError`` first. KV bytes never travel (:meth:`~RemoteCacheEngine.worker_buffers`
maps the pools). Leases: calls, :meth:`~RemoteCacheEngine.heartbeat` or a keep-alive stream.
``retries=N`` resends UNAVAILABLE / DEADLINE_EXCEEDED calls with the same request id (never
run twice). Local decode (default) answers reserve-only decode steps without an RPC.
``rpc_counts``: calls sent, by method. Thread-safe as gRPC channels are. The full story:
``docs/service.md``, "The client".
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from radixkv.service.client.channel import open_channel
from radixkv.service.client.keepalive import KeepAlive
from radixkv.service.client.local_decode import LocalDecodes, PendingCall, replay_request
from radixkv.service.client.step_lane import Replay, StepLane
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire._gen import cache_manager_pb2_grpc as pb_grpc
from radixkv.service.wire.auth import Token, resolve_token
from radixkv.service.wire.errors import ServiceUnavailableError, error_from_rpc
from radixkv.service.wire.request_id import REQUEST_ID_KEY
from radixkv.service.wire.shm import map_buffer
from radixkv.service.wire.step import REPLY_TYPES, StepRpcError, step_socket_path
from radixkv.service.wire.transport import DEFAULT_MAX_MESSAGE_BYTES, unix_socket_path

from radixkv import validation as V
from radixkv.engine.config import EngineConfig
from radixkv.engine.protocol import (
    AttachInfo,
    CacheResult,
    DecodeItem,
    DecodeResult,
    EngineStats,
    EvictResult,
    ExtendItem,
    ExtendResult,
    MatchInfo,
    MatchQuery,
    Session,
)
from radixkv.errors import InvalidArgumentError, RadixKVError

if TYPE_CHECKING:
    from radixkv.engine.buffers import WorkerBuffers

__all__ = ["RemoteCacheEngine", "KeepAlive", "connect"]

log = logging.getLogger(__name__)


class RemoteCacheEngine:
    """``CacheEngineAPI`` over gRPC (see the module doc). Build it with :func:`connect`.

    Args: ``channel``; ``token``; ``timeout_s`` (each call's deadline); ``address`` (for
    messages); ``retries`` / ``retry_backoff_s`` (resends of UNAVAILABLE / DEADLINE_EXCEEDED
    calls with the same request id, backoff doubled up to 1 s); ``step_stream`` (step calls on
    one ``Step`` stream, first try only; it holds one of the manager's ``max_concurrent_rpcs``);
    ``local_decode`` (answer reserve-only decode steps locally); ``step_socket`` (with a
    ``unix:`` address, the Step socket when the manager has one). Each argument:
    ``docs/service.md``, "The client".
    """

    def __init__(self, channel: grpc.Channel, token: Token, *, timeout_s: float = 30.0, address: str = "",
                 retries: int = 0, retry_backoff_s: float = 0.05, step_stream: bool = True,
                 local_decode: bool = True, step_socket: bool = True):
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise InvalidArgumentError(f"retries must be an int >= 0, got {retries!r}")
        for name, flag in (("step_stream", step_stream), ("local_decode", local_decode),
                           ("step_socket", step_socket)):
            if not isinstance(flag, bool):
                raise InvalidArgumentError(f"{name} must be a bool, got {flag!r}")
        self._channel = channel
        self._stub = pb_grpc.CacheManagerStub(channel)
        self._md = token.metadata()
        self._timeout = float(timeout_s)
        self.address = address
        self.retries = retries
        self.retry_backoff_s = float(retry_backoff_s)
        self.retried = 0  # calls sent again (for tests and soak reports)
        self._mapped: dict[tuple[int, str], Any] = {}
        self._keepalives: list[KeepAlive] = []
        #: The Step stream of this client (None: every call is a unary one).
        path = unix_socket_path(address) if step_socket else None
        self.steps: StepLane | None = StepLane(
            self._stub, self._md, self._timeout, socket_path=None if path is None else step_socket_path(path),
            token=token) if step_stream else None
        self.local = LocalDecodes(local_decode)  # the per-session tables of local decode steps
        self.rpc_counts: dict[str, int] = {}  # calls sent (retries not counted), by method name
        self._attached: dict[tuple[str, int], Session] = {}  # sessions close() detaches
        self._refs: dict[Any, pb.SessionRef] = {}  # the message of each session named lately

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: str, request: Any, request_id: str | None = None, idempotent: bool = True,
              replay: Replay | None = None) -> Any:
        """One call (``method``: its name); with ``idempotent`` it carries a
        request id (``request_id`` or a fresh one) and is retried with it on UNAVAILABLE /
        DEADLINE_EXCEEDED. With ``step_stream`` a step method's first try goes over the
        Step stream (see :mod:`radixkv.service.server.step_stream`), the rest over unary calls.
        ``replay`` (an ApplyDecodes request and its request id) rides on the stream message;
        a call that goes as a unary one sends it first as its own ApplyDecodes call."""
        stub_method = getattr(self._stub, method)
        self.rpc_counts[method] = self.rpc_counts.get(method, 0) + 1
        md = self._md
        rid = None
        if idempotent:
            rid = request_id or secrets.token_hex(12)
            md = md + ((REQUEST_ID_KEY, rid),)
        pause = self.retry_backoff_s
        for attempt in range(self.retries + 1):
            try:
                if attempt == 0 and self.steps is not None and rid is not None and method in REPLY_TYPES:
                    reply = self.steps.call(method, request, rid, replay)
                    if reply is not None:
                        return reply
                if replay is not None and not replay.applied:  # may have run: its id gets the kept reply
                    self._check_replay(self._call("ApplyDecodes", replay.request, request_id=replay.request_id))
                    replay.applied = True
                return stub_method(request, metadata=md, timeout=self._timeout)
            except grpc.RpcError as e:
                err = error_from_rpc(e)
                if not idempotent or attempt == self.retries or not isinstance(err, ServiceUnavailableError):
                    raise err from None
            self.retried += 1
            time.sleep(pause)
            pause = min(1.0, pause * 2)
        raise AssertionError("unreachable")  # pragma: no cover

    def _reject(self, session: Session, error: RadixKVError) -> NoReturn:
        """Input the wire cannot carry: check (and renew) the session first, as the engine
        does before validating, then raise ``error``."""
        self.heartbeat(session)
        raise error

    def _session(self, session: Session) -> pb.SessionRef:
        """``session`` as a message (checked); kept per session: the step calls name it each."""
        try:
            ref = self._refs.get(session)
        except TypeError:  # unhashable: not a Session
            ref = None
        if ref is None:
            ref = wire.session_to_msg(session)
            if len(self._refs) >= 64:
                self._refs.clear()
            self._refs[session] = ref
        return ref

    def _scall(self, session: Session, method: str, request: Any) -> Any:
        """A call of ``session``, after the replay of its pending local decodes (riding on
        the call when it goes over a Step stream whose manager runs such replays)."""
        ride = self.steps is not None and method in REPLY_TYPES and self.steps.rides_replay
        with self.local.guard(session, self._apply, ride) as calls:
            if not calls:
                return self._call(method, request)
            replay = Replay(replay_request(session, calls), secrets.token_hex(12))
            try:
                return self._call(method, request, replay=replay)
            finally:
                if replay.applied:  # also when the call itself then failed
                    self.local.replayed_calls += len(calls)

    def _apply(self, session: Session, calls: list[PendingCall]) -> None:
        self._check_replay(self._call("ApplyDecodes", replay_request(session, calls)))

    @staticmethod
    def _check_replay(resp: pb.ApplyDecodesResponse) -> None:
        if resp.HasField("error"):  # call k >= 1 failed, calls before it stay applied
            raise error_from_rpc(StepRpcError.from_msg(resp.error))

    # ------------------------------------------------------------------ sessions
    def attach(self, worker_name: str = "", *, pid: int | None = None) -> AttachInfo:
        """Open a session; ``layout`` is the manager's (each pool's ``mapping`` says how to
        map its bytes: ``{"mode": "shm", ...}`` or ``{"mode": "cuda_ipc", ...}``).

        ``pid``: the worker process the manager watches for quarantine (default this
        process; 0: unknown)."""
        if not isinstance(worker_name, str) or len(worker_name) > 256:
            raise InvalidArgumentError("worker_name must be a str of at most 256 characters")
        pid = os.getpid() if pid is None else pid
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 1 << 31:
            raise InvalidArgumentError(f"pid must be an int in [0, 2**31), got {pid!r}")
        # Mapping the pools (worker_buffers) needs modules a bare import of the client does not
        # load: the pool views and what EngineConfig's checks import. They load here, before the
        # session's lease starts, so that loading them never takes lease time.
        _load_pool_views()
        # A fresh nonce per attach (its retries send the same request): the manager keeps
        # Attach replies per nonce, so no other client's request id can get this session.
        resp = self._call("Attach", pb.AttachRequest(worker_name=worker_name, pid=pid,
                                                     client_nonce=secrets.token_bytes(16)))
        layout = json.loads(resp.layout_json)
        for m in resp.mappings:
            if m.pool not in layout.get("pools", {}):
                raise InvalidArgumentError(f"the manager sent a mapping for unknown pool {m.pool!r}")
            layout["pools"][m.pool]["mapping"] = wire.descriptor_to_dict(wire.mapping_from_msg(m))
        session = wire.session_from_msg(resp.session)
        self._attached[(session.session_id, session.epoch)] = session
        return AttachInfo(session, layout)

    def heartbeat(self, session: Session) -> float:
        """Renew the lease (pending local decodes stay pending)."""
        req = pb.HeartbeatRequest(session=self._session(session))
        with self.local.guard(session, None):
            return float(self._call("Heartbeat", req).lease_left_s)

    def detach(self, session: Session) -> None:
        """End the session; its pending local decodes are dropped, not replayed (the
        manager reclaims its requests, reserves included, either way)."""
        req = pb.DetachRequest(session=self._session(session))
        self.local.drop(session)
        self._call("Detach", req)
        self._attached.pop((session.session_id, session.epoch), None)

    def start_keepalive(self, session: Session, interval_s: float | None = None) -> KeepAlive:
        """Keep ``session`` alive from a background stream (every ``interval_s``, default
        a third of its lease). The manager detaches the session when the stream ends."""
        ref = self._session(session)
        interval = float(interval_s) if interval_s is not None else max(0.05, ref.lease_ttl_s / 3 or 1.0)
        ka = KeepAlive(self._stub, self._md, session, interval)
        self._keepalives.append(ka)
        return ka

    # ------------------------------------------------------------------ the step
    def match(self, session: Session, queries: Sequence[MatchQuery]) -> list[MatchInfo]:
        ref = self._session(session)
        try:
            qs = V.as_items(queries, MatchQuery, "queries")
            qs = [MatchQuery(V.check_tokens(q.token_ids, f"queries[{i}]", allow_empty=True),
                             V.check_extra_key(q.extra_key, f"queries[{i}]")) for i, q in enumerate(qs)]
        except InvalidArgumentError as e:
            self._reject(session, e)
        resp = self._scall(session, "Match", pb.MatchRequest(session=ref, queries=wire.match_queries_to_msg(qs)))
        return wire.match_infos_from_msg(resp, len(qs))

    def alloc_extend(self, session: Session, items: Sequence[ExtendItem]) -> list[ExtendResult]:
        ref = self._session(session)
        req = wire.plain_extend_request(ref, items)  # the common case, checked in C-level passes
        if req is None:  # anything else: item by item, with the engine's validators and messages
            try:
                its = V.as_items(items, ExtendItem, "items")
                V.check_rids([it.rid for it in its])
                its = [ExtendItem(it.rid, V.check_tokens(it.token_ids, f"items[{i}] ({it.rid!r})"),
                                  V.check_extra_key(it.extra_key, f"items[{i}]"),
                                  V.check_priority(it.priority, f"items[{i}]")) for i, it in enumerate(its)]
            except InvalidArgumentError as e:
                self._reject(session, e)
            req = wire.extend_request_to_msg(ref, its)
            items = its  # the validated items (a plain tuple entry became an ExtendItem)
        rids = [it[0] for it in items]
        resp = self._scall(session, "AllocExtend", req)
        results = wire.extend_results_from_msg(resp, rids)
        self.local.observe_extend(session, results)
        return results

    def alloc_decode(self, session: Session, items: Sequence[DecodeItem]) -> DecodeResult:
        self._session(session)
        local = self.local.try_local(session, items)  # checks what it answers: None for anything else
        if local is not None:
            return local
        try:
            its = V.as_items(items, DecodeItem, "items")
            V.check_rids([it.rid for it in its])
            for i, it in enumerate(its):  # an item is rebuilt only when its token id is not a plain int
                if type(it.token_id) is not int or not 0 <= it.token_id < 1 << 31:
                    its[i] = DecodeItem(it.rid, V.check_token_id(it.token_id, f"items[{i}] ({it.rid!r})"))
        except InvalidArgumentError as e:
            self._reject(session, e)
        local = self.local.try_local(session, its)
        if local is not None:
            return local
        resp = self._scall(session, "AllocDecode", wire.decode_items_to_msg(session, its))
        result = wire.decode_result_from_msg(resp, len(its))
        self.local.observe_decode(session, [it.rid for it in its], result)
        return result

    def _rids(self, session: Session, rids: Sequence[str]) -> list[str]:
        try:
            return V.check_rids(rids)
        except InvalidArgumentError as e:
            self._reject(session, e)

    def cache_unfinished(self, session: Session, rids: Sequence[str]) -> list[CacheResult]:
        req = pb.CacheRequest(session=self._session(session), rids=self._rids(session, rids))
        return wire.cache_results_from_msg(self._scall(session, "CacheUnfinished", req), req.rids)

    def cache_finished(self, session: Session, rids: Sequence[str]) -> list[CacheResult]:
        req = pb.CacheRequest(session=self._session(session), rids=self._rids(session, rids))
        results = wire.cache_results_from_msg(self._scall(session, "CacheFinished", req), req.rids)
        self.local.forget(session, req.rids)
        return results

    def release(self, session: Session, rids: Sequence[str]) -> None:
        req = pb.ReleaseRequest(session=self._session(session), rids=self._rids(session, rids))
        self._scall(session, "Release", req)
        self.local.forget(session, req.rids)

    def evict(self, session: Session, num_tokens: int, num_states: int = 0) -> EvictResult:
        ref = self._session(session)
        try:
            n, s = V.check_count(num_tokens, "num_tokens"), V.check_count(num_states, "num_states")
            if n >= 1 << 63 or s >= 1 << 63:
                raise InvalidArgumentError("num_tokens / num_states must fit in int64")
        except InvalidArgumentError as e:
            self._reject(session, e)
        return wire.evict_result_from_msg(
            self._scall(session, "Evict", pb.EvictRequest(session=ref, num_tokens=n, num_states=s)))

    # ------------------------------------------------------------------ stats / admin
    def stats(self, session: Session | None = None) -> EngineStats:
        if session is None:  # the whole engine: every session's replay first
            self.local.flush_all(self._apply)
            return wire.stats_from_msg(self._call("Stats", pb.StatsRequest(), idempotent=False))
        return wire.stats_from_msg(self._scall(session, "Stats", pb.StatsRequest(session=self._session(session))))

    def flush(self, session: Session) -> bool:
        return bool(self._scall(session, "Flush", pb.FlushRequest(session=self._session(session))).flushed)

    def take_events(self, session: Session, max_events: int = 0) -> list[dict[str, Any]]:
        ref = self._session(session)
        try:
            n = V.check_count(max_events, "max_events")
            if n >= 1 << 63:
                raise InvalidArgumentError("max_events must fit in int64")
        except InvalidArgumentError as e:
            self._reject(session, e)
        resp = self._scall(session, "TakeEvents", pb.TakeEventsRequest(session=ref, max_events=n))
        from radixkv.service.wire.events import event_from_msg  # KV, state events and gap markers

        return [event_from_msg(e) for e in resp.events]

    def watch_events(self, session: Session, poll_interval_s: float = 0.0, start_seq: int | None = 0,
                     with_seq: bool = False) -> Iterator[Any]:
        """The manager's events as a server stream (cancel by closing the iterator or the
        client), dicts as ``take_events`` gives them (hybrid state events and the
        ``{"type": "EventsLost", "first_seq", "count"}`` gap marker included), or ``(seq,
        dict)`` pairs with ``with_seq``. ``start_seq``: the first event wanted (0: from the
        manager's start as far as its ring holds; ``None``: only events after subscribing).
        The stream has its own cursor: other watchers and ``take_events`` do not take its
        events. Raises the mapped error when the stream fails."""
        from radixkv.service.wire.events import event_from_msg  # KV, state events and gap markers

        if start_seq is not None and (isinstance(start_seq, bool) or not isinstance(start_seq, int)
                                      or not 0 <= start_seq < 1 << 64):
            raise InvalidArgumentError(f"start_seq must be an int in [0, 2**64) or None, got {start_seq!r}")
        req = pb.WatchEventsRequest(session=self._session(session), poll_interval_s=float(poll_interval_s),
                                    start_seq=start_seq or 0, from_now=start_seq is None)
        self.local.flush(session, self._apply)
        call = self._stub.WatchEvents(req, metadata=self._md)
        try:
            for msg in call:
                yield (int(msg.seq), event_from_msg(msg)) if with_seq else event_from_msg(msg)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise error_from_rpc(e) from None
        finally:
            call.cancel()

    def check_invariants(self) -> None:
        """The manager's engine and shared buffers agree (raises ``InvariantError``)."""
        self.local.flush_all(self._apply)
        self._call("CheckInvariants", pb.CheckInvariantsRequest(), idempotent=False)

    # ------------------------------------------------------------------ buffers
    def worker_buffers(self, info: AttachInfo) -> WorkerBuffers:
        """``WorkerBuffers`` aliasing the manager's pools (each pool mapped once per epoch)."""
        from radixkv.engine.buffers import attach_buffers

        layout = info.layout
        epoch = int(info.session.epoch)
        for key in [k for k in self._mapped if k[0] != epoch]:  # an old manager's pools: unmap
            del self._mapped[key]
        buffers = {}
        for name, pool in layout["pools"].items():
            desc = wire.descriptor_from_dict(pool.get("mapping") or {})
            if desc is None:
                raise InvalidArgumentError(f"pool {name!r} has no shared mapping (mode "
                                           f"{(pool.get('mapping') or {}).get('mode')!r})")
            key = (int(info.session.epoch), name)
            if key not in self._mapped:
                self._mapped[key] = map_buffer(desc)
            buffers[name] = self._mapped[key]
        wb = attach_buffers(layout, buffers)
        self.local.map_req_to_token(epoch, wb.req_to_token)  # local decodes write their rows there
        return wb

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Detach the sessions this client attached and has not detached, stop keep-alive
        streams and the Step stream, close the channel. Pending local decodes are replayed
        first (best effort: logged on failure); a session the manager no longer knows (its
        lease ran out, the manager restarted) is skipped, as is an unreachable manager (it
        reclaims the session when the lease runs out). Idempotent."""
        self.local.close(self._apply)
        for key, session in list(self._attached.items()):
            self._attached.pop(key, None)
            try:
                self.detach(session)
            except RadixKVError as e:
                log.debug("close(): session %s not detached: %s", session.session_id, e)
        for ka in self._keepalives:
            ka.stop()
        self._keepalives.clear()
        if self.steps is not None:
            self.steps.close()
        self._channel.close()

    def __enter__(self) -> RemoteCacheEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteCacheEngine({self.address!r})"


def _load_pool_views() -> None:
    """Import what :meth:`RemoteCacheEngine.worker_buffers` needs (once per process; O(1) after)."""
    from radixkv.engine.buffers import attach_buffers  # noqa: F401

    EngineConfig()  # its checks import the dtype and eviction-policy tables


def connect(address: str, token: str | None = None, *, token_file: str | None = None,
            timeout_s: float = 30.0, wait_s: float = 10.0, retries: int = 0, tls_ca: str | None = None,
            tls_cert: str | None = None, tls_key: str | None = None,
            tls_server_name: str | None = None,
            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, step_stream: bool = True,
            local_decode: bool = True, step_socket: bool = True) -> RemoteCacheEngine:
    """A client of the manager at ``address`` (``unix:///dir/s.sock`` or ``host:port``).

    The token comes from ``token``, ``token_file`` or ``$RADIXKV_TOKEN``; ``tls_ca`` (with
    ``tls_cert``/``tls_key``) makes the channel TLS. Waits up to ``wait_s`` for the channel.
    ``retries``, ``step_stream``, ``local_decode``, ``step_socket``: as
    :class:`RemoteCacheEngine` (all on by default but ``retries``).

    Raises ``InvalidArgumentError`` (no/short token, unreadable TLS file) or
    ``ServiceUnavailableError`` (nothing answers within ``wait_s``).
    """
    tok = resolve_token(token, token_file)
    channel = open_channel(address, wait_s=wait_s, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
                           tls_server_name=tls_server_name, max_message_bytes=max_message_bytes)
    return RemoteCacheEngine(channel, tok, timeout_s=timeout_s, address=address, retries=retries,
                             step_stream=step_stream, local_decode=local_decode, step_socket=step_socket)
