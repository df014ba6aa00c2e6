"""Fixed-size recurrent state slots for linear-attention layers (Mamba / KDA).

A request on a hybrid model holds one *slot* of a :class:`MambaPool`: for every linear layer
a conv state (the causal conv1d's sliding window) and a temporal state (the SSM / delta-rule
matrix), both of a size independent of the sequence length. Slots ``1..size`` are handed out
(slot 0 is padding); the states live in one :class:`~radixkv.memory.arena.Arena`, the free
slots in one :class:`~radixkv.allocator.FreeSlots` on the pool's device.

:class:`KimiLinearStateShape` computes the two state shapes of a Kimi Linear (KDA) layer.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from radixkv.allocator import FreeSlots
from radixkv.contracts import IndexLike, LayerLike
from radixkv.errors import InvalidArgumentError, InvariantError
from radixkv.kernels.state_copy import copy_states, resolve_backend
from radixkv.memory.arena import DEFAULT_ALIGNMENT, Arena, parse_dtype, plan_layout
from radixkv.validation import (
    check_allocated,
    check_range,
    check_same_length,
    check_unique,
    index_tensor,
    layer_index,
)

GiB = 1 << 30


def _check_pos(name: str, v: object, lo: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def _check_shape(name: str, shape: Sequence[int]) -> tuple[int, ...]:
    try:
        out = tuple(shape)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be a sequence of ints, got {shape!r}") from None
    for d in out:
        _check_pos(f"{name} dimension", d)
    return out


class KimiLinearStateShape(NamedTuple):
    """State shapes of one KDA (Kimi Delta Attention) layer on one tensor-parallel rank, as
    SGLang's ``KimiLinearStateShape.create``:

    * ``conv = (conv_kernel_size - 1, proj_size / tp)``: the conv1d window of ONE projection
      (``proj_size`` defaults to ``num_heads * head_dim``);
    * ``temporal = (num_heads / tp, head_dim, head_dim)``: one delta-rule state per head.

    A ``MambaPool`` keeps the ``num_conv_states`` (3: q, k, v) conv tensors concatenated:
    :attr:`pool_conv`, ``(conv_kernel_size - 1, 3 * proj_size / tp)``
    (``docs/internals.md``, "KDA state shapes").
    """

    conv: tuple[int, int]
    temporal: tuple[int, int, int]
    num_heads: int
    head_dim: int
    conv_kernel_size: int
    proj_size: int
    tp_world_size: int
    num_conv_states: int = 3

    @property
    def pool_conv(self) -> tuple[int, int]:
        """The one conv state a ``MambaPool`` keeps per layer: q|k|v channels concatenated."""
        return (self.conv[0], self.conv[1] * self.num_conv_states)

    @classmethod
    def create(cls, num_heads: int, head_dim: int, conv_kernel_size: int,
               proj_size: int | None = None, tp_world_size: int = 1) -> KimiLinearStateShape:
        """Shapes for one rank of ``tp_world_size`` (``proj_size`` default ``num_heads *
        head_dim``).

        Raises:
            InvalidArgumentError: a non-positive argument, ``conv_kernel_size < 2``, or
                ``num_heads`` / ``proj_size`` not divisible by ``tp_world_size``.
        """
        _check_pos("num_heads", num_heads)
        _check_pos("head_dim", head_dim)
        _check_pos("conv_kernel_size", conv_kernel_size, 2)
        _check_pos("tp_world_size", tp_world_size)
        if proj_size is None:
            proj_size = num_heads * head_dim
        _check_pos("proj_size", proj_size)
        for name, v in (("num_heads", num_heads), ("proj_size", proj_size)):
            if v % tp_world_size:
                raise InvalidArgumentError(f"{name}={v} is not divisible by tp_world_size={tp_world_size}")
        return cls(
            conv=(conv_kernel_size - 1, proj_size // tp_world_size),
            temporal=(num_heads // tp_world_size, head_dim, head_dim),
            num_heads=num_heads, head_dim=head_dim, conv_kernel_size=conv_kernel_size,
            proj_size=proj_size, tp_world_size=tp_world_size,
        )


class Mamba2LayerCache(NamedTuple):
    """One layer's states: ``conv`` is a list holding one tensor ``[size+1, *conv_shape]``
    (SGLang's ``layer_cache.conv[0]``), ``temporal`` is ``[size+1, *temporal_shape]``."""

    conv: list[torch.Tensor]
    temporal: torch.Tensor


class MambaCache(NamedTuple):
    """All layers' states: ``conv`` a one-tensor list ``[[L, size+1, *conv]]``, ``temporal``
    ``[L, size+1, *temporal]``."""

    conv: list[torch.Tensor]
    temporal: torch.Tensor


class MambaStateSizeBytes(NamedTuple):
    conv_bytes: int
    temporal_bytes: int


class SlotViews:
    """Per-slot views of a pool's ``conv`` and ``temporal`` state tensors (``[layers, slots,
    ...]``): ``views[i]`` is ``(conv[:, i], temporal[:, i])``, made on first use and kept.

    Why: indexing ``t[:, i]`` costs ~2-3 µs of Python and ATen dispatch per call, and the
    per-request paths (zero a slot on alloc, fork one state) index four times; a kept view
    costs nothing more. The views stay current because a pool's state tensors are allocated
    once and only ever written in place. Memory: two small tensor headers per slot used.
    Slots are not checked here: the callers validated them.
    """

    __slots__ = ("conv", "temporal", "_views")

    def __init__(self, conv: torch.Tensor, temporal: torch.Tensor):
        self.conv, self.temporal = conv, temporal
        self._views: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * int(conv.shape[1])

    def __getitem__(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        v = self._views[slot]
        if v is None:
            v = self._views[slot] = (self.conv[:, slot], self.temporal[:, slot])
        return v

    def zero(self, slot: int) -> None:
        """Zero slot ``slot``'s states in every layer (two in-place fills)."""
        c, t = self[slot]
        c.zero_()
        t.zero_()

    def copy(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s states into slot ``dst`` in every layer (two in-place copies)."""
        cs, ts = self[src]
        cd, td = self[dst]
        cd.copy_(cs)
        td.copy_(ts)


class MambaPool:
    """State slots ``1..size`` of ``num_layers`` linear-attention layers.

    ``conv_state`` ``[num_layers, size+1, *conv_state_shape]`` and ``temporal_state``
    ``[num_layers, size+1, *temporal_state_shape]`` (dtypes ``conv_dtype`` / ``temporal_dtype``,
    else ``dtype``) are views into one arena. ``copy_backend`` (``None``, ``"torch"``,
    ``"triton"``) picks how ``copy_from`` moves states; overlapping copies always take the torch
    path (``docs/internals.md``, "State copies").

    Costs (k = slots in the call, S = bytes of one slot over all layers): ``alloc`` O(k * S)
    (it zeroes the slots), ``free`` O(k log k), ``copy_from`` O(k * S).
    """

    def __init__(self, size: int, conv_state_shape: Sequence[int], temporal_state_shape: Sequence[int],
                 num_layers: int, dtype: torch.dtype | str = torch.float32,
                 device: str | torch.device = "cpu", *,
                 conv_dtype: torch.dtype | str | None = None,
                 temporal_dtype: torch.dtype | str | None = None,
                 checks: bool = True, buffer: torch.Tensor | None = None,
                 alignment: int = DEFAULT_ALIGNMENT, copy_backend: str | None = None):
        self.size = _check_pos("size", size)
        self.num_layers = _check_pos("num_layers", num_layers)
        self.conv_state_shape = _check_shape("conv_state_shape", conv_state_shape)
        self.temporal_state_shape = _check_shape("temporal_state_shape", temporal_state_shape)
        self.dtype = parse_dtype(dtype)
        self.conv_dtype = parse_dtype(conv_dtype) if conv_dtype is not None else self.dtype
        self.temporal_dtype = parse_dtype(temporal_dtype) if temporal_dtype is not None else self.dtype
        self.device = torch.device(device)
        self.checks = checks
        self.copy_backend = resolve_backend(copy_backend, self.device)
        entries = [
            ("conv", (num_layers, size + 1) + self.conv_state_shape, self.conv_dtype),
            ("temporal", (num_layers, size + 1) + self.temporal_state_shape, self.temporal_dtype),
        ]
        self.arena = Arena(plan_layout(entries, alignment), self.device, buffer)
        self.conv_state: torch.Tensor = self.arena["conv"]
        self.temporal_state: torch.Tensor = self.arena["temporal"]
        self.mamba_cache = MambaCache(conv=[self.conv_state], temporal=self.temporal_state)
        self.free_slots = FreeSlots(size, device=self.device)
        self.slot_views = SlotViews(self.conv_state, self.temporal_state)

    @classmethod
    def from_state_shape(cls, size: int, shape: KimiLinearStateShape, num_layers: int,
                         dtype: torch.dtype | str = torch.float32,
                         device: str | torch.device = "cpu", **kwargs: Any) -> MambaPool:
        """A pool for layers of the given :class:`KimiLinearStateShape` (its conv state is
        ``shape.pool_conv``: the q, k and v windows in one tensor)."""
        return cls(size, shape.pool_conv, shape.temporal, num_layers, dtype, device, **kwargs)

    # -- slots ----------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free slots."""
        return int(self.free_slots.available())

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take ``n`` free slots (int64 tensor on the pool device) and zero their states in
        every layer; ``None`` (nothing changes) when fewer than ``n`` are free.

        Raises ``InvalidArgumentError`` when ``n`` is not a non-negative int.
        """
        if n == 1 and type(n) is int:
            i = self.alloc_one()
            # torch.full: a third of torch.tensor([i])'s cost (no Python list to convert)
            return None if i is None else torch.full((1,), i, dtype=torch.int64, device=self.device)
        ids = self.free_slots.alloc(n)
        if ids is None or ids.numel() == 0:
            return ids
        self.conv_state[:, ids] = 0
        self.temporal_state[:, ids] = 0
        return ids

    def alloc_one(self) -> int | None:
        """One slot as an int with its states zeroed in every layer (the slot ``alloc(1)``
        would give), or ``None`` when none is free. Two in-place slice writes, no index
        tensors (the slot's kept :class:`SlotViews`): the per-request case of a scheduler."""
        i = self.free_slots.alloc_one()
        if i is not None:
            self.slot_views.zero(i)
        return i

    def _slots(self, idx: IndexLike, what: str) -> torch.Tensor:
        if isinstance(idx, torch.Tensor) and idx.device != self.device:
            raise InvalidArgumentError(f"{what} are on {idx.device}, the pool on {self.device}")
        return index_tensor(idx, self.device, what)

    def free(self, indices: IndexLike) -> None:
        """Return slots ``indices`` (tensor, array, sequence or int).

        Raises (nothing changes): ``InvalidIndexError`` (outside ``1..size``),
        ``DoubleFreeError`` (already free, or repeated), ``InvalidArgumentError`` (dtype).
        """
        if type(indices) is list and len(indices) == 1 and type(indices[0]) is int:
            self.free_slots.free_one(indices[0])  # the tree frees one slot per state
            return
        if type(indices) is int:
            self.free_slots.free_one(indices)
            return
        self.free_slots.free(self._slots(indices, "indices"))

    def validate_allocated(self, indices: IndexLike, what: str = "slot") -> torch.Tensor:
        """``indices`` as an int64 tensor, checked to lie in ``1..size`` and be allocated.

        Raises ``InvalidIndexError`` / ``InvalidArgumentError`` naming the bad slots.
        """
        idx = self._slots(indices, what)
        check_range(idx, 1, self.size + 1, what)
        check_allocated(self.free_slots, idx, what)
        return idx

    def copy_from(self, src_indices: IndexLike, dst_indices: IndexLike) -> None:
        """Fork: copy every layer's conv and temporal state of slot ``src[i]`` into ``dst[i]``.

        Overlap is fine (the sources are gathered before anything is written).

        Raises (nothing changes): ``LengthMismatchError`` (lengths differ),
        ``InvalidIndexError`` (outside ``1..size``), ``InvalidArgumentError`` (a slot not
        allocated, or a destination repeated).
        """
        src = self._slots(src_indices, "src_indices")
        dst = self._slots(dst_indices, "dst_indices")
        check_same_length(src.numel(), dst.numel(), "copy_from: len(src_indices) vs len(dst_indices)")
        self.validate_allocated(src, "src slot")
        self.validate_allocated(dst, "dst slot")
        check_unique(dst, "dst slots")
        if src.numel() == 0:
            return
        if self.copy_backend == "triton" and not bool(torch.isin(dst, src).any()):
            # the kernel copies pair by pair, so it needs sources and destinations disjoint
            copy_states(self.conv_state, self.temporal_state, src, dst, backend="triton", checks=False)
            return
        self.conv_state[:, dst] = self.conv_state[:, src]  # gathers first: overlap is fine
        self.temporal_state[:, dst] = self.temporal_state[:, src]

    def clear(self) -> None:
        """Every slot free again (states are zeroed on the next ``alloc``)."""
        self.free_slots.clear()

    # -- views ----------------------------------------------------------------------------
    def mamba2_layer_cache(self, layer_id: LayerLike) -> Mamba2LayerCache:
        """Views of layer ``layer_id`` (an int in ``[0, num_layers)``); ``.conv[0]`` is its
        conv state, ``.temporal`` its temporal state. Raises ``InvalidIndexError``."""
        lid = layer_index(layer_id, self.num_layers)
        return Mamba2LayerCache(conv=[self.conv_state[lid]], temporal=self.temporal_state[lid])

    # -- accounting -----------------------------------------------------------------------
    def get_state_size_bytes(self) -> MambaStateSizeBytes:
        """Bytes of all conv states and all temporal states (every layer, slot 0 included)."""
        return MambaStateSizeBytes(self.conv_state.numel() * self.conv_state.element_size(),
                                   self.temporal_state.numel() * self.temporal_state.element_size())

    @property
    def slot_bytes(self) -> MambaStateSizeBytes:
        """Bytes one slot holds in ONE layer: ``(conv, temporal)``."""
        return MambaStateSizeBytes(math.prod(self.conv_state_shape) * self.conv_dtype.itemsize,
                                   math.prod(self.temporal_state_shape) * self.temporal_dtype.itemsize)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's one allocation (alignment padding included)."""
        return self.arena.nbytes

    @property
    def mem_usage(self) -> float:
        """GiB of conv + temporal states."""
        return sum(self.get_state_size_bytes()) / GiB

    def check_invariants(self) -> None:
        """Free slots sound (no leaked / double-freed / duplicated slot, slot 0 never free), and
        the states alias the arena with their shapes. Raises ``InvariantError``."""
        self.free_slots.check_invariants()
        self.arena.check_invariants()
        want_c = (self.num_layers, self.size + 1) + self.conv_state_shape
        want_t = (self.num_layers, self.size + 1) + self.temporal_state_shape
        if (self.conv_state is not self.arena.views.get("conv")
                or self.temporal_state is not self.arena.views.get("temporal")
                or tuple(self.conv_state.shape) != want_c or tuple(self.temporal_state.shape) != want_t):
            raise InvariantError(f"MambaPool states (shapes {tuple(self.conv_state.shape)}, "
                                 f"{tuple(self.temporal_state.shape)}; want {want_c}, {want_t}) "
                                 "are not the arena's views")
