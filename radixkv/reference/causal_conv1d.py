"""Short causal depthwise conv1d with a rolling state (the KDA/Mamba input conv).

Convention (one channel ``c``, kernel width ``K``, weight ``w[c, 0..K-1]``): the output at
time ``t`` is ``y[t, c] = bias[c] + sum_j w[c, j] * x[t - (K-1) + j, c]``, i.e. ``w[c, K-1]``
multiplies the current input. The conv state of a sequence is its last ``K-1`` inputs,
oldest first: ``state[j] = x[t - (K-2) + j]`` (shape ``[K-1, C]``), zeros before the start.

* ``causal_conv1d_update`` (decode, one token per request, batched over state slots):
  torch reference + Triton kernel (dispatched on CUDA), updating the state in place.
* ``causal_conv1d_fn`` (prefill/extend of one sequence from an initial state): torch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.kernels.state_copy import resolve_backend, validate_slot_indices
from radixkv.kernels.triton_util import HAS_TRITON

if HAS_TRITON:
    from radixkv.kernels.triton_util import tl, triton

ACTIVATIONS = (None, "silu")


class ConvOutput(NamedTuple):
    """Result of ``causal_conv1d_fn``: outputs ``y [T, C]`` and the final state ``[K-1, C]``."""

    y: torch.Tensor
    final_state: torch.Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_common(weight: torch.Tensor, bias: torch.Tensor | None, channels: int, activation: str | None,
                  device: torch.device) -> int:
    if activation not in ACTIVATIONS:
        raise InvalidArgumentError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 2:
        raise InvalidArgumentError(f"weight must be [C={channels}, K>=2], got {tuple(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != channels):
        raise InvalidArgumentError(f"bias must be [C={channels}] or None, got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not t.is_floating_point() or t.device != device):
            raise InvalidArgumentError(f"{name} must be a floating tensor on {device}, got {t.dtype} on {t.device}")
    return weight.shape[1]


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> ConvOutput:
    """Causal depthwise conv of one sequence ``x [T, C]`` continuing from ``initial_state``
    (``[K-1, C]``, the previous ``K-1`` inputs; ``None`` = zeros). Returns ``ConvOutput(y [T, C],
    final_state [K-1, C])`` where ``final_state`` is the last ``K-1`` rows of
    ``cat(initial_state, x)`` (so chained calls equal one call). Computed in float64 for float64
    inputs, else float32; ``y`` has ``x.dtype``, the state ``initial_state``'s dtype (else
    ``x.dtype``). Cost: O(T*C*K), vectorized (no loop over time)."""
    if x.dim() != 2 or not x.is_floating_point():
        raise InvalidArgumentError(f"x must be a floating [T, C] tensor, got {x.dtype} {tuple(x.shape)}")
    kw = _check_common(weight, bias, x.shape[1], activation, x.device)
    if initial_state is not None and (
        initial_state.shape != (kw - 1, x.shape[1]) or initial_state.device != x.device
    ):
        raise InvalidArgumentError(
            f"initial_state must be [K-1={kw - 1}, C={x.shape[1]}] on {x.device}, got {tuple(initial_state.shape)}"
        )
    cdt = _compute_dtype(x.dtype)
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    if initial_state is None:
        initial_state = torch.zeros(kw - 1, x.shape[1], dtype=cdt, device=x.device)
    xp = torch.cat([initial_state.to(cdt), x.to(cdt)], dim=0)  # [T+K-1, C]
    windows = xp.unfold(0, kw, 1)  # [T, C, K]: windows[t, c, j] = xp[t + j, c]
    y = (windows * weight.to(cdt)).sum(-1)
    if bias is not None:
        y = y + bias.to(cdt)
    if activation == "silu":
        y = torch.nn.functional.silu(y)
    return ConvOutput(y.to(x.dtype), xp[xp.shape[0] - (kw - 1):].to(state_dtype).clone())


def causal_conv1d_update_torch(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None, activation: str | None, idx: torch.Tensor) -> torch.Tensor:
    """Reference decode step: gather the states, convolve, write the shifted states back."""
    cdt = _compute_dtype(x.dtype)
    window = torch.cat([conv_state.index_select(0, idx).to(cdt), x.to(cdt)[:, None, :]], dim=1)  # [B, K, C]
    y = (window * weight.to(cdt).t()[None]).sum(1)
    if bias is not None:
        y = y + bias.to(cdt)
    if activation == "silu":
        y = torch.nn.functional.silu(y)
    conv_state.index_copy_(0, idx, window[:, 1:].to(conv_state.dtype))
    return y.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def _conv_update_kernel(
        x_ptr,
        state_ptr,
        w_ptr,
        b_ptr,
        idx_ptr,
        y_ptr,
        C,
        stride_xb,
        stride_ss,
        stride_sr,
        stride_wc,
        stride_wk,
        stride_yb,
        KW: tl.constexpr,
        BLOCK_C: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        SILU: tl.constexpr,
        COMPUTE: tl.constexpr,
    ):
        # One program per (request, channel block). Each thread owns its channels across all
        # taps, so reading row j and then overwriting row j-1 is race-free.
        b = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        slot = tl.load(idx_ptr + b).to(tl.int64)
        sbase = state_ptr + slot * stride_ss + cols
        x = tl.load(x_ptr + b * stride_xb + cols, mask=cmask, other=0.0)
        acc = tl.zeros([BLOCK_C], dtype=COMPUTE)
        for j in tl.static_range(KW):
            if j < KW - 1:
                row = tl.load(sbase + j * stride_sr, mask=cmask, other=0.0).to(COMPUTE)
            else:
                row = x.to(COMPUTE)
            w = tl.load(w_ptr + cols * stride_wc + j * stride_wk, mask=cmask, other=0.0).to(COMPUTE)
            acc += w * row
            if j > 0:
                tl.store(sbase + (j - 1) * stride_sr, row.to(state_ptr.dtype.element_ty), mask=cmask)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(COMPUTE)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + b * stride_yb + cols, acc.to(y_ptr.dtype.element_ty), mask=cmask)


def causal_conv1d_update_triton(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None, activation: str | None, idx: torch.Tensor) -> torch.Tensor:
    """Triton decode step: grid ``(B, ceil(C / BLOCK_C))``."""
    batch, channels = x.shape
    y = torch.empty_like(x)
    if batch == 0:
        return y
    block_c = min(256, triton.next_power_of_2(channels))
    compute = tl.float64 if x.dtype == torch.float64 else tl.float32
    grid = (batch, triton.cdiv(channels, block_c))
    _conv_update_kernel[grid](
        x, conv_state, weight, bias if bias is not None else weight, idx, y, channels,
        x.stride(0), conv_state.stride(0), conv_state.stride(1), weight.stride(0), weight.stride(1), y.stride(0),
        KW=weight.shape[1], BLOCK_C=block_c, HAS_BIAS=bias is not None, SILU=activation == "silu", COMPUTE=compute,
    )
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    conv_state_indices: torch.Tensor,
    *,
    backend: str | None = None,
    checks: bool = True,
) -> torch.Tensor:
    """One decode step for ``B`` requests: request ``b`` uses state slot
    ``conv_state_indices[b]`` of ``conv_state [slots+1, K-1, C]``.

    Returns ``y [B, C]`` (``x.dtype``) and updates each used state in place: shift left by one
    row, append ``x[b]``. Slots must be distinct except padding slot 0 (see
    ``validate_slot_indices``); bad shapes/dtypes/indices raise before any write.
    ``backend``: ``None`` (Triton on CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
    Cost: O(B*C*K).
    """
    if x.dim() != 2 or not x.is_floating_point():
        raise InvalidArgumentError(f"x must be a floating [B, C] tensor, got {x.dtype} {tuple(x.shape)}")
    kw = _check_common(weight, bias, x.shape[1], activation, x.device)
    if (
        conv_state.dim() != 3
        or conv_state.shape[1:] != (kw - 1, x.shape[1])
        or not conv_state.is_floating_point()
        or conv_state.device != x.device
    ):
        raise InvalidArgumentError(
            f"conv_state must be a floating [slots+1, K-1={kw - 1}, C={x.shape[1]}] tensor on {x.device}, "
            f"got {conv_state.dtype} {tuple(conv_state.shape)} on {conv_state.device}"
        )
    if conv_state_indices.dim() != 1 or conv_state_indices.shape[0] != x.shape[0]:
        raise LengthMismatchError(
            f"conv_state_indices must be [B={x.shape[0]}], got {tuple(conv_state_indices.shape)}"
        )
    mode = resolve_backend(backend, x.device)
    if checks:
        idx = validate_slot_indices(conv_state_indices, conv_state.shape[0], name="conv_state_indices", device=x.device)
    else:
        idx = conv_state_indices.to(device=x.device, dtype=torch.int64)
    if mode == "triton" and conv_state.stride(2) == 1:
        return causal_conv1d_update_triton(x.contiguous(), conv_state, weight, bias, activation, idx)
    if mode == "triton" and backend == "triton":
        raise InvalidArgumentError("the Triton conv update needs conv_state with unit stride along channels")
    return causal_conv1d_update_torch(x, conv_state, weight, bias, activation, idx)
