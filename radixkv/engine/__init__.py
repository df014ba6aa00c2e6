"""The cache engine: the protocol a scheduler uses for one step, and its embedded implementation.

* :mod:`~radixkv.engine.protocol`: the contract (``CacheEngineAPI`` and its NamedTuples);
* :class:`CacheEngine` (:mod:`~radixkv.engine.embedded`): the protocol run in-process;
* :class:`EngineConfig` (:mod:`~radixkv.engine.config`): model shape, pool sizes, limits;
* :class:`EnginePools` (:mod:`~radixkv.engine.pools`) and :func:`plan_arenas`
  (:mod:`~radixkv.engine.layout`): the pools and their JSON-able layout;
* :class:`SessionTable` (:mod:`~radixkv.engine.sessions`): sessions, leases, request ownership;
* :class:`WorkerBuffers` / :func:`attach_buffers` (:mod:`~radixkv.engine.buffers`): what a
  worker reads and writes KV and states through.
"""
from typing import TYPE_CHECKING

from radixkv.engine.config import ADMISSION_POLICIES, EngineConfig  # noqa: F401
from radixkv.engine.protocol import (  # noqa: F401
    AttachInfo,
    CacheEngineAPI,
    CacheResult,
    DecodeItem,
    DecodeResult,
    EngineStats,
    EvictResult,
    ExtendItem,
    ExtendResult,
    MatchInfo,
    MatchQuery,
    Session,
)

# The rest is loaded on first use: the protocol and the config are all a remote client needs
# (``radixkv.service.client`` imports them), and the pools, the tree and the embedded engine
# would bring the cache layer and the kernels with them.
_LAZY = {
    "SessionTable": "radixkv.engine.sessions",
    "EnginePools": "radixkv.engine.pools",
    "plan_arenas": "radixkv.engine.layout",
    "WorkerBuffers": "radixkv.engine.buffers",
    "attach_buffers": "radixkv.engine.buffers",
    "CacheEngine": "radixkv.engine.embedded",
}

if TYPE_CHECKING:  # what the lazy names are, for type checkers
    from radixkv.engine.buffers import WorkerBuffers, attach_buffers  # noqa: F401
    from radixkv.engine.embedded import CacheEngine  # noqa: F401
    from radixkv.engine.layout import plan_arenas  # noqa: F401
    from radixkv.engine.pools import EnginePools  # noqa: F401
    from radixkv.engine.sessions import SessionTable  # noqa: F401


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv.engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AttachInfo", "CacheEngineAPI", "CacheResult", "DecodeItem", "DecodeResult", "EngineStats",
    "EvictResult", "ExtendItem", "ExtendResult", "MatchInfo", "MatchQuery", "Session",
    "ADMISSION_POLICIES", "EngineConfig", "SessionTable", "EnginePools", "plan_arenas",
    "WorkerBuffers", "attach_buffers", "CacheEngine",
]
