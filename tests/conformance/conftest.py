"""Fixtures of the conformance suite: the same protocol scenarios against every engine.

``engine_factory`` is parametrized over the implementations listed in ``IMPLEMENTATIONS``
below. A factory builds engines of one implementation::

    engine = engine_factory(clock=clock, page_size=16, kv_tokens=512)   # EngineConfig fields
    buffers = engine_factory.buffers(engine, info)                       # WorkerBuffers

and closes everything it built when the test ends. Scenarios use only the protocol
(``radixkv.engine.protocol``), ``stats()`` and ``check_invariants()``, plus the worker
buffers for reading and writing KV.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conformance_util import FakeClock

# An implementation is (make, buffers):
#   make(config: dict of EngineConfig fields, clock: FakeClock | None) -> (engine, close)
#   buffers(engine, info: AttachInfo) -> WorkerBuffers over the engine's memory


def _make_embedded(config: dict[str, Any], clock: FakeClock | None) -> tuple[Any, Callable[[], None]]:
    from radixkv.engine import CacheEngine, EngineConfig

    engine = CacheEngine(EngineConfig(**config), clock=clock)
    return engine, engine.close


def _embedded_buffers(engine: Any, info: Any) -> Any:
    from radixkv.engine.buffers import attach_buffers

    return attach_buffers(info.layout)


# ======================= ENGINE IMPLEMENTATIONS (edit only here) =======================
# The gRPC client helper adds "remote": (make_remote, remote_buffers) to this dict.


def _make_remote(config: dict[str, Any], clock: FakeClock | None) -> tuple[Any, Callable[[], None]]:
    """A ``radixkv.service`` client of a real gRPC server (threaded, Unix socket, shared
    memory) whose engine runs on ``clock``."""
    from tooling.testing import start_remote_engine

    return start_remote_engine(config, clock)


def _remote_buffers(engine: Any, info: Any) -> Any:
    return engine.worker_buffers(info)


IMPLEMENTATIONS: dict[str, tuple[Callable, Callable]] = {
    "embedded": (_make_embedded, _embedded_buffers),
    "remote": (_make_remote, _remote_buffers),
}
# ===================== END OF ENGINE IMPLEMENTATIONS =====================================


class EngineFactory:
    """Builds engines of one implementation and closes them at teardown."""

    def __init__(self, name: str, make: Callable, buffers: Callable):
        self.name = name
        self._make = make
        self._buffers = buffers
        self._closers: list[Callable[[], None]] = []

    def __call__(self, clock: FakeClock | None = None, **config: Any) -> Any:
        engine, close = self._make(dict(config), clock)
        self._closers.append(close)
        return engine

    def buffers(self, engine: Any, info: Any) -> Any:
        return self._buffers(engine, info)

    def close(self) -> None:
        while self._closers:
            self._closers.pop()()


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def engine_factory(request):
    make, buffers = IMPLEMENTATIONS[request.param]
    factory = EngineFactory(request.param, make, buffers)
    yield factory
    factory.close()


@pytest.fixture
def clock():
    return FakeClock()
