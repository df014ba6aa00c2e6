"""The conformance scenarios against two more implementations: the gRPC client with its step
calls on the manager's Step socket (``connect()``'s default, ``radixkv.service.server.step_socket``)
and on the persistent gRPC Step stream (``connect(..., step_socket=False)``,
``radixkv.service.server.step_stream``). The scenarios are the suite's own, imported here and run
with this module's ``engine_factory`` (so the stream client must agree call for call with
the embedded engine, exactly as the unary client does); each test also checks that the
stream carried the calls (no fallback to unary calls)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conformance_util import FakeClock
from radixkv.service.client.step_socket import StepSocket

# The scenarios (collected again in this module, with the fixture below).
from test_conformance_errors import *  # noqa: F401,F403
from test_conformance_hybrid import *  # noqa: F401,F403
from test_conformance_lifecycle import *  # noqa: F401,F403
from test_conformance_sessions import *  # noqa: F401,F403
from test_conformance_stress import *  # noqa: F401,F403
from test_conformance_tiers import *  # noqa: F401,F403


def _make_stream(config: dict[str, Any], clock: FakeClock | None,
                 socket: bool) -> tuple[Any, Callable[[], None]]:
    from tooling.testing import start_remote_engine

    return start_remote_engine(config, clock, step_stream=True, step_socket=socket)


class _StreamFactory:
    """The suite's engine factory (``conftest.EngineFactory``'s interface) for stream clients;
    remembers the clients it made."""

    def __init__(self, name: str):
        self.name = name
        self.socket = name == "remote-socket"
        self.made: list[Any] = []
        self._closers: list[Callable[[], None]] = []

    def __call__(self, clock: FakeClock | None = None, **config: Any) -> Any:
        engine, close = _make_stream(dict(config), clock, self.socket)
        self.made.append(engine)
        self._closers.append(close)
        return engine

    def buffers(self, engine: Any, info: Any) -> Any:
        return engine.worker_buffers(info)

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()


@pytest.fixture(params=["remote-socket", "remote-stream"])
def engine_factory(request):
    factory = _StreamFactory(request.param)
    yield factory
    try:
        for engine in factory.made:  # every step call went over its lane (none fell back to unary)
            assert engine.steps is not None and engine.steps.fallbacks == 0
            assert engine.steps.stream is None or engine.steps.stream.calls > 0
            assert engine.steps.socket_misses == 0
            assert engine.steps.stream is None or isinstance(engine.steps.stream, StepSocket) == factory.socket
        assert any(e.steps.stream is not None for e in factory.made) or request.node.name.startswith("test_stats_shape")
    finally:
        factory.close()
