"""The pools' layout as plain data, and building a pool over given memory: what both the
engine's pools (:mod:`~radixkv.engine.pools`) and a worker's views
(:mod:`~radixkv.engine.buffers`) need, so neither imports the other.

* :func:`plan_arenas`: every pool's :class:`~radixkv.memory.arena.ArenaLayout` for a config,
  computed without allocating;
* :func:`build_kv_pool` / :func:`build_mamba_pool`: the KV / KDA-state pool of a config over
  an existing buffer (or a fresh one);
* the in-process registry: a layout mapped ``{"mode": "embedded", "key": k}`` names pools
  of this very process; :func:`register_embedded` files them (weakly) under ``k`` and
  :func:`find_embedded` finds them again. It is the only process-wide state here.
"""
from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import torch

from radixkv.engine.config import EngineConfig
from radixkv.memory import ArenaLayout, MambaPool, MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool, plan_layout
from radixkv.memory.arena import DEFAULT_ALIGNMENT
from radixkv.memory.hybrid import MAPPING, OWNER, TRACK, TRACK_SIZE

if TYPE_CHECKING:
    from radixkv.engine.pools import EnginePools

__all__ = ["POOL_NAMES", "LAYOUT_FORMAT", "plan_arenas", "build_kv_pool", "build_mamba_pool",
           "register_embedded", "find_embedded"]

POOL_NAMES = ("req_to_token", "kv", "mamba")
LAYOUT_FORMAT = "radixkv.engine.layout/1"

def _store_dtype(name: str) -> torch.dtype:
    """The dtype a KV pool stores ``name`` as (fp8 as uint8, as ``KVCache`` does)."""
    from radixkv.memory.arena import parse_dtype
    from radixkv.memory.kv_pool import _FP8

    dt = parse_dtype(name)
    return torch.uint8 if dt in _FP8 else dt


def plan_arenas(config: EngineConfig) -> dict[str, ArenaLayout]:
    """The arena layout of every pool of ``config`` (``"mamba"`` only for hybrid models),
    computed without allocating: what shared buffers must hold. O(layers)."""
    c = config
    r2t: list[tuple[str, tuple[int, ...], torch.dtype]] = [
        (ReqToTokenPool.TABLE, (c.request_rows + 1, c.max_context_len), torch.int32)]
    if c.is_hybrid:
        r2t += [(MAPPING, (c.request_rows + 1,), torch.int32), (OWNER, (c.state_slots + 1,), torch.int32)]
        if c.track_interval is not None:
            r2t.append((TRACK, (c.request_rows + 1, TRACK_SIZE), torch.int32))
    n_full = len(c.full_layer_ids)
    shape = (c.kv_tokens + c.page_size, c.head_num, c.head_dim)
    sd = _store_dtype(c.kv_dtype)
    if c.is_mla:  # one latent buffer per layer ([rows, 1, kv_lora_rank + qk_rope_head_dim]: head_num, head_dim)
        kv = [(f"kv.{l}", shape, sd) for l in range(n_full)]
    else:
        kv = [(f"k.{l}", shape, sd) for l in range(n_full)] + [(f"v.{l}", shape, sd) for l in range(n_full)]
    plans = {"req_to_token": plan_layout(r2t, DEFAULT_ALIGNMENT), "kv": plan_layout(kv, DEFAULT_ALIGNMENT)}
    if c.is_hybrid:
        n_kda = len(c.kda_layer_ids)
        plans["mamba"] = plan_layout([
            ("conv", (n_kda, c.state_slots + 1) + c.conv_state_shape, c.state_dtype),
            ("temporal", (n_kda, c.state_slots + 1) + c.temporal_state_shape, c.temporal_dtype),
        ], DEFAULT_ALIGNMENT)
    return plans


def build_kv_pool(config: EngineConfig, buffer: torch.Tensor | None = None,
                  device: str | torch.device | None = None) -> MHATokenToKVPool | MLATokenToKVPool:
    """The full-attention KV pool of ``config`` (over ``buffer`` when given): MLA latents
    when ``config.is_mla``, else K and V."""
    c = config
    dev = device if device is not None else c.torch_device
    if c.is_mla:
        return MLATokenToKVPool(c.kv_tokens, c.page_size, c.kv_dtype, c.kv_lora_rank, c.qk_rope_head_dim,
                                len(c.full_layer_ids), dev, checks=c.checks, buffer=buffer)
    return MHATokenToKVPool(c.kv_tokens, c.page_size, c.kv_dtype, c.head_num, c.head_dim,
                            len(c.full_layer_ids), dev, checks=c.checks, buffer=buffer)


def build_mamba_pool(config: EngineConfig, buffer: torch.Tensor | None = None,
                     device: str | torch.device | None = None) -> MambaPool:
    """The KDA state pool of a hybrid ``config`` (over ``buffer`` when given)."""
    c = config
    return MambaPool(c.state_slots, c.conv_state_shape, c.temporal_state_shape, len(c.kda_layer_ids),
                     c.state_dtype, device if device is not None else c.torch_device,
                     temporal_dtype=c.temporal_dtype, checks=c.checks, buffer=buffer)


_EMBEDDED: weakref.WeakValueDictionary[str, EnginePools] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def register_embedded(pools: EnginePools) -> str:
    """Register in-process pools so ``attach_buffers`` can find them from a layout whose
    mapping is ``{"mode": "embedded", "key": key}``; returns the key. Held weakly."""
    key = f"embedded-{next(_KEYS)}"
    _EMBEDDED[key] = pools
    return key


def find_embedded(key: object) -> EnginePools | None:
    """The in-process pools registered under ``key`` (as read from a layout), or None (not a
    str, never registered, or gone)."""
    return _EMBEDDED.get(key) if isinstance(key, str) else None
