"""The manager's Step socket: the Step stream's messages without gRPC.

The wire format is :mod:`radixkv.service.wire.step`'s; each message runs exactly as on the gRPC
Step stream (:func:`answer_step`: same parser, limits, session checks, reply cache and
metrics); the worker's side is :mod:`radixkv.service.client.step_socket`. Each connection is one
task on the manager's event loop (no thread hand-off per frame).

What a connection may hold is bounded before it is trusted: a hello within
``handshake_timeout_s`` (at most :data:`MAX_PENDING` waiting), the workers' or operator's token,
one slot of the call budget while open, frames of at most ``max_message_bytes`` arriving at
:data:`MIN_FRAME_RATE`, partial bytes capped across connections, unread replies drained within
``handshake_timeout_s``; at EMFILE the accept loop backs off. Each refusal is counted
(:attr:`StepSocketServer.refused`, by reason) and logged. The socket file is 0600 in a 0700
directory; at :meth:`StepSocketServer.stop` every connection ends and workers fall back to gRPC.
Each rule in full: ``docs/service.md`` ("The Step socket server").
"""
from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError
from radixkv.service.server.listen import prepare_unix_socket
from radixkv.service.server.periodic_count import PeriodicCount
from radixkv.service.server.step_stream import answer_step
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire.auth import Token
from radixkv.service.wire.errors import ServiceUnavailableError, status_of
from radixkv.service.wire.step import FRAME, HELLO_MAX_BYTES, SOCKET_VERSION, error_to_msg

from radixkv import errors as E

if TYPE_CHECKING:
    from radixkv.service.server.auth import CallBudget
    from radixkv.service.server.servicer import CacheManagerServicer

__all__ = ["StepSocketServer", "MAX_PENDING", "MIN_FRAME_RATE"]

log = logging.getLogger("radixkv.service")

#: Connections that may wait for their hello at once.
MAX_PENDING = 64
#: Unsent reply bytes of one connection above which its task waits for the socket to drain.
_HIGH_WATER = 1 << 20
#: The slowest a frame may arrive (bytes/s) on top of the handshake timeout: a 64 MiB frame
#: gets 16 s more. A worker on the same host sends at GB/s.
MIN_FRAME_RATE = 4 << 20
#: How often the watchdog looks for frames past their deadline.
_WATCH_S = 0.1
#: The accept loop's back-off at the descriptor limit.
_ACCEPT_BACKOFF_S = (0.05, 1.0)
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

_ACCEPTED = pb.StepResponse(reply=b"", rides_replay=True).SerializeToString()


class _Refused(Exception):
    """Ends a connection: ``why`` is counted; ``error`` (when given) is answered first."""

    def __init__(self, why: str, error: E.RadixKVError | None = None):
        super().__init__(why)
        self.why, self.error = why, error


def _same(protocol: asyncio.StreamReaderProtocol) -> asyncio.StreamReaderProtocol:
    return protocol


class _Conn:
    """What the watchdog sees of one connection: the frame being read (since when, how big)
    and since when its replies wait for the worker to read them."""

    __slots__ = ("transport", "since", "size", "writing_since")

    def __init__(self, transport: asyncio.WriteTransport):
        self.transport = transport
        self.since = 0.0  # 0: not inside a frame
        self.size = 0
        self.writing_since = 0.0  # 0: not waiting for the worker to read


class StepSocketServer:
    """The Step socket of one manager; :meth:`start` on the manager's loop, :meth:`stop` at shutdown.

    Args: ``servicer`` (the manager's ``CacheManagerServicer``, runs each message); ``token`` /
    ``operator_token`` (the workers' / the operator's, or None); ``call_budget`` (the auth
    interceptor's budget of calls in flight, ``in_flight`` / ``limit``, or None for no limit);
    ``max_message_bytes`` (the longest frame accepted); ``handshake_timeout_s`` (how long a
    connection may take to send its hello; also the base of a frame's deadline and how long unread
    replies may wait); ``partial_bytes_cap`` (bytes of frames still arriving, summed over
    connections; None: 2 x ``max_message_bytes``); ``on_reject`` (told ``"Step"`` for every hello
    with a wrong token: metrics, logs); ``on_refused`` (told the reason of every connection closed
    by a rule: metrics).
    """

    def __init__(self, servicer: CacheManagerServicer, token: Token, *, operator_token: Token | None,
                 call_budget: CallBudget | None, max_message_bytes: int, handshake_timeout_s: float,
                 partial_bytes_cap: int | None = None,
                 on_reject: Callable[[str], None] | None = None, on_refused: Callable[[str], None] | None = None):
        self.servicer, self._token, self._operator = servicer, token, operator_token
        self._budget = call_budget
        self._max = int(max_message_bytes)
        self._timeout = float(handshake_timeout_s)
        self.partial_cap = 2 * self._max if partial_bytes_cap is None else int(partial_bytes_cap)
        self.partial_bytes = 0  # bytes announced by frames still arriving
        self.write_timeout_s = self._timeout  # how long unread replies may wait (read at each check)
        self._on_reject, self._on_refused = on_reject, on_refused
        self._listener: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []  # the accept loop and the watchdog
        self._stopping = False
        self._conns: set[asyncio.Task[Any]] = set()
        self._reading: dict[asyncio.Task[Any], _Conn] = {}
        self.path: str | None = None
        self.pending = 0  # connections waiting for their hello
        self.open = 0  # accepted connections
        self.frames = 0  # messages answered
        self.refused: Counter[str] = Counter()
        self._log = PeriodicCount(self._log_refused)
        self._fd_log = PeriodicCount(self._log_fd_limit)

    async def start(self, path: str) -> str:
        """Listen on ``path`` (a stale socket file there is replaced, a live one refused:
        ``InvalidArgumentError``). Returns the absolute path."""
        path = prepare_unix_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the file is born 0600: no window where others may connect
        try:
            sock.bind(path)
            sock.listen(128)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        self._listener, self.path = sock, path
        self._tasks = [asyncio.ensure_future(self._accept_loop(sock)), asyncio.ensure_future(self._watchdog())]
        return path

    async def _accept_loop(self, sock: socket.socket) -> None:
        """Accept connections; at the descriptor limit back off (doubling), count, log."""
        loop = asyncio.get_running_loop()
        backoff = _ACCEPT_BACKOFF_S[0]
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:
                if e.errno not in _OUT_OF_FDS:
                    raise
                self.refused["fd_limit"] += 1
                if self._on_refused is not None:
                    self._on_refused("fd_limit")
                self._fd_log.add(os.strerror(e.errno or 0))
                await asyncio.sleep(backoff)
                backoff = min(_ACCEPT_BACKOFF_S[1], backoff * 2)
                continue
            backoff = _ACCEPT_BACKOFF_S[0]
            reader = asyncio.StreamReader(loop=loop)
            protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
            try:
                transport, _ = await loop.connect_accepted_socket(functools.partial(_same, protocol), conn)
            except OSError:
                conn.close()
                continue
            writer = asyncio.StreamWriter(transport, protocol, reader, loop)
            task = asyncio.ensure_future(self._serve(reader, writer))
            self._conns.add(task)

    async def _watchdog(self) -> None:
        """Abort connections whose frame is past its deadline (``frame_timeout``) or whose
        unread replies waited longer than ``write_timeout_s`` (``write_timeout``). O(open
        connections) every 100 ms."""
        while True:
            await asyncio.sleep(_WATCH_S)
            now = time.monotonic()
            for c in list(self._reading.values()):
                if c.since and now - c.since > self._timeout + c.size / MIN_FRAME_RATE:
                    c.since = 0.0
                    self._count("frame_timeout")
                    c.transport.abort()
                elif c.writing_since and now - c.writing_since > self.write_timeout_s:
                    c.writing_since = 0.0
                    self._count("write_timeout")
                    c.transport.abort()  # the unsent replies are dropped

    async def stop(self) -> None:
        """Close the listener and every connection, remove the socket file (idempotent)."""
        self._stopping = True
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        tasks = list(self._conns)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._log.flush()
        self._fd_log.flush()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    # ------------------------------------------------------------------ one connection
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:  # always: the accept loop runs this as a task
            self._conns.add(task)
            self._reading[task] = _Conn(writer.transport)
        held = False
        try:
            operator = await self._hello(reader)
            budget = self._budget
            if budget is not None:
                if budget.in_flight >= budget.limit:
                    budget.refused += 1
                    raise _Refused("call_limit", E.CapacityError(
                        f"Step socket: more than {budget.limit} calls in flight"))
                budget.in_flight += 1
            held = True
            self.open += 1
            writer.write(FRAME.pack(len(_ACCEPTED)) + _ACCEPTED)
            await self._frames(reader, writer, operator)
        except _Refused as r:
            self._refuse(r, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker went away (or the watchdog aborted it)
        except asyncio.CancelledError:
            pass  # shutdown: the connection ends, the worker falls back to gRPC
        finally:
            try:
                await self._close(writer, self._reading.get(task) if task is not None else None)
            finally:  # the slot is held until the transport is closed
                if held:
                    self.open -= 1
                    if self._budget is not None:
                        self._budget.in_flight -= 1
                if task is not None:
                    self._reading.pop(task, None)
                    self._conns.discard(task)

    async def _close(self, writer: asyncio.StreamWriter, conn: _Conn | None) -> None:
        """Close once the unsent replies are read (the watchdog aborts after the timeout;
        at shutdown they are dropped at once)."""
        writer.close()
        if writer.transport.get_write_buffer_size() == 0:
            return
        if conn is None or self._stopping:
            writer.transport.abort()
            return
        conn.writing_since = time.monotonic()
        try:
            await writer.wait_closed()
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        except ConnectionError:
            writer.transport.abort()

    async def _hello(self, reader: asyncio.StreamReader) -> bool:
        """Read and check the hello; returns whether it carries the operator token."""
        if self.servicer.closing.is_set():
            raise _Refused("closing", ServiceUnavailableError("the manager is shutting down"))
        if self.pending >= MAX_PENDING:
            raise _Refused("pending_limit")
        self.pending += 1
        try:
            raw = await asyncio.wait_for(self._read_hello(reader), self._timeout)
        except asyncio.TimeoutError:
            raise _Refused("handshake_timeout") from None
        finally:
            self.pending -= 1
        try:
            hello = pb.StepHello.FromString(raw)
        except DecodeError:
            raise _Refused("bad_hello", E.InvalidArgumentError("Step socket: the hello is no StepHello")) from None
        if hello.version != SOCKET_VERSION:
            raise _Refused("bad_hello", E.InvalidArgumentError(
                f"Step socket: version {hello.version} is not {SOCKET_VERSION}"))
        if self._operator is not None and self._operator.matches(hello.token):
            return True
        if self._token.matches(hello.token):
            return self._operator is None
        if self._on_reject is not None:
            self._on_reject("Step")
        raise _Refused("auth", E.UnauthenticatedError("missing or wrong auth token for the Step socket"))

    @staticmethod
    async def _read_hello(reader: asyncio.StreamReader) -> bytes:
        (n,) = FRAME.unpack(await reader.readexactly(FRAME.size))
        if n > HELLO_MAX_BYTES:
            raise _Refused("bad_hello", E.InvalidArgumentError(
                f"Step socket: a hello of {n} bytes (at most {HELLO_MAX_BYTES})"))
        return await reader.readexactly(n)

    async def _frames(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, operator: bool) -> None:
        """Answer each StepRequest frame in order until the worker closes the socket."""
        servicer, limit, header = self.servicer, self._max, FRAME.size
        task = asyncio.current_task()
        conn = self._reading[task] if task is not None else _Conn(writer.transport)
        while True:
            try:
                (n,) = FRAME.unpack(await reader.readexactly(header))
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    raise
                return  # closed between frames
            if n > limit:
                raise _Refused("oversize", E.CapacityError(
                    f"Step socket: a message of {n} bytes is over the limit of {limit} bytes"))
            out = await answer_step(servicer, await self._read_body(reader, conn, n), operator)
            self.frames += 1
            writer.write(FRAME.pack(len(out)) + out)
            if writer.transport.get_write_buffer_size() > _HIGH_WATER:
                conn.writing_since = time.monotonic()  # the watchdog aborts it past the timeout
                await writer.drain()
                conn.writing_since = 0.0

    async def _read_body(self, reader: asyncio.StreamReader, conn: _Conn, n: int) -> bytes:
        """A frame's body: while it arrives its bytes count against the cap and the watchdog
        holds it to its deadline (a body already buffered returns at once: two counter
        updates and a clock read)."""
        if self.partial_bytes + n > self.partial_cap:
            raise _Refused("partial_bytes", E.CapacityError(
                f"Step socket: {self.partial_bytes} bytes of frames are arriving already; a frame of {n} "
                f"bytes would pass the cap of {self.partial_cap}", requested=n,
                available=self.partial_cap - self.partial_bytes))
        self.partial_bytes += n
        conn.since, conn.size = time.monotonic(), n
        try:
            return await reader.readexactly(n)
        finally:
            conn.since = 0.0
            self.partial_bytes -= n

    def _count(self, why: str) -> None:
        self.refused[why] += 1
        if self._on_refused is not None:
            self._on_refused(why)
        self._log.add(why)

    def _refuse(self, r: _Refused, writer: asyncio.StreamWriter) -> None:
        self._count(r.why)
        if r.error is not None and not writer.is_closing():
            out = error_to_msg(status_of(r.error)).SerializeToString()
            writer.write(FRAME.pack(len(out)) + out)

    @staticmethod
    def _log_refused(n: int, last: str) -> None:
        log.info("Step socket: closed %d connection(s) by its limits (the last: %s)", n, last)

    @staticmethod
    def _log_fd_limit(n: int, last: str) -> None:
        log.warning("Step socket: %d accept(s) failed for want of a file descriptor (the limit RLIMIT_NOFILE is "
                    "reached; %s): backing off, up to %.0f s", n, last, _ACCEPT_BACKOFF_S[1])
