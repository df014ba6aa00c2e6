"""``ManagerLink``: one connector side's connection to the cache manager, fault-tolerant.

The engine keeps serving whatever the manager does, so every manager call goes through a
link that can be *down*. ``get()`` returns ``(client, info)`` of a live session or ``None``
while down, never waiting: a background thread reconnects (bounded tries every
``retry_interval_s``); ``get(force=True)`` tries once in the caller's thread. ``fail(error)``
after a call failed for a reason other than bad input or capacity drops the client (one
warning per outage); a stale session (the manager restarted) re-attaches at once instead.
A keep-alive stream holds the session; if this process dies the manager reclaims it at once.
``counters``: ``connects``, ``connect_failures``, ``call_failures``, ``reattaches``.
``get`` / ``fail`` run on one thread; the reconnect thread only publishes a finished
connection (one atomic attribute store). See ``docs/vllm.md``, "The link to the manager".
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from radixkv.engine.protocol import AttachInfo, CacheResult, ExtendItem, ExtendResult, Session
from radixkv.errors import RadixKVError, StaleSessionError
from radixkv.integrations.vllm.config import ConnectorConfig

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.engine.buffers import WorkerBuffers

__all__ = ["ManagerLink", "ManagerClient"]

logger = logging.getLogger("radixkv.integrations.vllm")



class ManagerClient(Protocol):
    """What the connector calls on a manager client: ``radixkv.connect()``'s
    ``RemoteCacheEngine`` (or a test double). Not shared between threads."""

    def attach(self, worker_name: str = "") -> AttachInfo: ...
    def detach(self, session: Session) -> None: ...
    def start_keepalive(self, session: Session) -> object:
        """Hold ``session`` with a keep-alive stream (stopped when the client closes)."""
    def alloc_extend(self, session: Session, items: Sequence[ExtendItem]) -> list[ExtendResult]: ...
    def cache_finished(self, session: Session, rids: Sequence[str]) -> list[CacheResult]: ...
    def release(self, session: Session, rids: Sequence[str]) -> None: ...
    def watch_events(self, session: Session, poll_interval_s: float = 0.0,
                     start_seq: int | None = 0) -> Iterator[dict[str, Any]]:
        """The manager's events as ``take_events`` dicts (JSON-shaped), gap markers included."""
    def worker_buffers(self, info: AttachInfo) -> WorkerBuffers:
        """The manager's pools, mapped into this process."""
    def close(self) -> None: ...


#: ``(client, attach_info)`` checker run after each attach; raises to refuse the manager.
Validator = Callable[[ManagerClient, AttachInfo], None]
Live = tuple[ManagerClient, AttachInfo]


def _default_connect(cfg: ConnectorConfig) -> ManagerClient:
    from radixkv.service.client import connect  # radixkv.connect, typed

    return connect(cfg.address, token_file=cfg.token_file, timeout_s=cfg.call_timeout_s,
                   wait_s=cfg.connect_timeout_s)


class ManagerLink:
    """See the module doc. ``validate`` (optional) checks a fresh attach (e.g. the KV shape);
    what it raises is logged and the link stays down (an incompatible manager is not used).
    ``keepalive``: hold the session with a keep-alive stream (False: the session is only
    used for its layout). ``background``: reconnect in a thread (False: only ``get(force)``)."""

    def __init__(self, cfg: ConnectorConfig, worker_name: str, *, validate: Validator | None = None,
                 keepalive: bool = True, background: bool = True,
                 connect: Callable[[ConnectorConfig], ManagerClient] = _default_connect):
        self.cfg = cfg
        self.worker_name = worker_name
        self._validate = validate
        self._keepalive = keepalive
        self._background = background
        self._connect = connect
        self._live: Live | None = None
        self._lock = threading.Lock()  # one connection attempt at a time
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._down_logged = False
        #: What the last connection attempt raised (None after a success).
        self.last_error: BaseException | None = None
        self.counters: dict[str, int] = {"connects": 0, "connect_failures": 0, "call_failures": 0,
                                         "reattaches": 0}

    @property
    def up(self) -> bool:
        return self._live is not None

    def get(self, *, force: bool = False) -> Live | None:
        """The live ``(client, info)``; ``None`` while down (``force``: try once now)."""
        live = self._live
        if live is not None:
            return live
        if force:
            self._closed.clear()
            if self._try_once():
                return self._live
        self._start_background()
        return None

    def current(self) -> Live | None:
        """The live ``(client, info)`` or ``None``, with no side effect (any thread may ask;
        only the link's own thread may call on the client)."""
        return self._live

    def new_client(self) -> ManagerClient:
        """A new connected client to the manager (not attached; the caller closes it): for a
        thread of its own, since a client is never shared between threads."""
        return self._connect(self.cfg)

    def _try_once(self) -> bool:
        with self._lock:
            if self._live is not None:
                return True
            client = None
            try:
                client = self._connect(self.cfg)
                info = client.attach(self.worker_name)
                if self._validate is not None:
                    self._validate(client, info)
                if self._keepalive:
                    client.start_keepalive(info.session)
            except Exception as e:  # the manager is down / refused: serve without it
                self.counters["connect_failures"] += 1
                self.last_error = e
                if not self._down_logged:
                    logger.warning("radixkv: manager %s unavailable (%s: %s); serving without the shared "
                                   "cache, retrying every %.1f s", self.cfg.address, type(e).__name__, e,
                                   self.cfg.retry_interval_s)
                    self._down_logged = True
                if client is not None:
                    _close_quietly(client)
                return False
            self.last_error = None
            self.counters["connects"] += 1
            if self._down_logged or self.counters["connects"] > 1:
                logger.warning("radixkv: connected to manager %s (session epoch %d)", self.cfg.address,
                               info.session.epoch)
            self._down_logged = False
            self._live = (client, info)
            return True

    def _start_background(self) -> None:
        if not self._background or self._closed.is_set():
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._reconnect_loop, name="radixkv-reconnect", daemon=True)
        self._thread.start()

    def _reconnect_loop(self) -> None:
        while not self._closed.wait(self.cfg.retry_interval_s):
            if self._live is not None or self._try_once():
                return

    def fail(self, error: BaseException) -> bool:
        """A manager call failed (not bad input / capacity): drop the client. A
        ``StaleSessionError`` means a manager answers (it restarted, or the lease ran out):
        re-attach at once in this thread (one try, bounded by ``connect_timeout_s`` +
        ``call_timeout_s``); otherwise down until the reconnect thread is back. True: up again
        (the caller may retry its call once on the new session)."""
        self.counters["call_failures"] += 1
        live, self._live = self._live, None
        if live is None:
            return False
        logger.warning("radixkv: manager call failed (%s: %s); %s", type(error).__name__, error,
                       "re-attaching now" if isinstance(error, StaleSessionError)
                       else "serving without the shared cache until it is back")
        self._down_logged = True
        _close_quietly(live[0])
        if isinstance(error, StaleSessionError) and not self._closed.is_set() and self._try_once():
            self.counters["reattaches"] += 1
            return True
        self._start_background()
        return False

    def close(self) -> None:
        """Stop reconnecting; detach (best effort) and close."""
        self._closed.set()
        live, self._live = self._live, None
        if live is None:
            return
        client, info = live
        try:
            client.detach(info.session)
        except (RadixKVError, OSError):
            pass
        _close_quietly(client)


def _close_quietly(client: ManagerClient) -> None:
    try:
        client.close()
    except Exception:  # closing a broken channel: nothing left to do
        pass
