"""The cache-manager server: one process owns the engine, its shared pools, and the gRPC port.

Start-up (:class:`CacheManagerServer`): stale pool files are removed, each pool's buffer is
allocated once as shared memory (:class:`~radixkv.service.wire.shm.SharedBuffers`) and handed
to the engine, then ``grpc.aio`` starts with the auth interceptor, the ``CacheManager`` and
health services. It listens on a Unix socket (or TCP with TLS; :mod:`~radixkv.service.server.listen`)
and, beside it, the Step socket (:mod:`~radixkv.service.server.step_socket`). One event loop
owns the engine (no lock); a sweeper reclaims expired leases (quarantining, see
:mod:`~radixkv.service.server.quarantine`), refreshes metrics and audits when idle. At most
``max_concurrent_rpcs`` calls are in flight (streams included), beyond it RESOURCE_EXHAUSTED
at once. The event hub is pumped by every call, poll, sweep and the ZMQ pump task. Shutdown
(:meth:`CacheManagerServer.stop`): NOT_SERVING, drain for ``grace_s``, reclaim sessions,
publish ``AllBlocksCleared``, remove the shared-memory and socket files. Sizing the call
limit and each step: ``docs/service.md``, "The server, start to stop".
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc
from radixkv.service.server.auth import DEFAULT_HEALTH_BUDGET, TokenAuthInterceptor
from radixkv.service.server.event_hub import DEFAULT_RING_SIZE, EventHub, engine_event_source
from radixkv.service.server.event_outlets import EventOutlets
from radixkv.service.server.exposure import exposure_warnings
from radixkv.service.server.listen import bind, default_address
from radixkv.service.server.loop_clock import LoopClock
from radixkv.service.server.metrics import ServiceMetrics
from radixkv.service.server.periodic_count import PeriodicCount
from radixkv.service.server.servicer import SERVICE_NAME, CacheManagerServicer, add_to_server, encode_record
from radixkv.service.server.step_socket import MIN_FRAME_RATE, StepSocketServer
from radixkv.service.wire import codec as wire
from radixkv.service.wire.auth import Token
from radixkv.service.wire.limits import CallLimits
from radixkv.service.wire.shm import SharedBuffers, remove_stale_files
from radixkv.service.wire.step import step_socket_path
from radixkv.service.wire.transport import DEFAULT_MAX_MESSAGE_BYTES

from radixkv.engine import CacheEngine, EngineConfig, plan_arenas
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.events.zmq_flags import PublisherConfig

__all__ = ["CacheManagerServer", "ServeOptions", "serve", "raise_fd_limit", "DEFAULT_MAX_CONCURRENT_RPCS",
           "DEFAULT_QUARANTINE_S", "DEFAULT_HANDSHAKE_TIMEOUT_S",
           "DEFAULT_EVENTS_INTERVAL_S"]

log = logging.getLogger("radixkv.service")

DEFAULT_MAX_CONCURRENT_RPCS = 256
#: On by default: a session whose lease ran out (or whose keep-alive stream dropped) while its
#: worker process still runs may still be written by that (paused) worker, so what it held is
#: not reused until the process is gone, or for at most this long. ``--quarantine-s 0`` turns
#: it off (a lease then means exactly what it says).
DEFAULT_QUARANTINE_S = 30.0
#: A connection that has not completed its handshake (for plaintext: sent nothing) within
#: this long is closed by gRPC (``grpc.server_handshake_timeout_ms``; its default is 120 s, and
#: 300 silent connections held that long kept every client out at a 256-fd limit). gRPC offers
#: no hook to count these closes, so they are not logged.
DEFAULT_HANDSHAKE_TIMEOUT_S = 5.0
#: How often the pump task hands new events to the ZMQ outlet (its added latency at most).
DEFAULT_EVENTS_INTERVAL_S = 0.005


class ServeOptions(NamedTuple):
    """How the server listens and behaves (the engine's shape is the ``EngineConfig``)."""

    address: str = default_address()  # this user's socket directory (listen.default_socket_dir)
    shm_dir: str | None = None  # default /dev/shm (else the temp dir)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 5.0
    sweep_interval_s: float = 1.0
    reflection: bool = False
    metrics_port: int | None = None  # None: no Prometheus endpoint; 0: any free port
    metrics_addr: str = "127.0.0.1"
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None  # given: clients must present a certificate it signed
    allow_insecure_tcp: bool = False
    check_idle: bool = False
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS  # in flight at once, streams included
    quarantine_s: float = DEFAULT_QUARANTINE_S  # 0: off, reclaim expired sessions at once
    kv_events: PublisherConfig | None = None  # the ZMQ outlet (vLLM wire); None: off
    events_ring_size: int = DEFAULT_RING_SIZE  # events the hub keeps for watchers / TakeEvents
    events_interval_s: float = DEFAULT_EVENTS_INTERVAL_S  # pump period while the ZMQ outlet is on
    call_limits: CallLimits | None = None  # entries/tokens per call; None: sized from the pool
    operator_token: Token | None = None  # given: Flush / Evict / CheckInvariants need it (server/auth.py)
    health_rpcs: int = DEFAULT_HEALTH_BUDGET  # unauthenticated health calls in flight, on top of the limit
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S  # a connection silent that long is closed
    step_socket: bool = True  # the Step socket beside a unix: gRPC socket (server/step_socket.py)


class CacheManagerServer:
    """One cache manager: engine + shared buffers + gRPC server. Use from one event loop.

    Args:
        config: the engine config (device, pool sizes, model shape, policies, lease TTL).
        token: the auth token every RPC but health must present.
        options: :class:`ServeOptions`.
        clock, epoch: passed to the engine (tests inject a clock). Without a clock the leases
            run on a :class:`~radixkv.service.server.loop_clock.LoopClock` (``lease_clock``):
            the manager's own stalls do not count against a worker's lease.

    Raises (constructor) ``InvalidArgumentError`` for a bad config, an unusable shared-
    memory directory, or a CUDA device without CUDA. Nothing is left behind when it raises.
    """

    def __init__(self, config: EngineConfig, token: Token, options: ServeOptions = ServeOptions(), *,  # noqa: B008 (an immutable NamedTuple)
                 clock: Callable[[], float] | None = None, epoch: int | None = None):
        if not isinstance(token, Token):
            raise InvalidArgumentError("token must be a radixkv.service.wire.auth.Token")
        _check_options(options)
        if options.operator_token is not None and options.operator_token.matches(token.reveal()):
            raise InvalidArgumentError("the operator token must differ from the workers' token")
        if options.kv_events is not None and not config.enable_kv_events:
            raise InvalidArgumentError("the ZMQ event outlet (--kv-events-endpoint) needs --enable-kv-events")
        self.config = config
        self.options = options
        self.metrics = ServiceMetrics()
        self.shared = SharedBuffers(config.device, options.shm_dir,
                                    prefix=f"radixkv-{os.getpid()}-{secrets.token_hex(4)}")
        if self.shared.device.type == "cpu":
            stale = remove_stale_files(self.shared.shm_dir)
            if stale:
                log.warning("removed %d pool file(s) of managers that are no longer running", len(stale))
        self.lease_clock: LoopClock | None = None
        if clock is None:
            clock = self.lease_clock = LoopClock()
        try:
            plans = plan_arenas(config)
            self.shared.check_space(sum(p.total_bytes for p in plans.values()))
            for name, plan in plans.items():
                self.shared.allocate(name, plan.total_bytes)
            mappings = {n: wire.descriptor_to_dict(d) for n, d in self.shared.descriptors.items()}
            self.engine = CacheEngine(config, clock=clock, epoch=epoch, buffers=dict(self.shared.buffers),
                                      mappings=mappings)
        except BaseException:
            self.shared.close()
            raise
        self._token = token
        self._reject_log = PeriodicCount(self._log_rejected)
        self._closing: asyncio.Event | None = None
        self._server: grpc.aio.Server | None = None
        self._health: Any = None
        self._sweeper: asyncio.Task[None] | None = None
        self.events: EventHub | None = None
        self.outlets: EventOutlets | None = None
        self._socket_path: str | None = None
        self.step_socket: StepSocketServer | None = None
        self.servicer: CacheManagerServicer | None = None
        self.address: str | None = None
        self.metrics_port: int | None = None
        self._stopped = False
        #: Why the manager cannot go on (a pool file shrunk under it), once it is so; ``serve``
        #: then stops it and exits 1.
        self.failure: str | None = None
        self.failed = asyncio.Event()

    # ------------------------------------------------------------------ start
    async def start(self) -> str:
        """Bind and start serving; returns the address clients use (the real port for TCP
        port 0). Must run on the loop that will own the engine."""
        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        o = self.options
        self._closing = asyncio.Event()
        self.events = EventHub(engine_event_source(self.engine), int(o.events_ring_size), encode=encode_record)
        self.servicer = CacheManagerServicer(self.engine, self.shared, self.metrics, self._closing,
                                             quarantine_s=float(o.quarantine_s), events=self.events,
                                             limits=o.call_limits, operator_token=o.operator_token)
        n = int(o.max_message_bytes)
        # a gRPC Step message gets the deadline of the largest Step-socket frame (step_stream.py)
        self.servicer.step_streams.read_deadline_s = float(o.handshake_timeout_s) + n / MIN_FRAME_RATE
        auth = TokenAuthInterceptor(self._token, on_reject=self._rejected, operator_token=o.operator_token,
                                    health_budget=o.health_rpcs, call_budget=int(o.max_concurrent_rpcs))
        self._server = grpc.aio.server(
            interceptors=[auth],
            options=[("grpc.max_receive_message_length", n), ("grpc.max_send_message_length", n),
                     ("grpc.so_reuseport", 0),
                     ("grpc.server_handshake_timeout_ms", max(1, int(float(o.handshake_timeout_s) * 1000)))],
            # gRPC's own limit counts calls from their arrival (queued ones too) and bounds the
            # sum; the budgets (server/auth.py) split it: health calls never take more than
            # theirs, so a worker always has --max-concurrent-rpcs
            maximum_concurrent_rpcs=int(o.max_concurrent_rpcs) + int(o.health_rpcs))
        add_to_server(self.servicer, self._server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        if o.reflection:
            from grpc_reflection.v1alpha import reflection

            reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                                self._server)
        try:
            # the ZMQ sockets open before the port: a bad endpoint fails the start
            self.outlets = EventOutlets(self.events, o.kv_events, o.events_interval_s,
                                        clear_at_close=self.config.enable_kv_events)
            bound = bind(self._server, o)
            self._socket_path = bound.socket_path
            self.address = bound.address
            await self._server.start()
            if o.step_socket and bound.socket_path is not None:
                self.step_socket = StepSocketServer(
                    self.servicer, self._token, operator_token=o.operator_token, call_budget=auth.calls,
                    max_message_bytes=n, handshake_timeout_s=float(o.handshake_timeout_s),
                    on_reject=self._rejected, on_refused=self.metrics.step_socket_refused)
                await self.step_socket.start(step_socket_path(bound.socket_path))
        except BaseException:
            if self.outlets is not None:
                self.outlets.close_publisher()
            await self._cleanup_files()
            raise
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if o.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(int(o.metrics_port), o.metrics_addr)
        self.metrics.update(self.engine.stats())
        self._sweeper = asyncio.ensure_future(self._sweep_loop())
        if self.lease_clock is not None:
            self.lease_clock.start()
        self.outlets.start(self._closing)
        log.info("%s", self.startup_line())
        for exposure in exposure_warnings(o):
            log.warning("exposed: %s", exposure)
        return self.address

    def startup_line(self) -> str:
        """What the manager logs once listening: version, address, pool shape and policies,
        the metrics endpoint and the event outlets."""
        from radixkv import __version__

        c, o = self.config, self.options
        metrics = (f"http://{o.metrics_addr}:{self.metrics_port}/metrics" if self.metrics_port is not None
                   else "off (--metrics-port)")
        outlets = ["gRPC WatchEvents/TakeEvents"] if c.enable_kv_events else []
        if o.kv_events is not None:
            outlets.append(f"ZMQ {o.kv_events.endpoint}")
        step = f" (Step socket {self.step_socket.path})" if self.step_socket is not None else ""
        return (f"radixkv {__version__} cache manager listening on {self.address}{step}: device {c.device}, "
                f"{c.kv_tokens} KV tokens, page size {c.page_size}, eviction {c.eviction_policy}, admission "
                f"{c.admission_policy}, epoch {self.engine.epoch}; metrics {metrics}; KV events "
                f"{' + '.join(outlets) if outlets else 'off (--enable-kv-events)'}")

    def _rejected(self, method: str) -> None:
        self.metrics.auth_failed(method)
        self._reject_log.add(method)

    @staticmethod
    def _log_rejected(n: int, last: str) -> None:
        log.info("rejected %d call(s) with a missing or wrong auth token (the last to %s)", n, last)

    # ------------------------------------------------------------------ run
    async def _sweep_loop(self) -> None:
        interval = max(0.01, float(self.options.sweep_interval_s))
        closing = self._closing
        if closing is None:
            raise RuntimeError("the sweeper runs only after start()")
        while not closing.is_set():
            try:
                await asyncio.wait_for(closing.wait(), timeout=interval)
            except asyncio.TimeoutError:
                pass
            if closing.is_set():
                return
            self.sweep_once()

    def sweep_once(self) -> None:
        """Reclaim expired leases (quarantine those whose worker may still run, release the
        quarantined ones that are safe), refresh the metrics snapshot, check invariants at idle."""
        sv, events = self.servicer, self.events
        if sv is None or events is None:
            raise RuntimeError("sweep_once() runs only after start()")
        broken = self.shared.repair_truncated()
        if broken and self.failure is None:
            self.failure = "; ".join(broken)
            log.critical("a pool file was shrunk under the running manager (another process of this user "
                         "truncated it): %s. Its contents are lost (now zeros): stopping; restart the manager",
                         self.failure)
            self.failed.set()
        expired, released = sv.housekeeping()
        if expired:
            log.info("lease expired for %d session(s); everything they held was reclaimed", len(expired))
        if released:
            log.info("released %d quarantined session(s)", len(released))
        events.pump()  # bounds what waits in the tree's queue when nobody reads events
        stats = self.engine.stats()
        self.metrics.update(stats)
        self.metrics.update_tiers(self.engine.tier_stats())
        self.metrics.update_reliability(sv.quarantine.stats(), sv.replies.bytes, sv.replies.hits)
        if self.options.check_idle and stats.requests == 0 and not sv.idle_failures:
            try:
                sv.check_all()
            except InvariantError as e:
                sv.idle_failures.append(str(e))
                log.error("invariant broken at idle: %s", e)

    async def wait_closed(self) -> None:
        """Until the server has stopped."""
        if self._server is not None:
            await self._server.wait_for_termination()

    # ------------------------------------------------------------------ stop
    async def stop(self, grace_s: float | None = None) -> None:
        """Graceful shutdown (idempotent): NOT_SERVING, streams end, calls drain within
        ``grace_s`` (default the option), every session is reclaimed, files removed."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.options.grace_s if grace_s is None else grace_s
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._closing is not None:
            self._closing.set()
        if self.step_socket is not None:  # its connections end now; workers fall back to gRPC
            await self.step_socket.stop()
        if self._server is not None:
            await self._server.stop(grace)
        if self._sweeper is not None:
            self._sweeper.cancel()
            try:
                await self._sweeper
            except asyncio.CancelledError:
                pass
        if self.outlets is not None:
            await self.outlets.stop_pumping()
        if self.lease_clock is not None:
            await self.lease_clock.stop()
        n = len(self.engine.sessions)
        self.engine.close()
        if self.servicer is not None:
            self.servicer.quarantine.close()
        if self.outlets is not None:
            self.outlets.close()  # pump what is left, AllBlocksCleared, close the ZMQ sockets
        self._reject_log.flush()
        log.info("shut down: %d session(s) revoked", n)
        self.metrics.stop_http()
        await self._cleanup_files()

    async def _cleanup_files(self) -> None:
        if self.step_socket is not None:
            await self.step_socket.stop()
        self.shared.close()
        if self._socket_path is not None:
            try:
                os.unlink(self._socket_path)
            except FileNotFoundError:
                pass


def _check_options(o: ServeOptions) -> None:
    """Raises ``InvalidArgumentError`` naming the first unusable option."""
    if isinstance(o.max_message_bytes, bool) or not isinstance(o.max_message_bytes, int) \
            or o.max_message_bytes < 4096:
        raise InvalidArgumentError(f"max_message_bytes must be an int >= 4096, got {o.max_message_bytes!r}")
    for name in ("grace_s", "sweep_interval_s"):
        v = getattr(o, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e6:
            raise InvalidArgumentError(f"{name} must be a number in [0, 1e6), got {v!r}")
    if o.sweep_interval_s <= 0:
        raise InvalidArgumentError("sweep_interval_s must be > 0")
    m = o.max_concurrent_rpcs
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= 1 << 20:
        raise InvalidArgumentError(f"max_concurrent_rpcs must be an int in [1, 2**20], got {m!r}")
    q = o.quarantine_s
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 <= q < 1e9:
        raise InvalidArgumentError(f"quarantine_s must be a number in [0, 1e9), got {q!r}")
    if o.metrics_port is not None and not (isinstance(o.metrics_port, int) and 0 <= o.metrics_port < 65536):
        raise InvalidArgumentError(f"metrics_port must be a port number, got {o.metrics_port!r}")
    if not isinstance(o.address, str) or not o.address:
        raise InvalidArgumentError("address must be a non-empty string")
    r = o.events_ring_size
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 1 << 26:
        raise InvalidArgumentError(f"events_ring_size must be an int in [1, 2**26], got {r!r}")
    e = o.events_interval_s
    if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 60:
        raise InvalidArgumentError(f"events_interval_s must be a number in (0, 60], got {e!r}")
    if o.call_limits is not None and not (isinstance(o.call_limits, CallLimits) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in o.call_limits)):
        raise InvalidArgumentError(f"call_limits must be a CallLimits of ints >= 1, got {o.call_limits!r}")
    t = o.handshake_timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
        raise InvalidArgumentError(f"handshake_timeout_s must be a number in (0, 3600], got {t!r}")
    h = o.health_rpcs
    if isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= 1 << 16:
        raise InvalidArgumentError(f"health_rpcs must be an int in [1, 65536], got {h!r}")
    if not isinstance(o.step_socket, bool):
        raise InvalidArgumentError(f"step_socket must be a bool, got {o.step_socket!r}")
    if o.operator_token is not None and not isinstance(o.operator_token, Token):
        raise InvalidArgumentError("operator_token must be a radixkv.service.wire.auth.Token or None")
    if o.kv_events is not None and not isinstance(o.kv_events, PublisherConfig):
        raise InvalidArgumentError("kv_events must be a radixkv.events.zmq_flags.PublisherConfig or None")


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open descriptors to the hard one (every worker holds
    a few; a 1,024 default runs out first). Returns the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if resource.RLIM_INFINITY in (soft, hard) or soft >= hard:  # nothing to raise, or no number to raise to
        return int(soft)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard, e)
        return int(soft)
    log.info("descriptor limit raised from %d to %d", soft, hard)
    return int(hard)


async def serve(config: EngineConfig, token: Token, options: ServeOptions = ServeOptions(),  # noqa: B008
                on_ready: Callable[[CacheManagerServer], None] | None = None) -> int:
    """Run a server until SIGTERM/SIGINT, then shut down gracefully. Returns 0, or 1 when the
    manager stopped because it could not go on (:attr:`CacheManagerServer.failure`)."""
    raise_fd_limit()
    server = CacheManagerServer(config, token, options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        if on_ready is not None:
            on_ready(server)
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.failed.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if server.failure is None:
            log.info("signal received: shutting down (grace %.1f s)", options.grace_s)
    finally:
        await server.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return 0 if server.failure is None else 1
