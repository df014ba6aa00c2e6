"""vLLM's paged KV cache seen as K / V views, and the shape check against the manager's pool.

:func:`paged_kv_views` turns the tensor vLLM hands per attention layer into ``(K, V)`` views
``[num_blocks, block_size, kv_heads, head_dim]`` (aliasing, no copy), so the copies index
``K[block_ids, offsets]`` -> the manager's per-token rows ``[n, kv_heads, head_dim]``; an MLA
model's one part is the latent (``MLATokenToKVPool``'s row). Layouts read (vLLM 0.32.0):
``CPU_ATTN`` ``[num_blocks, kv_heads, block_size, 2 * head_size]``, FlashAttention / Triton
``[2, num_blocks, block_size, kv_heads, head_size]``, FlashInfer ``[num_blocks, 2, block_size,
kv_heads, head_size]``, MLA ``[num_blocks, 1, block_size, width]`` (CPU) or ``[num_blocks,
block_size, width]``. Anything else (another kernel block size, quantized KV) is refused with
:class:`LayoutMismatchError` naming the shape. Hybrid models: :class:`StateShape` (the state
layers' shapes, checked against the manager's state pool) and :func:`state_page_views` (a
recurrent layer's raw page per block -> conv and temporal byte rows). Details: ``docs/vllm.md``.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from radixkv.errors import InvalidArgumentError

__all__ = ["KVShape", "StateShape", "state_page_views",
           "HeadShard", "LayoutMismatchError", "RowGeometry", "paged_kv_views", "row_geometry",
           "manager_kv_shape", "check_same_shape", "head_shard"]


class LayoutMismatchError(InvalidArgumentError):
    """vLLM's KV cache and the manager's KV pool do not have the same shape."""


class StateShape(NamedTuple):
    """A hybrid model's recurrent state per layer: ``pattern`` (``F`` attention / ``K`` state,
    one per layer, in layer order), each state layer's conv and temporal shapes and dtypes."""

    pattern: str
    conv: tuple[int, ...]
    temporal: tuple[int, ...]
    conv_dtype: str
    temporal_dtype: str

    @property
    def layers(self) -> int:
        return self.pattern.count("K")

    def nbytes(self) -> tuple[int, int]:
        """Bytes of one conv state and one temporal state."""
        def size(dims: tuple[int, ...], dtype: str) -> int:
            return math.prod(dims) * int(getattr(torch, dtype).itemsize)
        return size(self.conv, self.conv_dtype), size(self.temporal, self.temporal_dtype)


class KVShape(NamedTuple):
    """The KV shape two sides must agree on to share rows (``layers``: the attention layers;
    ``state``: a hybrid model's state layers)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch."
    page_size: int  # vLLM: block_size
    latent: bool = False  # MLA: one latent row (kv_heads 1, head_dim its width), no V
    state: StateShape | None = None

    def describe(self) -> str:
        st = self.state
        return (f"layers={self.layers}, kv_heads={self.kv_heads}, head_dim={self.head_dim}, "
                f"dtype={self.dtype}, page_size={self.page_size}" + (", MLA latent" if self.latent else "")
                + (f", layer_types={st.pattern}, conv_state={st.conv} {st.conv_dtype}, temporal_state="
                   f"{st.temporal} {st.temporal_dtype}" if st is not None else ""))


class HeadShard(NamedTuple):
    """The KV heads one tensor-parallel rank holds: ``[first, first + num)`` of the
    manager's rows (which hold every head); ``writes``: this rank saves them (False for
    all but the first of the ranks that hold the same replicated heads)."""

    first: int
    num: int
    writes: bool = True


def head_shard(total_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """vLLM's split of ``total_heads`` KV heads over ``tp_size`` ranks (``QKVParallelLinear``):
    ``total / tp`` heads each, or one head replicated on ``tp / total`` ranks when
    ``tp > total``. Raises ``LayoutMismatchError`` when neither divides the other."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise LayoutMismatchError(f"tensor-parallel rank {tp_rank} of {tp_size}")
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise LayoutMismatchError(f"{total_heads} KV heads do not split over {tp_size} tensor-parallel ranks")
        per = total_heads // tp_size
        return HeadShard(tp_rank * per, per)
    if tp_size % total_heads:
        raise LayoutMismatchError(f"{total_heads} KV heads do not replicate over {tp_size} tensor-parallel ranks")
    replicas = tp_size // total_heads
    return HeadShard(tp_rank // replicas, 1, tp_rank % replicas == 0)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def manager_kv_shape(engine_config: dict[str, Any]) -> KVShape:
    """The KV shape of a manager's ``EngineConfig`` (``AttachInfo.layout["config"]``), with its
    state pool's shapes for a hybrid manager."""
    lt = str(engine_config.get("layer_types", ""))
    state = None
    if "K" in lt:
        from radixkv.engine.config import EngineConfig

        ec = EngineConfig.from_dict(dict(engine_config))
        state = StateShape(lt, ec.conv_state_shape, ec.temporal_state_shape, ec.state_dtype, ec.temporal_dtype)
    return KVShape(lt.count("F"), int(engine_config["head_num"]), int(engine_config["head_dim"]),
                   str(engine_config["kv_dtype"]), int(engine_config["page_size"]),
                   bool(engine_config.get("kv_lora_rank", 0)), state)


def state_page_views(raw: torch.Tensor, state: StateShape, name: str = "layer") -> tuple[torch.Tensor, torch.Tensor]:
    """The conv and temporal states of a recurrent layer's paged cache as byte rows
    ``[num_blocks, nbytes]`` (views, no copy). ``raw``: what vLLM 0.32.0 hands
    ``register_kv_caches`` for such a layer, ``int8 [num_blocks, ..., page_bytes]`` with a
    block stride of the (padded) page; the page holds the conv state then the temporal state.
    Raises ``LayoutMismatchError`` for anything else."""
    conv_b, temp_b = state.nbytes()
    if raw.dtype not in (torch.int8, torch.uint8) or raw.dim() < 2 or raw.stride(-1) != 1 \
            or any(d != 1 for d in raw.shape[1:-1]) or raw.shape[-1] < conv_b + temp_b:
        raise LayoutMismatchError(
            f"vLLM state cache of {name} has shape {tuple(raw.shape)} {raw.dtype} (strides {raw.stride()}), not "
            f"raw pages of >= {conv_b + temp_b} bytes (conv {state.conv} {state.conv_dtype} + temporal "
            f"{state.temporal} {state.temporal_dtype})")
    pages = raw.as_strided((raw.shape[0], raw.shape[-1]), (raw.stride(0), 1))
    return pages[:, :conv_b], pages[:, conv_b:conv_b + temp_b]


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
                   name: str = "layer", latent: bool = False) -> tuple[torch.Tensor, ...]:
    """The parts of one layer's paged KV tensor as views ``[num_blocks, block_size, kv_heads,
    head_dim]``: ``(K, V)``, or ``(latent,)`` for MLA (see the module doc for the layouts
    read). Raises ``LayoutMismatchError`` for a layout it does not know."""
    s = tuple(kv.shape)
    if latent:
        if kv_heads == 1 and kv.dim() == 4 and s[1:] == (1, block_size, head_dim):  # CPU MLA
            return (kv.permute(0, 2, 1, 3),)
        if kv_heads == 1 and kv.dim() == 3 and s[1:] == (block_size, head_dim):
            return (kv.unsqueeze(2),)
    elif kv.dim() == 4 and s[1:] == (kv_heads, block_size, 2 * head_dim) \
            and kv.stride(3) == 1 and kv.stride(2) == 2 * head_dim:  # CPU_ATTN
        both = kv.view(s[0], kv_heads, 2 * block_size, head_dim)
        return (both[:, :, :block_size].permute(0, 2, 1, 3), both[:, :, block_size:].permute(0, 2, 1, 3))
    elif kv.dim() == 5 and s[0] == 2 and s[2:] == (block_size, kv_heads, head_dim):  # FlashAttention
        return kv[0], kv[1]
    elif kv.dim() == 5 and s[1] == 2 and s[2:] == (block_size, kv_heads, head_dim):  # FlashInfer
        return kv[:, 0], kv[:, 1]
    raise LayoutMismatchError(
        f"vLLM KV cache tensor of {name} has shape {s} (strides {kv.stride()}), not a paged layout "
        f"RadixKVConnector reads for block_size={block_size}, kv_heads={kv_heads}, head_dim={head_dim}"
        f"{' (MLA latent)' if latent else ''} (CPU [blocks, heads, block, 2*head_dim]; FlashAttention "
        "[2, blocks, block, heads, head_dim]; FlashInfer [blocks, 2, block, heads, head_dim]; MLA "
        "[blocks, 1, block, width] or [blocks, block, width])")


class RowGeometry(NamedTuple):
    """Where each part (K / V, or the MLA latent) of (block, offset, head) lies in a layer
    tensor seen as rows of ``head_dim`` (``tensor.view(-1, head_dim)``): row ``base + block *
    block_stride + offset * offset_stride + head * head_stride`` (one ``base`` per part)."""

    bases: tuple[int, ...]
    block_stride: int
    offset_stride: int
    head_stride: int

    def rows(self, blocks: torch.Tensor, offsets: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
        """Each part's rows, ``[n * heads]`` each, token-major then head (the order of a
        ``[n, heads, head_dim]`` tensor's rows)."""
        at = (blocks * self.block_stride + offsets * self.offset_stride)[:, None] \
            + torch.arange(heads, device=blocks.device)[None, :] * self.head_stride
        at = at.reshape(-1)
        return tuple(at + b for b in self.bases)


def row_geometry(kv: torch.Tensor, parts: tuple[torch.Tensor, ...], head_dim: int) -> RowGeometry | None:
    """The :class:`RowGeometry` of views ``parts`` (``[blocks, block, heads, head_dim]`` each)
    of the contiguous layer tensor ``kv``, or ``None`` when they are not whole rows of it
    (then the copies index the views directly, more slowly). Copies by row index are one
    ``index_select`` / ``index_copy_`` on a contiguous 2-D tensor: much faster on CPU than
    advanced indexing of a permuted view."""
    strides = {p.stride()[:3] for p in parts}
    if not kv.is_contiguous() or any(p.stride(3) != 1 for p in parts) or len(strides) != 1:
        return None
    offsets = [p.storage_offset() - kv.storage_offset() for p in parts]
    vals = [*offsets, *strides.pop()]
    if any(x % head_dim for x in vals):
        return None
    sb, so, sh = (x // head_dim for x in vals[len(parts):])
    return RowGeometry(tuple(x // head_dim for x in offsets), sb, so, sh)
