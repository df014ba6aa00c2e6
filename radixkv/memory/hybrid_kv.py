"""``HybridLinearKVPool``: the KV pool of a hybrid model, routing global layer ids.

Full-attention layers go to a per-token KV pool (MHA or MLA), linear (KDA / Mamba) layers to
the layers of a :class:`~radixkv.memory.mamba_pool.MambaPool`. Pure routing: it owns no
memory of its own.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from radixkv.contracts import IndexLike, LayerLike, Scale
from radixkv.errors import InvalidArgumentError, InvalidIndexError, InvariantError, describe_ids
from radixkv.memory.kv_pool import KVCache, KVSizeBytes
from radixkv.memory.mamba_pool import Mamba2LayerCache, MambaPool


class HybridLinearKVPool:
    """The KV pool of a hybrid model: full-attention layers in ``full_kv_pool`` (an
    ``MHATokenToKVPool`` or ``MLATokenToKVPool`` with one layer per full-attention layer),
    linear (KDA) layers in ``mamba_pool`` (one Mamba layer per linear layer).

    Takes the pools already built (they are shared with the request pool and the allocator).
    ``full_attention_layer_ids`` are the global ids of the full layers, in the order of the
    KV pool's layers. The linear layers' global ids default to every id of
    ``range(len(full) + mamba_pool.num_layers)`` that is not a full one; the i-th smallest of
    them maps to Mamba layer i. Lookups are O(1) dict hits.
    """

    def __init__(self, full_kv_pool: KVCache, full_attention_layer_ids: Sequence[int],
                 mamba_pool: MambaPool, *, linear_layer_ids: Sequence[int] | None = None):
        if not isinstance(full_kv_pool, KVCache):
            raise InvalidArgumentError(f"full_kv_pool must be a KVCache, got {type(full_kv_pool).__name__}")
        if not isinstance(mamba_pool, MambaPool):
            raise InvalidArgumentError(f"mamba_pool must be a MambaPool, got {type(mamba_pool).__name__}")
        if full_kv_pool.device.type != mamba_pool.device.type:
            raise InvalidArgumentError(f"full_kv_pool on {full_kv_pool.device}, mamba_pool on {mamba_pool.device}")
        full = self._ids(full_attention_layer_ids, "full_attention_layer_ids")
        if len(full) != full_kv_pool.layer_num:
            raise InvalidArgumentError(f"{len(full)} full attention layer ids for a KV pool of "
                                       f"{full_kv_pool.layer_num} layers")
        total = len(full) + mamba_pool.num_layers
        if linear_layer_ids is None:
            if full and max(full) >= total:
                raise InvalidArgumentError(f"full attention layer id {max(full)} >= {total} layers; "
                                           "pass linear_layer_ids")
            linear = sorted(set(range(total)) - set(full))
        else:
            linear = sorted(self._ids(linear_layer_ids, "linear_layer_ids"))
            if len(linear) != mamba_pool.num_layers:
                raise InvalidArgumentError(f"{len(linear)} linear layer ids for a Mamba pool of "
                                           f"{mamba_pool.num_layers} layers")
            both = set(linear) & set(full)
            if both:
                raise InvalidArgumentError(f"layer ids both full and linear: {describe_ids(both)}")
        self.full_kv_pool = full_kv_pool
        self.mamba_pool = mamba_pool
        self.full_attention_layer_id_mapping: dict[int, int] = {g: i for i, g in enumerate(full)}
        self.linear_layer_id_mapping: dict[int, int] = {g: i for i, g in enumerate(linear)}
        self.layer_num = total
        self.size, self.page_size = full_kv_pool.size, full_kv_pool.page_size
        self.dtype, self.device = full_kv_pool.dtype, full_kv_pool.device

    @staticmethod
    def _ids(ids: Sequence[int], what: str) -> list[int]:
        out = []
        for g in ids:
            if isinstance(g, bool) or not isinstance(g, int) or g < 0:
                raise InvalidArgumentError(f"{what} must be ints >= 0, got {g!r}")
            out.append(g)
        if len(set(out)) != len(out):
            raise InvalidArgumentError(f"{what} has repeated ids: {out}")
        return out

    def _global(self, layer: LayerLike) -> int:
        g = getattr(layer, "layer_id", layer)
        if isinstance(g, bool) or not isinstance(g, (int, np.integer)):
            raise InvalidArgumentError(f"layer id must be an int, got {g!r}")
        g = int(g)
        if g not in self.full_attention_layer_id_mapping and g not in self.linear_layer_id_mapping:
            raise InvalidIndexError(f"layer id {g} is neither a full attention nor a linear layer")
        return g

    def _full(self, layer: LayerLike) -> int:
        g = self._global(layer)
        if g in self.linear_layer_id_mapping:
            raise InvalidArgumentError(f"layer {g} is a linear (KDA) layer: it has no KV buffer")
        return self.full_attention_layer_id_mapping[g]

    def get_key_buffer(self, layer_id: LayerLike) -> torch.Tensor:
        return self.full_kv_pool.get_key_buffer(self._full(layer_id))

    def get_value_buffer(self, layer_id: LayerLike) -> torch.Tensor:
        return self.full_kv_pool.get_value_buffer(self._full(layer_id))

    def get_kv_buffer(self, layer_id: LayerLike) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of full layer ``layer_id``. Raises ``InvalidArgumentError`` for a linear layer,
        ``InvalidIndexError`` for an unknown one."""
        return self.full_kv_pool.get_kv_buffer(self._full(layer_id))

    def set_kv_buffer(self, layer: LayerLike, loc: IndexLike, cache_k: torch.Tensor, cache_v: torch.Tensor | None,
                      k_scale: Scale | None = None, v_scale: Scale | None = None) -> None:
        """``full_kv_pool.set_kv_buffer`` on the mapped layer (raises as ``get_kv_buffer``)."""
        self.full_kv_pool.set_kv_buffer(self._full(layer), loc, cache_k, cache_v, k_scale, v_scale)

    def set_mla_kv_buffer(self, layer: LayerLike, loc: IndexLike, cache_k_nope: torch.Tensor,
                          cache_k_rope: torch.Tensor) -> None:
        """For an MLA full pool only (else ``InvalidArgumentError``)."""
        lid = self._full(layer)
        if not hasattr(self.full_kv_pool, "set_mla_kv_buffer"):
            raise InvalidArgumentError("the full attention pool is not an MLA pool")
        self.full_kv_pool.set_mla_kv_buffer(lid, loc, cache_k_nope, cache_k_rope)

    def mamba2_layer_cache(self, layer_id: LayerLike) -> Mamba2LayerCache:
        """Mamba views of linear layer ``layer_id``. Raises ``InvalidArgumentError`` for a full
        attention layer, ``InvalidIndexError`` for an unknown one."""
        g = self._global(layer_id)
        if g in self.full_attention_layer_id_mapping:
            raise InvalidArgumentError(f"layer {g} is a full attention layer: it has no Mamba state")
        return self.mamba_pool.mamba2_layer_cache(self.linear_layer_id_mapping[g])

    def get_kv_size_bytes(self) -> KVSizeBytes:
        """The full attention pool's ``(k_bytes, v_bytes)`` (Mamba states are accounted by the
        Mamba pool)."""
        return self.full_kv_pool.get_kv_size_bytes()

    @property
    def mem_usage(self) -> float:
        """GiB of the full attention pool's K + V."""
        return self.full_kv_pool.mem_usage

    @property
    def nbytes(self) -> int:
        """Bytes of the full attention pool's allocation."""
        return self.full_kv_pool.nbytes

    def check_invariants(self) -> None:
        """Both pools sound and the layer maps a partition onto their layers."""
        self.full_kv_pool.check_invariants()
        self.mamba_pool.check_invariants()
        f, l = self.full_attention_layer_id_mapping, self.linear_layer_id_mapping
        both = set(f) & set(l)
        if both or sorted(f.values()) != list(range(self.full_kv_pool.layer_num)) \
                or sorted(l.values()) != list(range(self.mamba_pool.num_layers)):
            raise InvariantError(f"layer maps inconsistent (ids in both: {describe_ids(both)})")
