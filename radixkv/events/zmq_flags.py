"""The command-line switches of the vLLM ZMQ outlet: ``--kv-events-endpoint`` and friends.

:func:`add_arguments` adds them to a parser, :func:`config_from_args` reads them into a
:class:`PublisherConfig` (picklable, nothing opened; ``radixkv serve`` keeps one in its
``ServeOptions``), :func:`from_args` opens the publisher directly.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, NamedTuple, TypedDict

from radixkv.events.vllm_wire import LAYOUTS, STATE_POLICIES

if TYPE_CHECKING:  # pragma: no cover
    import zmq
    from typing_extensions import Unpack

    from radixkv.events.zmq_publisher import ZmqEventPublisher

__all__ = ["PublisherConfig", "add_arguments", "config_from_args", "from_args"]


def add_arguments(parser: argparse.ArgumentParser, prefix: str = "kv-events") -> None:
    """Add ``--{prefix}-endpoint``, ``-replay-endpoint``, ``-topic``, ``-buffer-steps``,
    ``-hwm``, ``-layout`` and ``-state-events`` to ``parser`` (endpoint unset: no ZMQ outlet)."""
    g = parser.add_argument_group("KV events (vLLM ZMQ wire)")
    g.add_argument(f"--{prefix}-endpoint", default=None,
                   help="PUB endpoint, e.g. tcp://*:5557 (unset: do not publish on ZMQ)")
    g.add_argument(f"--{prefix}-replay-endpoint", default=None,
                   help="ROUTER endpoint answering replay requests, e.g. tcp://*:5558")
    g.add_argument(f"--{prefix}-topic", default="", help="topic frame of every message (default: empty)")
    g.add_argument(f"--{prefix}-buffer-steps", type=int, default=10_000,
                   help="batches kept for replay (default %(default)s)")
    g.add_argument(f"--{prefix}-hwm", type=int, default=100_000, help="PUB send high-water mark (default %(default)s)")
    g.add_argument(f"--{prefix}-layout", choices=LAYOUTS, default="array",
                   help="event layout: array (array_like structs) or map (default %(default)s)")
    g.add_argument(f"--{prefix}-state-events", choices=STATE_POLICIES, default="drop",
                   help="hybrid state events on this stream: drop (vLLM-safe), inline, error (default %(default)s)")


class PublisherOptions(TypedDict, total=False):
    """The :class:`~radixkv.events.zmq_publisher.ZmqEventPublisher` arguments the flags do not set."""

    max_queue_size: int
    data_parallel_rank: int | None
    background: bool
    linger_ms: int
    put_timeout_s: float
    context: zmq.Context[zmq.Socket[bytes]] | None


class PublisherConfig(NamedTuple):
    """What the flags of :func:`add_arguments` describe (picklable; nothing opened):
    :meth:`open` makes the publisher. ``ServeOptions.kv_events`` of the server is one."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    layout: str = "array"
    state_events: str = "drop"

    def open(self, **kwargs: Unpack[PublisherOptions]) -> ZmqEventPublisher:
        """A :class:`~radixkv.events.zmq_publisher.ZmqEventPublisher` with these settings
        (``kwargs``: its other arguments, e.g. ``put_timeout_s``). Raises as its
        constructor does."""
        from radixkv.events.zmq_publisher import ZmqEventPublisher

        return ZmqEventPublisher(self.endpoint, self.replay_endpoint, self.topic, buffer_steps=self.buffer_steps,
                                 hwm=self.hwm, layout=self.layout, state_events=self.state_events, **kwargs)


def config_from_args(args: argparse.Namespace, prefix: str = "kv-events") -> PublisherConfig | None:
    """The :class:`PublisherConfig` the flags describe, ``None`` without an endpoint."""
    a = prefix.replace("-", "_")
    endpoint = getattr(args, f"{a}_endpoint")
    if not endpoint:
        return None
    return PublisherConfig(endpoint, getattr(args, f"{a}_replay_endpoint"), getattr(args, f"{a}_topic"),
                           getattr(args, f"{a}_buffer_steps"), getattr(args, f"{a}_hwm"),
                           getattr(args, f"{a}_layout"), getattr(args, f"{a}_state_events"))


def from_args(args: argparse.Namespace, prefix: str = "kv-events",
              **kwargs: Unpack[PublisherOptions]) -> ZmqEventPublisher | None:
    """The publisher the flags of :func:`add_arguments` describe, ``None`` without an endpoint."""
    config = config_from_args(args, prefix)
    return None if config is None else config.open(**kwargs)

