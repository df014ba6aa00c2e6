"""The manager's Step socket: the Step stream's messages without gRPC.

The wire format (frames, the hello) is described in :mod:`radixkv.service.wire.step` and the
proto; each message runs exactly as on the gRPC Step stream (:func:`answer_step`: same parser,
limits, session checks, reply cache and metrics). The worker's side is
:mod:`radixkv.service.client.step_socket`.

Each accepted connection is one task on the manager's event loop (the loop that owns the
engine), so a frame costs no thread hand-off on this side. What a connection may hold is
bounded before it is trusted:

* a connection has ``handshake_timeout_s`` to send its hello (at most
  :data:`~radixkv.service.wire.step.HELLO_MAX_BYTES`), and at most :data:`MAX_PENDING`
  connections wait for theirs at once (more are closed at once);
* a hello without the workers' or the operator's token is answered UNAUTHENTICATED (and
  counted as an auth failure of ``Step``, like a gRPC call without it); the operator calls
  need the operator token, as on the gRPC stream;
* an accepted connection holds one slot of the manager's call budget
  (``--max-concurrent-rpcs``) while open, as an open Step stream does; none left:
  RESOURCE_EXHAUSTED;
* a frame longer than ``max_message_bytes`` is answered RESOURCE_EXHAUSTED and ends the
  connection (its bytes are never read).

Every connection closed by one of these rules is counted (:attr:`StepSocketServer.refused`,
by reason; exported as ``radixkv_step_socket_refused_total{why}``) and logged, summed, at
most once per 10 s. The socket file is created 0600 in the gRPC socket's 0700 directory.
At shutdown (:meth:`StepSocketServer.stop`) the listener closes and every connection ends;
a worker then falls back to the gRPC path, as after a Step stream ends.
"""
from __future__ import annotations

import asyncio
import logging
import os
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

__all__ = ["StepSocketServer", "MAX_PENDING"]

log = logging.getLogger("radixkv.service")

#: Connections that may wait for their hello at once.
MAX_PENDING = 64
#: Unsent reply bytes of one connection above which its task waits for the socket to drain.
_HIGH_WATER = 1 << 20

_ACCEPTED = pb.StepResponse(reply=b"", rides_replay=True).SerializeToString()


class _Refused(Exception):
    """Ends a connection: ``why`` is counted; ``error`` (when given) is answered first."""

    def __init__(self, why: str, error: E.RadixKVError | None = None):
        super().__init__(why)
        self.why, self.error = why, error


class StepSocketServer:
    """The Step socket of one manager; :meth:`start` on the manager's loop, :meth:`stop` at
    shutdown.

    Args:
        servicer: the manager's ``CacheManagerServicer`` (runs each message).
        token: the workers' token; ``operator_token``: the operator's (or None).
        call_budget: the auth interceptor's budget of calls in flight (``in_flight`` /
            ``limit``), or None for no limit.
        max_message_bytes: the longest frame accepted.
        handshake_timeout_s: how long a connection may take to send its hello.
        on_reject: told ``"Step"`` for every hello with a wrong token (metrics, logs).
        on_refused: told the reason of every connection closed by a rule (metrics).
    """

    def __init__(self, servicer: CacheManagerServicer, token: Token, *, operator_token: Token | None,
                 call_budget: CallBudget | None, max_message_bytes: int, handshake_timeout_s: float,
                 on_reject: Callable[[str], None] | None = None, on_refused: Callable[[str], None] | None = None):
        self.servicer, self._token, self._operator = servicer, token, operator_token
        self._budget = call_budget
        self._max = int(max_message_bytes)
        self._timeout = float(handshake_timeout_s)
        self._on_reject, self._on_refused = on_reject, on_refused
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        self.path: str | None = None
        self.pending = 0  # connections waiting for their hello
        self.open = 0  # accepted connections
        self.frames = 0  # messages answered
        self.refused: Counter[str] = Counter()
        self._log = PeriodicCount(self._log_refused)

    async def start(self, path: str) -> str:
        """Listen on ``path`` (a stale socket file there is replaced, a live one refused:
        ``InvalidArgumentError``). Returns the absolute path."""
        path = prepare_unix_socket(path)
        old = os.umask(0o177)  # the file is born 0600: no window where others may connect
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=path)
        finally:
            os.umask(old)
        self.path = path
        return path

    async def stop(self) -> None:
        """Close the listener and every connection, remove the socket file (idempotent)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        tasks = list(self._conns)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._log.flush()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None

    # ------------------------------------------------------------------ one connection
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:  # always: asyncio runs this callback as a task
            self._conns.add(task)
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
            pass  # the worker went away
        except asyncio.CancelledError:
            pass  # shutdown: the connection ends, the worker falls back to gRPC
        finally:
            if held:
                self.open -= 1
                if self._budget is not None:
                    self._budget.in_flight -= 1
            if task is not None:
                self._conns.discard(task)
            writer.close()

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
            out = await answer_step(servicer, await reader.readexactly(n), operator)
            self.frames += 1
            writer.write(FRAME.pack(len(out)) + out)
            if writer.transport.get_write_buffer_size() > _HIGH_WATER:
                await writer.drain()

    def _refuse(self, r: _Refused, writer: asyncio.StreamWriter) -> None:
        self.refused[r.why] += 1
        if self._on_refused is not None:
            self._on_refused(r.why)
        self._log.add(r.why)
        if r.error is not None and not writer.is_closing():
            out = error_to_msg(status_of(r.error)).SerializeToString()
            writer.write(FRAME.pack(len(out)) + out)

    @staticmethod
    def _log_refused(n: int, last: str) -> None:
        log.info("Step socket: closed %d connection(s) by its limits (the last: %s)", n, last)
