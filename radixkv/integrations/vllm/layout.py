"""vLLM's paged KV cache seen as K / V views, and the shape check against the manager's pool.

:func:`paged_kv_views` turns the tensor vLLM hands per attention layer into ``(K, V)`` views
``[num_blocks, block_size, kv_heads, head_dim]`` (aliasing, no copy), so the copies index
``K[block_ids, offsets]`` -> the manager's per-token rows ``[n, kv_heads, head_dim]``.
Layouts read (vLLM 0.32.0): ``CPU_ATTN`` ``[num_blocks, kv_heads, block_size, 2 *
head_size]``, FlashAttention / Triton ``[2, num_blocks, block_size, kv_heads, head_size]``,
FlashInfer ``[num_blocks, 2, block_size, kv_heads, head_size]``. Anything else (another
kernel block size, MLA, quantized KV) is refused with :class:`LayoutMismatchError` naming the
shape. Details: ``docs/vllm.md``, "vLLM KV layouts".
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from radixkv.errors import InvalidArgumentError

__all__ = ["KVShape", "LayoutMismatchError", "RowGeometry", "paged_kv_views", "row_geometry", "manager_kv_shape",
           "check_same_shape"]


class LayoutMismatchError(InvalidArgumentError):
    """vLLM's KV cache and the manager's KV pool do not have the same shape."""


class KVShape(NamedTuple):
    """The KV shape two sides must agree on to share rows."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch."
    page_size: int  # vLLM: block_size

    def describe(self) -> str:
        return (f"layers={self.layers}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, page_size={self.page_size}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def manager_kv_shape(engine_config: dict[str, Any]) -> KVShape:
    """The KV shape of a manager's ``EngineConfig`` (``AttachInfo.layout["config"]``).

    Raises ``LayoutMismatchError`` for a hybrid manager (state layers): the connector shares
    full-attention KV only."""
    lt = str(engine_config.get("layer_types", ""))
    if "K" in lt:
        raise LayoutMismatchError(f"the radixkv manager is configured for a hybrid model (layer_types "
                                  f"{lt!r}); RadixKVConnector shares full-attention KV only")
    return KVShape(lt.count("F"), int(engine_config["head_num"]), int(engine_config["head_dim"]),
                   str(engine_config["kv_dtype"]), int(engine_config["page_size"]))


def check_same_shape(engine: KVShape, manager: KVShape) -> None:
    """Raise ``LayoutMismatchError`` naming both shapes unless they are equal."""
    if engine != manager:
        diff = [f for f in KVShape._fields if getattr(engine, f) != getattr(manager, f)]
        raise LayoutMismatchError(
            f"vLLM KV cache ({engine.describe()}) != radixkv manager KV pool ({manager.describe()}); "
            f"differs in {diff}. Start the manager with `radixkv serve --model-config MODEL_DIR "
            f"--page-size {engine.page_size}` (or matching --layer-types/--head-num/--head-dim/"
            f"--kv-dtype)")


def paged_kv_views(kv: torch.Tensor, block_size: int, kv_heads: int, head_dim: int,
                   name: str = "layer") -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` views ``[num_blocks, block_size, kv_heads, head_dim]`` of one layer's
    paged KV tensor (see the module doc for the layouts read). Raises
    ``LayoutMismatchError`` for a layout it does not know."""
    s = tuple(kv.shape)
    if kv.dim() == 4 and s[1:] == (kv_heads, block_size, 2 * head_dim) \
            and kv.stride(3) == 1 and kv.stride(2) == 2 * head_dim:  # CPU_ATTN
        both = kv.view(s[0], kv_heads, 2 * block_size, head_dim)
        return (both[:, :, :block_size].permute(0, 2, 1, 3), both[:, :, block_size:].permute(0, 2, 1, 3))
    if kv.dim() == 5 and s[0] == 2 and s[2:] == (block_size, kv_heads, head_dim):  # FlashAttention
        return kv[0], kv[1]
    if kv.dim() == 5 and s[1] == 2 and s[2:] == (block_size, kv_heads, head_dim):  # FlashInfer
        return kv[:, 0], kv[:, 1]
    raise LayoutMismatchError(
        f"vLLM KV cache tensor of {name} has shape {s} (strides {kv.stride()}), not a paged layout "
        f"RadixKVConnector reads for block_size={block_size}, kv_heads={kv_heads}, head_dim={head_dim} "
        "(CPU [blocks, heads, block, 2*head_dim]; FlashAttention [2, blocks, block, heads, head_dim]; "
        "FlashInfer [blocks, 2, block, heads, head_dim])")


class RowGeometry(NamedTuple):
    """Where K / V of (block, offset, head) lie in a layer tensor seen as rows of
    ``head_dim`` (``tensor.view(-1, head_dim)``): row ``base + block * block_stride +
    offset * offset_stride + head * head_stride`` (``base``: ``k_base`` or ``v_base``)."""

    k_base: int
    v_base: int
    block_stride: int
    offset_stride: int
    head_stride: int

    def rows(self, blocks: torch.Tensor, offsets: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K rows, V rows), ``[n * heads]`` each, token-major then head (the order of a
        ``[n, heads, head_dim]`` tensor's rows)."""
        at = (blocks * self.block_stride + offsets * self.offset_stride)[:, None] \
            + torch.arange(heads, device=blocks.device)[None, :] * self.head_stride
        at = at.reshape(-1)
        return at + self.k_base, at + self.v_base


def row_geometry(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> RowGeometry | None:
    """The :class:`RowGeometry` of views ``k`` / ``v`` (``[blocks, block, heads, head_dim]``)
    of the contiguous layer tensor ``kv``, or ``None`` when they are not whole rows of it
    (then the copies index the views directly, more slowly). Copies by row index are one
    ``index_select`` / ``index_copy_`` on a contiguous 2-D tensor: much faster on CPU than
    advanced indexing of a permuted view."""
    if not kv.is_contiguous() or k.stride(3) != 1 or v.stride(3) != 1 or k.stride()[:3] != v.stride()[:3]:
        return None
    vals = [k.storage_offset() - kv.storage_offset(), v.storage_offset() - kv.storage_offset(), *k.stride()[:3]]
    if any(x % head_dim for x in vals):
        return None
    kb, vb, sb, so, sh = (x // head_dim for x in vals)
    return RowGeometry(kb, vb, sb, so, sh)
