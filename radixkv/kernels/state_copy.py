"""Recurrent-state slots: the index contract shared by the state kernels, and the state copy
used to fork a request's Mamba/KDA state (``copy_states``).

State tensors are laid out like ``MambaPool``'s: ``[num_layers, slots + 1, *state_shape]``
(all layers in one tensor) or, per layer, ``[slots + 1, *state_shape]``. Slot 0 is the padding
slot: decode kernels may point padded batch entries at it (its content is then undefined),
copies never touch it.

``copy_states(conv, temporal, src_idx, dst_idx)`` copies, for every layer, slot ``src_idx[i]``
to slot ``dst_idx[i]`` of every given state tensor. Torch path: one ``index_select`` +
``index_copy_`` per tensor. Triton path (dispatched on CUDA): one program per (pair, layer)
block-copying the flattened per-slot state (a state larger than ``_CHUNK`` elements is split
over a third grid axis so big states still spread over the GPU). Cost: O(pairs * layers *
state size) bytes moved, one launch per tensor.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.errors import (
    InvalidArgumentError,
    InvalidIndexError,
    LengthMismatchError,
    describe_ids,
)
from radixkv.kernels.triton_util import HAS_TRITON, triton_runnable, use_triton

if HAS_TRITON:
    from radixkv.kernels.triton_util import tl, triton

BACKENDS = ("torch", "triton")


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """``None`` -> the default for ``device`` (Triton on CUDA, torch elsewhere); an explicit
    ``"triton"`` must be runnable there (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    if backend is None:
        return "triton" if use_triton(device) else "torch"
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "triton" and not triton_runnable(device):
        raise InvalidArgumentError(
            f"the Triton backend cannot run on {device} (needs CUDA, or TRITON_INTERPRET=1 on CPU)"
        )
    return backend


def validate_slot_indices(
    indices: torch.Tensor,
    num_slots: int,
    *,
    name: str,
    device: torch.device,
    allow_padding: bool = True,
    distinct: bool = True,
) -> torch.Tensor:
    """Check a 1-D integer tensor of state slots and return it as int64 on ``device``.

    ``num_slots`` is the slot axis length (``slots + 1``). Valid slots are ``1..slots``, plus
    ``0`` when ``allow_padding``. With ``distinct`` no non-padding slot may appear twice (two
    writers of one slot would race). Raises ``InvalidArgumentError`` (dtype, shape),
    ``InvalidIndexError`` (range). Cost: O(n) plus one device sync.
    """
    if not isinstance(indices, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch tensor, got {type(indices).__name__}")
    if indices.dtype not in (torch.int32, torch.int64) or indices.dim() != 1:
        raise InvalidArgumentError(
            f"{name} must be a 1-D int32/int64 tensor, got dtype {indices.dtype}, shape {tuple(indices.shape)}"
        )
    idx = indices.to(device=device, dtype=torch.int64)
    low = 0 if allow_padding else 1
    bad = (idx < low) | (idx >= num_slots)
    if bool(bad.any()):
        raise InvalidIndexError(
            f"{name} out of range {low}..{num_slots - 1}: {describe_ids(idx[bad].tolist())}"
        )
    if distinct and idx.numel() > 1:
        real = idx[idx != 0]
        uniq, counts = torch.unique(real, return_counts=True)
        if bool((counts > 1).any()):
            raise InvalidArgumentError(f"{name} repeats slots {describe_ids(uniq[counts > 1].tolist())}")
    return idx


def _as_tensor_list(conv: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(conv, torch.Tensor):
        return [conv]
    tensors = list(conv)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise InvalidArgumentError("conv must be a tensor or a sequence of tensors")
    return tensors


def _per_slot_contiguous(t: torch.Tensor) -> bool:
    """True when each ``t[layer, slot]`` is one contiguous block (the Triton path's need)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def copy_states_torch(tensors: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Reference: ``t[:, dst] = t[:, src]`` for each tensor (one index_copy_ each)."""
    for t in tensors:
        t.index_copy_(1, dst, t.index_select(1, src))


if HAS_TRITON:

    @triton.jit
    def _copy_states_kernel(
        ptr,
        src_ptr,
        dst_ptr,
        layer_stride,
        slot_stride,
        numel,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        pair = tl.program_id(0)
        layer = tl.program_id(1).to(tl.int64)
        part = tl.program_id(2)
        src = tl.load(src_ptr + pair).to(tl.int64)
        dst = tl.load(dst_ptr + pair).to(tl.int64)
        src_base = ptr + layer * layer_stride + src * slot_stride
        dst_base = ptr + layer * layer_stride + dst * slot_stride
        start = part.to(tl.int64) * CHUNK
        for off in tl.range(0, CHUNK, BLOCK):
            offs = start + off + tl.arange(0, BLOCK)
            mask = offs < numel
            tl.store(dst_base + offs, tl.load(src_base + offs, mask=mask), mask=mask)


_BLOCK = 1024
_CHUNK = 64 * 1024


def copy_states_triton(tensors: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Triton path: per tensor, grid ``(pairs, layers, ceil(state_numel / _CHUNK))``."""
    pairs = src.numel()
    if pairs == 0:
        return
    for t in tensors:
        numel = 1
        for s in t.shape[2:]:
            numel *= s
        if numel == 0:
            continue
        block = min(_BLOCK, triton.next_power_of_2(numel))
        chunk = max(block, min(_CHUNK, triton.cdiv(numel, block) * block))
        grid = (pairs, t.shape[0], triton.cdiv(numel, chunk))
        _copy_states_kernel[grid](t, src, dst, t.stride(0), t.stride(1), numel, BLOCK=block, CHUNK=chunk)


def copy_states(
    conv: torch.Tensor | Sequence[torch.Tensor],
    temporal: torch.Tensor | None,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    *,
    backend: str | None = None,
    checks: bool = True,
) -> None:
    """Fork states in place: for every layer ``l`` and pair ``i``, slot ``dst_idx[i]`` of
    ``conv`` (a tensor or a list of tensors, each ``[layers, slots+1, ...]``) and ``temporal``
    (``[layers, slots+1, ...]`` or ``None``) becomes a copy of slot ``src_idx[i]``.

    Contract: ``src_idx``/``dst_idx`` are equal-length 1-D int tensors of slots in
    ``1..slots`` (slot 0 is padding); ``dst_idx`` has no repeats and shares no slot with
    ``src_idx`` (a source may fork to several destinations). All tensors share the device and
    slot axis. Violations raise a typed error (with ``checks``) before anything is written.
    ``backend``: ``None`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
    """
    tensors = _as_tensor_list(conv) + ([] if temporal is None else [temporal])
    if not tensors:
        raise InvalidArgumentError("copy_states needs at least one state tensor")
    device = tensors[0].device
    num_slots = tensors[0].shape[1] if tensors[0].dim() >= 2 else -1
    for t in tensors:
        if t.dim() < 2 or t.device != device or t.shape[1] != num_slots or t.shape[0] != tensors[0].shape[0]:
            raise InvalidArgumentError(
                "state tensors must be [layers, slots+1, ...] on one device with equal layers and slots, got "
                + ", ".join(f"{tuple(x.shape)}@{x.device}" for x in tensors)
            )
    mode = resolve_backend(backend, device)
    if src_idx.dim() != 1 or dst_idx.dim() != 1 or src_idx.numel() != dst_idx.numel():
        raise LengthMismatchError(
            f"src_idx and dst_idx must be 1-D of equal length, got {tuple(src_idx.shape)} and {tuple(dst_idx.shape)}"
        )
    if checks:
        src = validate_slot_indices(
            src_idx, num_slots, name="src_idx", device=device, allow_padding=False, distinct=False
        )
        dst = validate_slot_indices(dst_idx, num_slots, name="dst_idx", device=device, allow_padding=False)
        both = torch.isin(dst, src)
        if bool(both.any()):
            raise InvalidArgumentError(f"slots are both source and destination: {describe_ids(dst[both].tolist())}")
    else:
        src = src_idx.to(device=device, dtype=torch.int64)
        dst = dst_idx.to(device=device, dtype=torch.int64)
    if mode == "triton" and all(_per_slot_contiguous(t) for t in tensors):
        copy_states_triton(tensors, src, dst)
    elif mode == "triton" and backend == "triton":
        raise InvalidArgumentError("the Triton state copy needs each per-slot state to be contiguous")
    else:
        copy_states_torch(tensors, src, dst)
