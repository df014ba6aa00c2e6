"""The cache engine: the protocol a scheduler uses for one step, and its embedded implementation.

* :mod:`~radixkv.engine.protocol`: the contract (``CacheEngineAPI`` and its NamedTuples);
* :class:`CacheEngine` (:mod:`~radixkv.engine.embedded`): the protocol run in-process;
* :class:`EngineConfig` (:mod:`~radixkv.engine.config`): model shape, pool sizes, limits;
* :class:`EnginePools` / :func:`plan_arenas` (:mod:`~radixkv.engine.pools`): the pools and their
  JSON-able layout;
* :class:`SessionTable` (:mod:`~radixkv.engine.sessions`): sessions, leases, request ownership;
* :class:`WorkerBuffers` / :func:`attach_buffers` (:mod:`~radixkv.engine.buffers`): what a
  worker reads and writes KV and states through.
"""
from radixkv.engine.buffers import WorkerBuffers, attach_buffers  # noqa: F401
from radixkv.engine.config import ADMISSION_POLICIES, EngineConfig  # noqa: F401
from radixkv.engine.embedded import CacheEngine  # noqa: F401
from radixkv.engine.pools import EnginePools, plan_arenas  # noqa: F401
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
from radixkv.engine.sessions import SessionTable  # noqa: F401

__all__ = [
    "AttachInfo", "CacheEngineAPI", "CacheResult", "DecodeItem", "DecodeResult", "EngineStats",
    "EvictResult", "ExtendItem", "ExtendResult", "MatchInfo", "MatchQuery", "Session",
    "ADMISSION_POLICIES", "EngineConfig", "SessionTable", "EnginePools", "plan_arenas",
    "WorkerBuffers", "attach_buffers", "CacheEngine",
]
