"""The server's side of the event hub: who pumps it, where its batches go, how it ends.

:class:`EventOutlets` owns, for one server: the ZMQ outlet (vLLM's wire, never blocking the
loop: ``put_timeout_s=0``, a full queue gets the same events at the next pump); the pump task
(every ``interval_s`` while ZMQ is on, catching events no call pumped, e.g. a lease reclaim);
and the shutdown flush (:meth:`EventOutlets.close`: pump the rest, append
``AllBlocksCleared`` so routers forget this manager, close the hub, then the publisher after
it sent what is queued). Runs on the server's event loop. See ``docs/service.md``, "Event
outlets".
"""
from __future__ import annotations

import asyncio
from typing import Any

from radixkv.service.server.event_hub import EventHub, HubRecord

from radixkv.cache.kv_events import AllBlocksCleared
from radixkv.events.zmq_flags import PublisherConfig

__all__ = ["EventOutlets"]


class EventOutlets:
    """The pump task, the ZMQ outlet and the shutdown flush of one hub.

    Args:
        hub: the server's event hub.
        zmq: the ZMQ outlet's settings, ``None`` for none.
        interval_s: the pump period while the ZMQ outlet is on.
        clear_at_close: append ``AllBlocksCleared`` at :meth:`close` (the engine records
            events).

    Raises (constructor) as :class:`~radixkv.events.zmq_publisher.ZmqEventPublisher` does for
    an endpoint it cannot open (nothing left open).
    """

    def __init__(self, hub: EventHub, zmq: PublisherConfig | None, interval_s: float, clear_at_close: bool):
        self.hub = hub
        self.interval_s = max(0.0005, float(interval_s))
        self.clear_at_close = bool(clear_at_close)
        self.publisher: Any = None
        self._task: asyncio.Task[None] | None = None
        if zmq is not None:
            self.publisher = zmq.open(put_timeout_s=0.0)
            hub.add_outlet("zmq", self._publish)

    def _publish(self, records: list[HubRecord]) -> None:
        self.publisher.publish([r.event for r in records])  # CapacityError: the hub retries

    def start(self, closing: asyncio.Event) -> None:
        """Start the pump task (only with the ZMQ outlet), until ``closing`` is set."""
        if self.publisher is not None and self._task is None:
            self._task = asyncio.ensure_future(self._pump_loop(closing))

    async def _pump_loop(self, closing: asyncio.Event) -> None:
        while not closing.is_set():
            try:
                await asyncio.wait_for(closing.wait(), timeout=self.interval_s)
            except asyncio.TimeoutError:
                pass
            self.hub.pump()

    async def stop_pumping(self) -> None:
        """Cancel the pump task (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def close(self) -> None:
        """The shutdown flush (see the module docstring). Idempotent."""
        hub = self.hub
        if not hub.closed:
            hub.pump()
            if self.clear_at_close:
                hub.append([AllBlocksCleared()])
            hub.run_outlets()
            hub.close()
        self.close_publisher()

    def close_publisher(self) -> None:
        """Close the publisher (it sends what is queued first). Idempotent."""
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
