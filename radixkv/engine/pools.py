"""Build every pool of an engine (and its tree) from an :class:`EngineConfig`.

An engine has up to three pools, each ONE allocation (an :class:`~radixkv.memory.arena.Arena`)
named in the layout:

* ``"req_to_token"``: the request-to-token table (``ReqToTokenPool``; for hybrid models the
  ``HybridReqToTokenPool``, whose arena also holds the row <-> state-slot maps);
* ``"kv"``: the K/V buffers of the full-attention layers (``MHATokenToKVPool``);
* ``"mamba"``: the KDA states (``MambaPool``), hybrid models only.

:func:`~radixkv.engine.layout.plan_arenas` computes their layouts without allocating anything, so a server can
create shared-memory buffers of the right size first and pass them in (``buffers=``); the
pools then live in those bytes. :meth:`EnginePools.layout` describes everything a worker
needs to map them (``radixkv.engine.buffers.attach_buffers``), as plain JSON-able data.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.tiered_cache import TieredRadixCache
from radixkv.contracts import KVAllocator, PoolRequest, StorageBackend
from radixkv.engine.buffers import WorkerBuffers
from radixkv.engine.config import EngineConfig
from radixkv.engine.layout import (
    LAYOUT_FORMAT,
    build_kv_pool,
    build_mamba_pool,
    plan_arenas,
    register_embedded,
)
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.memory import Arena, HybridLinearKVPool, HybridReqToTokenPool, MambaPool, ReqToTokenPool
from radixkv.memory.host_kv_pool import HostKVPool
from radixkv.memory.host_state_pool import HostStatePool
from radixkv.storage.keys import layout_fingerprint
from radixkv.storage.tier_controller import StorageController

if TYPE_CHECKING:
    from radixkv.engine.buffers import WorkerBuffers

__all__ = ["EnginePools", "build_tree", "hybrid_fingerprint", "kv_fingerprint", "open_tier_storage"]

log = logging.getLogger(__name__)


class EnginePools:
    """Every pool of one engine, built from a config.

    Args: ``config`` (the engine config); ``buffers`` (optional ``{pool name: 1-D tensor}`` of
    existing memory, shared memory on CPU or CUDA IPC on GPU, to build those pools over instead of
    allocating; each holds at least ``plan_arenas(config)[name].total_bytes`` bytes).

    Attributes: ``config``, ``device``, ``req_to_token_pool``, ``kv_pool``, ``mamba_pool`` and
    ``hybrid_kv_pool`` (``None`` unless hybrid), ``allocator`` (token or paged, ``need_sort=True``),
    ``host_pool`` / ``host_state_pool`` (the host tiers, ``None`` unless ``host_kv_tokens`` /
    ``host_state_slots``; the manager's own memory), ``embedded_key`` (how in-process workers
    find these pools). Raises ``InvalidArgumentError`` (a CUDA device without CUDA, unknown buffer names, a
    buffer too small / misaligned / on another device).
    """

    def __init__(self, config: EngineConfig, buffers: dict[str, torch.Tensor] | None = None):
        if not isinstance(config, EngineConfig):
            raise InvalidArgumentError(f"expected an EngineConfig, got {type(config).__name__}")
        dev = config.torch_device
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise InvalidArgumentError(f"device {config.device!r} requested but CUDA is not available")
        plans = plan_arenas(config)
        buffers = dict(buffers or {})
        unknown = sorted(set(buffers) - set(plans))
        if unknown:
            raise InvalidArgumentError(f"buffers given for unknown pools {unknown}; pools are {sorted(plans)}")
        self.config = config
        self.device = dev
        self.kv_pool = build_kv_pool(config, buffers.get("kv"))
        self.mamba_pool: MambaPool | None = None
        self.hybrid_kv_pool: HybridLinearKVPool | None = None
        if config.is_hybrid:
            self.mamba_pool = build_mamba_pool(config, buffers.get("mamba"))
            self.req_to_token_pool: ReqToTokenPool = HybridReqToTokenPool(
                config.request_rows, config.max_context_len, self.mamba_pool, device=dev,
                checks=config.checks, buffer=buffers.get("req_to_token"),
                enable_mamba_extra_buffer=config.track_interval is not None,
                mamba_track_interval=config.track_interval)
            self.hybrid_kv_pool = HybridLinearKVPool(self.kv_pool, list(config.full_layer_ids),
                                                     self.mamba_pool,
                                                     linear_layer_ids=list(config.kda_layer_ids))
        else:
            self.req_to_token_pool = ReqToTokenPool(config.request_rows, config.max_context_len, dev,
                                                    checks=config.checks,
                                                    buffer=buffers.get("req_to_token"))
        self.allocator: KVAllocator
        if config.page_size == 1:
            self.allocator = TokenToKVPoolAllocator(config.kv_tokens, dev, need_sort=True,
                                                    kvcache=self.kv_pool, checks=config.checks)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(config.kv_tokens, config.page_size, dev,
                                                         need_sort=True, kvcache=self.kv_pool,
                                                         checks=config.checks)
        self.host_pool: HostKVPool | None = None
        if config.host_kv_tokens:  # MHA or MLA; a hybrid model's full-attention KV
            self.host_pool = HostKVPool(self.kv_pool, config.host_kv_tokens // config.page_size)
        self.host_state_pool: HostStatePool | None = None
        if config.host_state_slots and self.mamba_pool is not None:  # KV-only: refused by the config
            self.host_state_pool = HostStatePool(self.mamba_pool, config.host_state_slots)
        for name, arena in self.arenas().items():
            if arena.layout != plans[name]:
                raise InvariantError(f"pool {name!r} was built with a layout other than plan_arenas() gives")
        self.embedded_key = register_embedded(self)

    def arenas(self) -> dict[str, Arena]:
        """``{pool name: Arena}``: the one allocation of each pool."""
        out = {"req_to_token": self.req_to_token_pool.arena, "kv": self.kv_pool.arena}
        if self.mamba_pool is not None:
            out["mamba"] = self.mamba_pool.arena
        return out

    def buffers(self) -> dict[str, torch.Tensor]:
        """``{pool name: its flat uint8 buffer}`` (what ``attach_buffers`` takes)."""
        return {name: a.buffer for name, a in self.arenas().items()}

    def layout(self, mappings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """Plain, JSON-able description of the pools: ``format``, ``config`` (the engine
        config's ``to_dict()``), ``device``, ``page_size``, ``layers`` (``types``, global
        ``full`` and ``kda`` ids) and ``pools``: per pool its ``kind``, ``arena``
        (``ArenaLayout.to_dict()``) and ``mapping`` (how a worker maps the bytes:
        ``{"mode": "embedded", "key": ...}`` in-process unless ``mappings`` gives one, e.g. a
        shared-memory file or CUDA IPC handle filled in by the service)."""
        mappings = dict(mappings or {})
        unknown = sorted(set(mappings) - set(self.arenas()))
        if unknown:
            raise InvalidArgumentError(f"mappings given for unknown pools {unknown}")
        kinds = {"req_to_token": "hybrid_req_to_token" if self.mamba_pool is not None else "req_to_token",
                 "kv": "mha", "mamba": "mamba"}
        c = self.config
        return {
            "format": LAYOUT_FORMAT,
            "config": c.to_dict(),
            "device": str(self.device),
            "page_size": c.page_size,
            "layers": {"types": c.layer_types, "full": list(c.full_layer_ids), "kda": list(c.kda_layer_ids)},
            "pools": {
                name: {"kind": kinds[name], "arena": arena.layout.to_dict(),
                       "mapping": dict(mappings.get(name, {"mode": "embedded", "key": self.embedded_key}))}
                for name, arena in self.arenas().items()
            },
        }

    def worker_buffers(self) -> WorkerBuffers:
        """A :class:`~radixkv.engine.buffers.WorkerBuffers` over these very pools."""
        return WorkerBuffers.from_pools(self)

    def check_invariants(self, reqs: Iterable[PoolRequest] | None = None) -> None:
        """Every pool's own invariants (the request pool against ``reqs``, every request
        holding a row, when given). Raises ``InvariantError``."""
        self.allocator.check_invariants()
        self.req_to_token_pool.check_invariants(None if reqs is None else list(reqs))
        self.kv_pool.check_invariants()
        if self.hybrid_kv_pool is not None:
            self.hybrid_kv_pool.check_invariants()


def build_tree(pools: EnginePools, storage: StorageBackend | None = None) -> RadixCache:
    """The prefix tree over ``pools`` as the config asks (policy, admission, events).

    KV-only models get a :class:`RadixCache`. Hybrid models get a ``MambaRadixCache`` over the
    hybrid request pool (its ``mamba_pool`` holds the states): ``eviction_policy`` orders the full (KV) eviction,
    ``admission_policy`` is passed through (``every``: every cached node end gets a state;
    ``branch``: states at request ends and branch points; ``none`` disables the cache),
    ``checks`` its free-mask lookups, ``host_state_pool`` the host state tier (with
    ``host_kv_tokens``: a ``TieredMambaRadixCache``, storage keys seeded by
    :func:`hybrid_fingerprint`). KV-only models with ``host_kv_tokens``: a
    :class:`TieredRadixCache` (storage: ``storage`` or ``config.storage``). O(1)."""
    c = pools.config
    if pools.host_pool is not None and pools.host_state_pool is not None:  # a hybrid model (config-checked)
        from radixkv.cache.hybrid.tiered_mamba_cache import TieredMambaRadixCache

        return TieredMambaRadixCache(pools.req_to_token_pool, pools.allocator, host_pool=pools.host_pool,
                                     host_state_pool=pools.host_state_pool, page_size=c.page_size,
                                     eviction_policy=c.eviction_policy, admission_policy=c.admission_policy,
                                     checks=c.checks, write_policy=c.write_policy,
                                     enable_kv_events=c.enable_kv_events, storage=open_tier_storage(pools, storage),
                                     layout_fingerprint=hybrid_fingerprint(c))
    if pools.host_pool is not None:
        return TieredRadixCache(pools.req_to_token_pool, pools.allocator, host_pool=pools.host_pool,
                                page_size=c.page_size, eviction_policy=c.eviction_policy,
                                write_policy=c.write_policy, storage=open_tier_storage(pools, storage),
                                layout_fingerprint=kv_fingerprint(c), disable=c.admission_policy == "none",
                                enable_kv_events=c.enable_kv_events)
    if c.is_hybrid:
        from radixkv.cache.hybrid.mamba_radix_cache import MambaRadixCache

        return MambaRadixCache(pools.req_to_token_pool, pools.allocator, page_size=c.page_size,
                               eviction_policy=c.eviction_policy, admission_policy=c.admission_policy,
                               enable_kv_events=c.enable_kv_events, checks=c.checks,
                               host_state_pool=pools.host_state_pool)
    return RadixCache(pools.req_to_token_pool, pools.allocator, page_size=c.page_size,
                      eviction_policy=c.eviction_policy, disable=c.admission_policy == "none",
                      enable_kv_events=c.enable_kv_events)


def kv_fingerprint(c: EngineConfig) -> str:
    """The KV layout's fingerprint that seeds the storage keys (layers, heads, head dim,
    dtype, page size; MLA: the latent's split too): a manager with another layout never
    loads these pages."""
    if c.is_mla:
        return layout_fingerprint(kind="mla", layers=len(c.full_layer_ids), kv_lora_rank=c.kv_lora_rank,
                                  qk_rope_head_dim=c.qk_rope_head_dim, dtype=c.kv_dtype, page_size=c.page_size)
    return layout_fingerprint(kind="mha", layers=len(c.full_layer_ids), heads=c.head_num,
                              head_dim=c.head_dim, dtype=c.kv_dtype, page_size=c.page_size)


def hybrid_fingerprint(c: EngineConfig) -> str:
    """The fingerprint seeding a hybrid model's storage page keys: the KV layout's and the
    layer pattern, so a KV-only model or another hybrid never shares its pages."""
    return layout_fingerprint(kind="hybrid", kv=kv_fingerprint(c), layers=c.layer_types)


def open_tier_storage(pools: EnginePools, backend: StorageBackend | None = None) -> StorageController | None:
    """The storage controller of the host tier: over ``backend`` when given, else over the
    backend ``config.storage`` names (``radixkv.storage.url.open_storage``); ``None`` when
    neither. Raises ``InvalidArgumentError`` for a URL no backend of this build opens."""
    c, url = pools.config, pools.config.storage
    if pools.host_pool is None or (backend is None and url is None):
        return None
    if backend is None and url is not None:
        try:
            from radixkv.storage.url import open_storage
        except ImportError:
            raise InvalidArgumentError(f"storage {c.storage!r}: this build has no storage backends "
                                       "(radixkv.storage.url)") from None
        try:
            backend = open_storage(url, page_bytes=pools.host_pool.page_bytes)
        except (InvalidArgumentError, ImportError):
            raise  # a bad URL or a backend not installed: the configuration is wrong
        except Exception as e:  # unreachable at start: serve from the device and host tiers
            log.warning("storage %r is unavailable (%s: %s); running on the device and host tiers",
                        url, type(e).__name__, e)
            return None
    if backend is None:
        return None
    return StorageController(backend, pools.host_pool.page_bytes, timeout_s=c.storage_timeout_ms / 1000.0,
                             admit=c.storage_admit, read_threads=c.storage_read_threads or None)
