"""The conformance scenarios against a third implementation: the gRPC client with its step
calls on the persistent Step stream (``connect(..., step_stream=True)``,
``radixkv.service.server.step_stream``). The scenarios are the suite's own, imported here and run
with this module's ``engine_factory`` (so the stream client must agree call for call with
the embedded engine, exactly as the unary client does); each test also checks that the
stream carried the calls (no fallback to unary calls)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conformance_util import FakeClock

# The scenarios (collected again in this module, with the fixture below).
from test_conformance_errors import *  # noqa: F401,F403
from test_conformance_hybrid import *  # noqa: F401,F403
from test_conformance_lifecycle import *  # noqa: F401,F403
from test_conformance_sessions import *  # noqa: F401,F403
from test_conformance_stress import *  # noqa: F401,F403


def _make_stream(config: dict[str, Any], clock: FakeClock | None) -> tuple[Any, Callable[[], None]]:
    from tooling.testing import start_remote_engine

    return start_remote_engine(config, clock, step_stream=True)


class _StreamFactory:
    """The suite's engine factory (``conftest.EngineFactory``'s interface) for stream clients;
    remembers the clients it made."""

    name = "remote-stream"

    def __init__(self):
        self.made: list[Any] = []
        self._closers: list[Callable[[], None]] = []

    def __call__(self, clock: FakeClock | None = None, **config: Any) -> Any:
        engine, close = _make_stream(dict(config), clock)
        self.made.append(engine)
        self._closers.append(close)
        return engine

    def buffers(self, engine: Any, info: Any) -> Any:
        return engine.worker_buffers(info)

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()


@pytest.fixture(params=["remote-stream"])
def engine_factory(request):
    factory = _StreamFactory()
    yield factory
    try:
        for engine in factory.made:  # every step call went over the stream (none fell back to unary)
            assert engine.steps is not None and engine.steps.fallbacks == 0
            assert engine.steps.stream is None or engine.steps.stream.calls > 0
        assert any(e.steps.stream is not None for e in factory.made) or request.node.name.startswith("test_stats_shape")
    finally:
        factory.close()
