"""A cache-manager server on its own event loop in a background thread, for tests and benchmarks.

:class:`ThreadedServer` runs a real :class:`~radixkv.service.server.manager.CacheManagerServer`
(gRPC over a Unix socket in a fresh 0700 temp directory, shared-memory pools) in a daemon
thread of the calling process, so a test can inject the engine's clock and still talk to it
only through the wire. Multi-process tests start the server with ``radixkv serve`` in a
spawned process instead (``tests/service/``).
"""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from radixkv.service.client import RemoteCacheEngine, connect
from radixkv.service.server.manager import CacheManagerServer, ServeOptions
from radixkv.service.wire.auth import Token

from radixkv.engine.config import EngineConfig
from radixkv.errors import RadixKVError

__all__ = ["ThreadedServer", "start_remote_engine"]


class ThreadedServer:
    """``start()`` a server thread, ``client()`` connections to it, ``stop()`` (idempotent).

    Args:
        config: the engine config (an ``EngineConfig`` or a dict of its fields).
        clock: injected into the engine (leases), e.g. a fake clock.
        options: server options; ``address`` is replaced by a socket in a fresh temp dir.
        timeout_s: how long start and stop may take.
    """

    def __init__(self, config: EngineConfig | dict[str, Any] | None = None, *,
                 clock: Callable[[], float] | None = None, options: ServeOptions | None = None,
                 timeout_s: float = 30.0):
        if isinstance(config, dict):
            config = EngineConfig.from_dict(config)
        self.config = config or EngineConfig()
        self.token = secrets.token_urlsafe(24)
        self._dir = tempfile.mkdtemp(prefix="radixkv-")  # mode 0700
        opts = options or ServeOptions(sweep_interval_s=0.2, grace_s=1.0)
        self.options = opts._replace(address=f"unix://{self._dir}/manager.sock")
        self._clock = clock
        self._timeout = timeout_s
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self.server: CacheManagerServer | None = None
        self.address: str | None = None
        self._clients: list = []

    def start(self) -> str:
        self._thread = threading.Thread(target=self._run, name="radixkv-test-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(self._timeout):
            raise TimeoutError("the test server did not start in time")
        if self._error is not None:
            self._cleanup_dir()
            raise self._error
        return self._address()

    def running(self) -> CacheManagerServer:
        """The started server (``RuntimeError`` before :meth:`start`)."""
        if self.server is None:
            raise RuntimeError("the test server is not started")
        return self.server

    def _address(self) -> str:
        if self.address is None:
            raise RuntimeError("the test server is not started")
        return self.address

    def _run(self) -> None:
        async def main() -> None:
            try:
                self.server = CacheManagerServer(self.config, Token(self.token), self.options, clock=self._clock)
                self._loop = asyncio.get_running_loop()
                self._stop_event = asyncio.Event()
                self.address = await self.server.start()
            except BaseException as e:  # reported to start()
                self._error = e
                if self.server is not None:
                    await self.server.stop(0)
                self._ready.set()
                return
            self._ready.set()
            await self._stop_event.wait()
            await self.server.stop()

        asyncio.run(main())

    def client(self, **kw: Any) -> RemoteCacheEngine:
        c = connect(self._address(), token=self.token, wait_s=self._timeout, **kw)
        self._clients.append(c)
        return c

    def call(self, fn: Callable[[CacheManagerServer], Any]) -> Any:
        """Run ``fn(server)`` on the server's loop (e.g. inspection) and return its result."""
        server, loop = self.running(), self._loop
        if loop is None:
            raise RuntimeError("the test server is not started")

        async def run() -> Any:
            return fn(server)

        return asyncio.run_coroutine_threadsafe(run(), loop).result(self._timeout)

    def stop(self) -> None:
        for c in self._clients:
            c.close()
        self._clients.clear()
        stop_event = self._stop_event
        if self._loop is not None and stop_event is not None and self._thread is not None and self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(stop_event.set)
            except RuntimeError:  # the loop already ended (a failed start returns at once)
                pass
            self._thread.join(self._timeout)
        self._cleanup_dir()

    def restarted(self) -> ThreadedServer:
        """Stop this server and start another at the same address with the same config and
        token (fresh pools, a new epoch), as a manager restarted by its supervisor."""
        self.stop()
        new = ThreadedServer(self.config, clock=self._clock, options=self.options, timeout_s=self._timeout)
        shutil.rmtree(new._dir, ignore_errors=True)
        os.makedirs(self._dir, mode=0o700)
        new._dir, new.token, new.options = self._dir, self.token, self.options
        new.start()
        return new

    def _cleanup_dir(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> ThreadedServer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_remote_engine(config: EngineConfig | dict[str, Any] | None = None,
                        clock: Callable[[], float] | None = None, *,
                        step_stream: bool = False,
                        step_socket: bool = True) -> tuple[RemoteCacheEngine, Callable[[], None]]:
    """A remote engine over a fresh threaded server: ``(client, close)``. Unary calls only
    unless ``step_stream`` (the conformance suite runs the unary client through this and the
    stream client separately, so both paths stay covered whatever ``connect``'s default)."""
    server = ThreadedServer(config, clock=clock)
    server.start()
    try:
        return server.client(step_stream=step_stream, step_socket=step_socket), server.stop
    except RadixKVError:
        server.stop()
        raise
