"""``ManagerLink``: one connector side's connection to the cache manager, fault-tolerant.

The engine must keep serving whatever the manager does, so every manager call of the
connector goes through a link that can be *down*:

* ``get()`` returns ``(client, info)`` of a live session, or ``None`` while down. A down link
  tries again (connect + attach, bounded by ``connect_timeout_s``) at most every
  ``retry_interval_s``; meanwhile the engine recomputes.
* ``fail(error)`` is called by the user of the link after a manager call failed for a reason
  other than bad input or capacity (the manager died, restarted, the lease expired): the link
  drops its client and is down until the next try (a warning once per outage).
* The session is kept alive by a keep-alive stream; when this process dies the stream drops
  and the manager reclaims the session's rows and locks at once.

``counters``: ``connects`` (sessions opened), ``connect_failures``, ``call_failures``.
A link is used from one thread (vLLM's scheduler and worker connectors each have their own).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Optional, Tuple

from radixkv.engine.protocol import AttachInfo
from radixkv.errors import RadixKVError

from radixkv.integrations.vllm.config import ConnectorConfig

__all__ = ["ManagerLink"]

logger = logging.getLogger("radixkv.integrations.vllm")

#: ``(client, attach_info)`` checker run after each attach; raises to refuse the manager.
Validator = Callable[[Any, AttachInfo], None]


def _default_connect(cfg: ConnectorConfig) -> Any:
    import radixkv

    return radixkv.connect(cfg.address, token_file=cfg.token_file, timeout_s=cfg.call_timeout_s,
                           wait_s=cfg.connect_timeout_s)


class ManagerLink:
    """See the module doc. ``validate`` (optional) checks a fresh attach (e.g. the KV shape);
    what it raises is logged and the link stays down (an incompatible manager is not used).
    ``keepalive``: hold the session with a keep-alive stream (False: the session is only
    used for its layout)."""

    def __init__(self, cfg: ConnectorConfig, worker_name: str, *, validate: Optional[Validator] = None,
                 keepalive: bool = True, connect: Callable[[ConnectorConfig], Any] = _default_connect,
                 clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.worker_name = worker_name
        self._validate = validate
        self._keepalive = keepalive
        self._connect = connect
        self._clock = clock
        self._client: Any = None
        self._info: Optional[AttachInfo] = None
        self._next_try = 0.0
        self._down_logged = False
        #: What the last connection attempt raised (None after a success).
        self.last_error: Optional[BaseException] = None
        self.counters: Dict[str, int] = {"connects": 0, "connect_failures": 0, "call_failures": 0}

    @property
    def up(self) -> bool:
        return self._client is not None

    def get(self, *, force: bool = False) -> Optional[Tuple[Any, AttachInfo]]:
        """The live ``(client, info)``, connecting first if due (``force``: now). ``None``
        while the manager is unreachable or refused."""
        if self._client is not None and self._info is not None:
            return self._client, self._info
        if not force and self._clock() < self._next_try:
            return None
        self._next_try = self._clock() + self.cfg.retry_interval_s
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
            return None
        self._client, self._info, self.last_error = client, info, None
        self.counters["connects"] += 1
        if self._down_logged or self.counters["connects"] > 1:
            logger.warning("radixkv: connected to manager %s (session epoch %d)", self.cfg.address,
                           info.session.epoch)
        self._down_logged = False
        return client, info

    def fail(self, error: BaseException) -> None:
        """A manager call failed (not bad input / capacity): drop the client; down until the
        next try."""
        self.counters["call_failures"] += 1
        if self._client is None:
            return
        logger.warning("radixkv: manager call failed (%s: %s); serving without the shared cache "
                       "until it is back", type(error).__name__, error)
        self._down_logged = True
        client, self._client, self._info = self._client, None, None
        self._next_try = self._clock()  # one immediate retry (a restarted manager is usually up)
        _close_quietly(client)

    def close(self) -> None:
        """Detach (best effort) and close."""
        client, info, self._client, self._info = self._client, self._info, None, None
        if client is None:
            return
        if info is not None:
            try:
                client.detach(info.session)
            except (RadixKVError, OSError):
                pass
        _close_quietly(client)


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # closing a broken channel: nothing left to do
        pass
