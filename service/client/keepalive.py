"""A worker's keep-alive stream: one session's lease renewed from a daemon thread.

:meth:`radixkv.service.client.remote.RemoteCacheEngine.start_keepalive` opens one per session: a
``KeepAlive`` stream whose messages the manager answers with the lease left. When the worker
closes it the manager detaches the session at once; when it drops (the process died, the
connection broke) the manager reclaims the session, or quarantines it while the process
still runs (:mod:`radixkv.service.server.quarantine`).
"""
from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
from radixkv.service.wire import codec as wire
from radixkv.service.wire._gen import cache_manager_pb2 as pb
from radixkv.service.wire._gen.cache_manager_pb2_grpc import CacheManagerStub
from radixkv.service.wire.auth import Metadata
from radixkv.service.wire.errors import error_from_rpc

from radixkv.engine.protocol import Session
from radixkv.errors import RadixKVError

__all__ = ["KeepAlive"]


class KeepAlive:
    """A keep-alive stream for one session, renewed from a daemon thread.

    ``stop()`` ends the stream (the manager then detaches the session, see the protocol's
    KeepAlive); ``lease_left_s`` is the last value the manager sent; ``error`` the error that
    ended it early (e.g. ``StaleSessionError``), else None.
    """

    def __init__(self, stub: CacheManagerStub, metadata: Metadata, session: Session, interval_s: float):
        self._stop = threading.Event()
        self._session = wire.session_to_msg(session)
        self.interval_s = float(interval_s)
        self.lease_left_s: float | None = None
        self.error: RadixKVError | None = None
        self._call = stub.KeepAlive(self._requests(), metadata=metadata)
        self._thread = threading.Thread(target=self._run, name="radixkv-keepalive", daemon=True)
        self._thread.start()

    def _requests(self) -> Iterator[pb.HeartbeatRequest]:
        while not self._stop.is_set():
            yield pb.HeartbeatRequest(session=self._session)
            self._stop.wait(self.interval_s)

    def _run(self) -> None:
        try:
            for resp in self._call:
                self.lease_left_s = resp.lease_left_s
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = error_from_rpc(e)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Close the stream (the manager then detaches the session at once); cancel it if
        the manager does not end it within ``timeout_s``."""
        self._stop.set()
        self._thread.join(min(timeout_s, 2.0))
        if self._thread.is_alive():
            self._call.cancel()
            self._thread.join(timeout_s)
