"""The KV buffers: per-token K/V storage for full-attention layers (SGLang's ``KVCache``).

* :class:`MHATokenToKVPool` -- ``k_buffer[l]`` and ``v_buffer[l]`` per layer, each
  ``[size + page_size, head_num, head_dim]``.
* :class:`MLATokenToKVPool` -- one latent buffer per layer, ``[size + page_size, 1,
  kv_lora_rank + qk_rope_head_dim]``; the "value" is a view of its first ``kv_lora_rank``
  columns.

Row ``i`` of a layer's buffer holds the K/V of the token whose KV index is ``i`` (row 0 is
the padding slot dummy writes land in; the extra ``page_size - 1`` rows let a paged
allocator hand out the last page whole). All buffers of a pool are views into one
:class:`~radixkv.memory.arena.Arena`, so the pool is one block of memory.

fp8 dtypes are stored as ``uint8`` (index_put is not defined for fp8 everywhere) and viewed
back as the pool dtype by the getters, like SGLang's ``store_dtype``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from radixkv.contracts import IndexLike, LayerLike, Scale
from radixkv.errors import InvalidArgumentError, InvariantError, LengthMismatchError
from radixkv.memory.arena import DEFAULT_ALIGNMENT, Arena, parse_dtype, plan_layout
from radixkv.validation import check_range, index_tensor, layer_index

GiB = 1 << 30
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                         "float8_e5m2fnuz") if hasattr(torch, n))


class KVSizeBytes(NamedTuple):
    """Bytes of the K buffers and of the V buffers (all layers)."""

    k_bytes: int
    v_bytes: int


class KVCache:
    """Shared base: layer-id and location validation, dtype handling, byte accounting.

    Args:
        size: KV rows a token allocator may hand out (ids ``1..size``; 0 is padding).
        page_size: tokens per page; buffers get ``size + page_size`` rows.
        dtype: element type of the cache (fp8 is stored as uint8).
        layer_num: number of full-attention layers.
        device: where the buffers live.
        checks: validate ``loc`` ranges in setters (one device sync on CUDA per call).
        buffer: attach to this existing arena buffer instead of allocating (see ``Arena``).
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype | str, layer_num: int,
                 device: str | torch.device = "cpu", *, checks: bool = True):
        for name, v, lo in (("size", size, 1), ("page_size", page_size, 1), ("layer_num", layer_num, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {v!r}")
        self.size = size
        self.page_size = page_size
        self.dtype = parse_dtype(dtype)
        if not self.dtype.is_floating_point:
            raise InvalidArgumentError(f"KV cache dtype must be floating point, got {self.dtype}")
        self.store_dtype = torch.uint8 if self.dtype in _FP8 else self.dtype
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.checks = checks
        self.arena: Arena  # the subclass plans and allocates it

    @property
    def num_rows(self) -> int:
        """Rows per layer buffer: ``size + page_size``."""
        return self.size + self.page_size

    # -- validation helpers (no mutation) -------------------------------------------------
    def _layer(self, layer: LayerLike) -> int:
        return layer_index(layer, self.layer_num)

    def _loc(self, loc: IndexLike) -> torch.Tensor:
        if isinstance(loc, torch.Tensor) and loc.device != self.device:
            raise InvalidArgumentError(f"loc is on {loc.device}, the pool on {self.device}")
        idx = index_tensor(loc, self.device, "loc")
        if self.checks:
            check_range(idx, 0, self.num_rows, "loc")
        return idx

    def _values(self, x: object, n: int, tail: tuple[int, ...], what: str,
                scale: Scale | None = None) -> torch.Tensor:
        """``x`` checked to be a floating tensor of shape ``(n, *tail)`` on the pool device,
        divided by ``scale`` when given, cast to the pool dtype, as the store dtype."""
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise InvalidArgumentError(f"{what} must be floating point, got dtype {x.dtype}")
        if x.device != self.device:
            raise InvalidArgumentError(f"{what} is on {x.device}, the pool on {self.device}")
        if x.dim() == 0 or x.shape[0] != n:
            got = x.shape[0] if x.dim() else "a scalar"
            raise LengthMismatchError(f"{what} has {got} rows, loc has {n}")
        if tuple(x.shape[1:]) != tuple(tail):
            raise InvalidArgumentError(f"{what} rows have shape {tuple(x.shape[1:])}, expected {tail}")
        if scale is not None:
            x = x / scale
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if self.store_dtype != self.dtype:
            x = x.view(self.store_dtype)
        return x

    def _as_dtype(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.store_dtype == self.dtype else t.view(self.dtype)

    # -- buffers (the subclass's layout; see radixkv.contracts.KVPool) ---------------------
    def get_key_buffer(self, layer_id: LayerLike) -> torch.Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def get_value_buffer(self, layer_id: LayerLike) -> torch.Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def get_kv_buffer(self, layer_id: LayerLike) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def set_kv_buffer(self, layer: LayerLike, loc: IndexLike, cache_k: torch.Tensor,
                      cache_v: torch.Tensor | None, k_scale: Scale | None = None,
                      v_scale: Scale | None = None) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    # -- accounting -----------------------------------------------------------------------
    def get_kv_size_bytes(self) -> KVSizeBytes:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's one allocation (the arena, alignment padding included)."""
        return self.arena.nbytes

    @property
    def mem_usage(self) -> float:
        """GiB of K + V storage (SGLang's ``mem_usage``)."""
        k, v = self.get_kv_size_bytes()
        return (k + v) / GiB

    def _named_buffers(self) -> dict[str, torch.Tensor]:  # pragma: no cover - overridden
        raise NotImplementedError

    def check_invariants(self) -> None:
        """The arena's views still alias its one buffer, and the per-layer buffer lists hold
        exactly those views. Raises ``InvariantError`` naming the offending buffers."""
        self.arena.check_invariants()
        named = self._named_buffers()
        bad = sorted(n for n, t in named.items() if t is not self.arena.views.get(n))
        missing = sorted(set(self.arena.views) - set(named))
        if bad or missing:
            raise InvariantError(f"KV buffers not the arena's views: {bad}; arena views not in use: {missing}")


class MHATokenToKVPool(KVCache):
    """Multi-head attention KV buffers: ``k_buffer[l]``, ``v_buffer[l]`` of shape
    ``[size + page_size, head_num, head_dim]`` for ``l`` in ``range(layer_num)``.

    Getters are O(1) (views). ``set_kv_buffer`` is one scatter per buffer, O(len(loc) *
    head_num * head_dim).
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype | str, head_num: int,
                 head_dim: int, layer_num: int, device: str | torch.device = "cpu", *,
                 checks: bool = True, buffer: torch.Tensor | None = None,
                 alignment: int = DEFAULT_ALIGNMENT):
        super().__init__(size, page_size, dtype, layer_num, device, checks=checks)
        for name, v in (("head_num", head_num), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        self.head_num = head_num
        self.head_dim = head_dim
        shape = (self.num_rows, head_num, head_dim)
        entries = [(f"k.{l}", shape, self.store_dtype) for l in range(layer_num)]
        entries += [(f"v.{l}", shape, self.store_dtype) for l in range(layer_num)]
        self.arena = Arena(plan_layout(entries, alignment), self.device, buffer)
        self.k_buffer: list[torch.Tensor] = [self.arena[f"k.{l}"] for l in range(layer_num)]
        self.v_buffer: list[torch.Tensor] = [self.arena[f"v.{l}"] for l in range(layer_num)]

    def _named_buffers(self) -> dict[str, torch.Tensor]:
        out = {f"k.{l}": t for l, t in enumerate(self.k_buffer)}
        out.update({f"v.{l}": t for l, t in enumerate(self.v_buffer)})
        return out

    def get_key_buffer(self, layer_id: LayerLike) -> torch.Tensor:
        """Layer ``layer_id``'s K buffer (a view). Raises ``InvalidIndexError`` if out of range."""
        return self._as_dtype(self.k_buffer[self._layer(layer_id)])

    def get_value_buffer(self, layer_id: LayerLike) -> torch.Tensor:
        """Layer ``layer_id``'s V buffer (a view)."""
        return self._as_dtype(self.v_buffer[self._layer(layer_id)])

    def get_kv_buffer(self, layer_id: LayerLike) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` views of layer ``layer_id``."""
        lid = self._layer(layer_id)
        return self._as_dtype(self.k_buffer[lid]), self._as_dtype(self.v_buffer[lid])

    def set_kv_buffer(self, layer: LayerLike, loc: IndexLike, cache_k: torch.Tensor,
                      cache_v: torch.Tensor | None, k_scale: Scale | None = None, v_scale: Scale | None = None) -> None:
        """Write ``cache_k[i]`` / ``cache_v[i]`` into row ``loc[i]`` of layer ``layer``'s buffers.

        ``layer`` is an int or an object with ``.layer_id``. ``cache_k`` / ``cache_v`` are
        floating tensors ``[len(loc), head_num, head_dim]`` on the pool device; they are
        divided by ``k_scale`` / ``v_scale`` when given (the caller's tensors are not modified)
        and cast to the pool dtype.

        Raises (nothing written): ``InvalidIndexError`` (layer id or a loc out of range),
        ``LengthMismatchError`` (row counts differ from ``len(loc)``),
        ``InvalidArgumentError`` (wrong row shape, non-floating dtype, other device).
        """
        lid = self._layer(layer)
        idx = self._loc(loc)
        tail = (self.head_num, self.head_dim)
        k = self._values(cache_k, idx.numel(), tail, "cache_k", k_scale)
        v = self._values(cache_v, idx.numel(), tail, "cache_v", v_scale)
        self.k_buffer[lid][idx] = k
        self.v_buffer[lid][idx] = v

    def get_kv_size_bytes(self) -> KVSizeBytes:
        """``(k_bytes, v_bytes)`` summed over layers (element bytes, no padding)."""
        k = sum(t.numel() * t.element_size() for t in self.k_buffer)
        v = sum(t.numel() * t.element_size() for t in self.v_buffer)
        return KVSizeBytes(k, v)


class MLATokenToKVPool(KVCache):
    """Multi-head latent attention cache: per layer one latent buffer ``kv_buffer[l]`` of shape
    ``[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]``.

    ``get_key_buffer(l)`` is the whole latent; ``get_value_buffer(l)`` its first
    ``kv_lora_rank`` columns (a view, as in SGLang). Byte accounting reports the latent as
    the K bytes and 0 V bytes, since the value shares the key's storage.
    """

    def __init__(self, size: int, page_size: int, dtype: torch.dtype | str, kv_lora_rank: int,
                 qk_rope_head_dim: int, layer_num: int, device: str | torch.device = "cpu", *,
                 checks: bool = True, buffer: torch.Tensor | None = None,
                 alignment: int = DEFAULT_ALIGNMENT):
        super().__init__(size, page_size, dtype, layer_num, device, checks=checks)
        for name, v, lo in (("kv_lora_rank", kv_lora_rank, 1), ("qk_rope_head_dim", qk_rope_head_dim, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {v!r}")
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        shape = (self.num_rows, 1, self.kv_cache_dim)
        entries = [(f"kv.{l}", shape, self.store_dtype) for l in range(layer_num)]
        self.arena = Arena(plan_layout(entries, alignment), self.device, buffer)
        self.kv_buffer: list[torch.Tensor] = [self.arena[f"kv.{l}"] for l in range(layer_num)]

    def _named_buffers(self) -> dict[str, torch.Tensor]:
        return {f"kv.{l}": t for l, t in enumerate(self.kv_buffer)}

    def get_key_buffer(self, layer_id: LayerLike) -> torch.Tensor:
        """The latent buffer of layer ``layer_id`` (a view)."""
        return self._as_dtype(self.kv_buffer[self._layer(layer_id)])

    def get_value_buffer(self, layer_id: LayerLike) -> torch.Tensor:
        """The first ``kv_lora_rank`` columns of the latent buffer (a view)."""
        return self._as_dtype(self.kv_buffer[self._layer(layer_id)])[..., :self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: LayerLike) -> tuple[torch.Tensor, torch.Tensor]:
        lid = self._layer(layer_id)
        return self.get_key_buffer(lid), self.get_value_buffer(lid)

    def set_kv_buffer(self, layer: LayerLike, loc: IndexLike, cache_k: torch.Tensor,
                      cache_v: torch.Tensor | None = None, k_scale: Scale | None = None,
                      v_scale: Scale | None = None) -> None:
        """Write the full latent ``cache_k`` (``[len(loc), 1, kv_lora_rank +
        qk_rope_head_dim]``) into rows ``loc``; ``cache_v`` is ignored (it is a view of the
        latent), like SGLang. Raises as ``MHATokenToKVPool.set_kv_buffer``."""
        lid = self._layer(layer)
        idx = self._loc(loc)
        k = self._values(cache_k, idx.numel(), (1, self.kv_cache_dim), "cache_k", k_scale)
        self.kv_buffer[lid][idx] = k

    def set_mla_kv_buffer(self, layer: LayerLike, loc: IndexLike, cache_k_nope: torch.Tensor,
                          cache_k_rope: torch.Tensor) -> None:
        """Write ``cat(cache_k_nope, cache_k_rope, -1)`` into rows ``loc``: ``cache_k_nope`` is
        ``[n, 1, kv_lora_rank]``, ``cache_k_rope`` ``[n, 1, qk_rope_head_dim]``.

        Raises (nothing written) as ``set_kv_buffer``.
        """
        lid = self._layer(layer)
        idx = self._loc(loc)
        n = idx.numel()
        nope = self._values(cache_k_nope, n, (1, self.kv_lora_rank), "cache_k_nope")
        rope = self._values(cache_k_rope, n, (1, self.qk_rope_head_dim), "cache_k_rope")
        self.kv_buffer[lid][idx] = torch.cat([nope, rope], dim=-1)

    def get_kv_size_bytes(self) -> KVSizeBytes:
        """``(latent bytes, 0)`` summed over layers."""
        return KVSizeBytes(sum(t.numel() * t.element_size() for t in self.kv_buffer), 0)
