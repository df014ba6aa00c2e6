"""``WorkerBuffers``: what a worker (model runner) reads and writes KV and states through.

A worker writes the K/V of the tokens it computes into the slots ``alloc_*`` returned, reads
the reused prefix through ``req_to_token`` and advances its state slot, all directly in the
engine's buffers. ``WorkerBuffers`` gives it the pools' API with GLOBAL layer ids:
``get_kv_buffer`` / ``set_kv_buffer``, ``mamba2_layer_cache`` (``.conv[0]``,
``.temporal``), ``req_to_token``. Get one in-process (``attach_buffers(layout)`` for
``"embedded"`` mappings, or ``EnginePools.worker_buffers()``) or over other memory
(``attach_buffers(layout, {"kv": t, ...})``, one flat tensor per pool: aliasing views, no
copies). Every view is checked against the layout, so a worker built for another config
fails at attach. See ``docs/internals.md``, "Worker buffers".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from radixkv.contracts import IndexLike, LayerLike, Scale
from radixkv.engine.config import EngineConfig
from radixkv.engine.layout import LAYOUT_FORMAT, build_kv_pool, build_mamba_pool, find_embedded
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.memory import Arena, ArenaLayout, HybridLinearKVPool, MambaPool, MHATokenToKVPool
from radixkv.memory.mamba_pool import Mamba2LayerCache
from radixkv.memory.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from radixkv.engine.pools import EnginePools

__all__ = ["WorkerBuffers", "attach_buffers"]


class WorkerBuffers:
    """The pools' buffer API over one engine's memory, by global layer id.

    Args:
        config: the engine's :class:`~radixkv.engine.config.EngineConfig`.
        kv_pool: the ``MHATokenToKVPool`` of the full-attention layers.
        req_to_token: the request-to-token table (int32 ``[rows + 1, max_context_len]``).
        mamba_pool: the ``MambaPool`` of the KDA layers (hybrid configs), else ``None``.

    Lookups are O(1); ``set_kv_buffer`` is one scatter per buffer. Holds no bookkeeping: the
    free lists stay with the engine.
    """

    def __init__(self, config: EngineConfig, kv_pool: MHATokenToKVPool, req_to_token: torch.Tensor,
                 mamba_pool: MambaPool | None = None):
        self.config = config
        self.req_to_token = req_to_token
        self.mamba_pool = mamba_pool
        self._mha = kv_pool
        if mamba_pool is not None:
            self.kv_pool: MHATokenToKVPool | HybridLinearKVPool = HybridLinearKVPool(
                kv_pool, list(config.full_layer_ids), mamba_pool, linear_layer_ids=list(config.kda_layer_ids))
        else:
            self.kv_pool = kv_pool
        self.device = kv_pool.device

    @classmethod
    def from_pools(cls, pools: EnginePools) -> WorkerBuffers:
        """Over an ``EnginePools``' own pools (in-process)."""
        return cls(pools.config, pools.kv_pool, pools.req_to_token_pool.req_to_token, pools.mamba_pool)

    # -- the pools' API ------------------------------------------------------------------
    def get_kv_buffer(self, layer_id: LayerLike) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` views ``[kv_tokens + page_size, head_num, head_dim]`` of full layer
        ``layer_id``. Raises ``InvalidArgumentError`` for a KDA layer, ``InvalidIndexError``
        for an unknown one."""
        return self.kv_pool.get_kv_buffer(layer_id)

    def set_kv_buffer(self, layer_id: LayerLike, loc: IndexLike, cache_k: torch.Tensor, cache_v: torch.Tensor,
                      k_scale: Scale | None = None, v_scale: Scale | None = None) -> None:
        """Write ``cache_k[i]`` / ``cache_v[i]`` into slot ``loc[i]`` of full layer
        ``layer_id`` (validated first; nothing written when it raises)."""
        self.kv_pool.set_kv_buffer(layer_id, loc, cache_k, cache_v, k_scale, v_scale)

    def mamba2_layer_cache(self, layer_id: LayerLike) -> Mamba2LayerCache:
        """``.conv[0]`` ``[state_slots + 1, conv_kernel - 1, C]`` and ``.temporal``
        ``[state_slots + 1, H, D, D]`` of KDA layer ``layer_id``. Raises
        ``InvalidArgumentError`` for a full-attention layer or a KV-only model."""
        if self.mamba_pool is None or not isinstance(self.kv_pool, HybridLinearKVPool):
            raise InvalidArgumentError("this engine's model has no KDA layers (no Mamba states)")
        return self.kv_pool.mamba2_layer_cache(layer_id)

    def check_invariants(self) -> None:
        """The views still alias their arenas with the layout's shapes and dtypes."""
        self._mha.check_invariants()
        if self.mamba_pool is not None:
            self.mamba_pool.arena.check_invariants()
        c = self.config
        want = (c.request_rows + 1, c.max_context_len)
        if tuple(self.req_to_token.shape) != want or self.req_to_token.dtype != torch.int32:
            raise InvariantError(f"req_to_token has shape {tuple(self.req_to_token.shape)} / "
                                 f"{self.req_to_token.dtype}, want {want} / int32")


def attach_buffers(layout: dict[str, Any], buffers_by_pool_name: dict[str, torch.Tensor] | None = None,
                   ) -> WorkerBuffers:
    """Views over an engine's memory, described by ``layout`` (``AttachInfo.layout``).

    ``buffers_by_pool_name`` gives, per pool of the layout, the flat tensor holding its
    bytes (mapped by the caller). A pool without one must be mapped ``"embedded"``: the
    engine is in this process and its pools are used directly.

    Raises ``InvalidArgumentError``: a malformed layout, a missing buffer, a buffer too
    small / misaligned, a buffer for an unknown pool, or an arena that does not match the
    layout's config (the worker and the manager disagree on the model shape).
    """
    if not isinstance(layout, dict) or layout.get("format") != LAYOUT_FORMAT:
        raise InvalidArgumentError(f"not an engine layout (format {LAYOUT_FORMAT!r} expected)")
    try:
        config = EngineConfig.from_dict(layout["config"])
        pools: dict[str, Any] = layout["pools"]
        arenas = {name: ArenaLayout.from_dict(p["arena"]) for name, p in pools.items()}
        mappings = {name: dict(p.get("mapping") or {}) for name, p in pools.items()}
    except (KeyError, TypeError, AttributeError) as e:
        raise InvalidArgumentError(f"malformed engine layout: {e!r}") from None
    want = {"req_to_token", "kv"} | ({"mamba"} if config.is_hybrid else set())
    if set(arenas) != want:
        raise InvalidArgumentError(f"layout pools {sorted(arenas)} != {sorted(want)} for this config")
    given = dict(buffers_by_pool_name or {})
    unknown = sorted(set(given) - set(arenas))
    if unknown:
        raise InvalidArgumentError(f"buffers given for unknown pools {unknown}")
    missing = [n for n in sorted(arenas) if n not in given]
    if missing:
        keys = {mappings[n].get("key") for n in missing}
        modes = {mappings[n].get("mode") for n in missing}
        if modes != {"embedded"} or len(keys) != 1:
            raise InvalidArgumentError(f"no buffer given for pools {missing} (mapped {sorted(map(str, modes))})")
        engine_pools = find_embedded(next(iter(keys)))
        if engine_pools is None:
            raise InvalidArgumentError(f"embedded pools {next(iter(keys))!r} are not in this process")
        own = engine_pools.buffers()
        for n in missing:
            given[n] = own[n]
    for name, buf in given.items():
        if not isinstance(buf, torch.Tensor):
            raise InvalidArgumentError(f"buffer of pool {name!r} must be a torch.Tensor")
    device = given["kv"].device
    kv = build_kv_pool(config, given["kv"], device=device)
    mamba = build_mamba_pool(config, given["mamba"], device=device) if config.is_hybrid else None
    table = Arena(arenas["req_to_token"], buffer=given["req_to_token"])
    built = {"kv": kv.arena.layout, "req_to_token": table.layout}
    if mamba is not None:
        built["mamba"] = mamba.arena.layout
    wrong = sorted(n for n in built if built[n] != arenas[n])
    if wrong:
        raise InvalidArgumentError(f"pools {wrong}: the layout's arena does not match its config")
    return WorkerBuffers(config, kv, table[ReqToTokenPool.TABLE], mamba)
