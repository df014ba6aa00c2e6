"""The Prometheus endpoint's HTTP server, bounded (``--metrics-port``).

prometheus_client's own server gives each connection a thread and no timeout: idle
connections from any local user (loopback is every local user) held a thread and a
descriptor each, forever. This one serves the same WSGI app with a per-read timeout
(:data:`READ_TIMEOUT_S`), at most :data:`MAX_CONNECTIONS` connections at once (one more is
closed at once and counted in :attr:`MetricsHTTPServer.refused`), and at the descriptor limit
its accept backs off (:data:`ACCEPT_BACKOFF_S`) instead of spinning.
"""
from __future__ import annotations

import errno
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import make_wsgi_app
from prometheus_client.registry import CollectorRegistry

__all__ = ["MetricsHTTPServer", "start_metrics_http", "MAX_CONNECTIONS", "READ_TIMEOUT_S", "ACCEPT_BACKOFF_S"]

MAX_CONNECTIONS = 16
READ_TIMEOUT_S = 5.0
ACCEPT_BACKOFF_S = 0.1


class _Handler(WSGIRequestHandler):
    """One request per connection; a read that waits longer than the timeout ends it."""

    timeout = READ_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        """Log nothing (a scrape every few seconds)."""


class MetricsHTTPServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most ``max_connections`` at once (see the module doc)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], max_connections: int = MAX_CONNECTIONS):
        family, host = _family_of(address[0], address[1])
        self.address_family = family
        super().__init__((host, address[1]), _Handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self.open = 0  # connections being served now
        self.refused = 0  # connections closed at once: every slot was taken
        self.accept_failures = 0  # accepts that found no descriptor
        self.errors = 0  # connections that ended in an error (a read timeout, a reset): not logged

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                self.accept_failures += 1
                time.sleep(ACCEPT_BACKOFF_S)  # this thread's own: the listener stays readable
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Count, and say nothing: socketserver prints a traceback per timed-out idle
        connection, a log flood any local user could cause."""
        self.errors += 1

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        with self._lock:
            self.open += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self.open -= 1
        self._slots.release()


def _family_of(addr: str, port: int) -> tuple[socket.AddressFamily, str]:
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return family, str(sockaddr[0])


def start_metrics_http(registry: CollectorRegistry, port: int, addr: str,
                       max_connections: int = MAX_CONNECTIONS) -> tuple[MetricsHTTPServer, threading.Thread]:
    """Serve ``registry`` at ``http://addr:port/metrics`` from a daemon thread (0: any port)."""
    httpd = MetricsHTTPServer((addr, port), max_connections)
    httpd.set_app(make_wsgi_app(registry))
    thread = threading.Thread(target=httpd.serve_forever, name="radixkv-metrics-http", daemon=True)
    thread.start()
    return httpd, thread
