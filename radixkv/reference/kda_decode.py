"""Fused KDA (Kimi Delta Attention) decode step over state slots.

For each request and head, with state ``S = ssm_states[cache_indices[b], h]`` ``[D_k, D_v]``,
the gated delta rule applies in place: ``S *= exp(g)`` along the key dim, ``v_new = (v - S^T
k) * beta``, ``S += outer(k, v_new)``, ``o = S^T q`` (``q`` unscaled). The formulas:
``docs/internals.md``, "The fused KDA decode step".

Torch reference (CPU) and Triton kernel (dispatched on CUDA): one program per (request, head,
block of value columns). Cost: O(B*H*D_k*D_v) flops and state bytes read + written once.
"""
from __future__ import annotations

import torch

from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.kernels.state_copy import resolve_backend, validate_slot_indices
from radixkv.kernels.triton_util import HAS_TRITON

if HAS_TRITON:
    from radixkv.kernels.triton_util import tl, triton


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def kda_decode_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ssm_states: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Reference step, vectorised over requests and heads (one gather, one scatter)."""
    cdt = _compute_dtype(q.dtype)
    q, k, v, g, beta = (t.to(cdt) for t in (q, k, v, g, beta))
    state = ssm_states.index_select(0, idx).to(cdt)  # [B, H, Dk, Dv]
    state = state * torch.exp(g)[..., None]
    v_new = (v - torch.einsum("bhkv,bhk->bhv", state, k)) * beta[..., None]
    state = state + k[..., :, None] * v_new[..., None, :]
    out = torch.einsum("bhkv,bhk->bhv", state, q)
    ssm_states.index_copy_(0, idx, state.to(ssm_states.dtype))
    return out


if HAS_TRITON:

    @triton.jit
    def _kda_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        beta_ptr,
        state_ptr,
        idx_ptr,
        o_ptr,
        H,
        D_K,
        D_V,
        stride_ss,
        stride_sh,
        stride_sk,
        BK: tl.constexpr,
        BV: tl.constexpr,
        COMPUTE: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        b = bh // H
        h = bh % H
        ks = tl.arange(0, BK)
        vs = tl.program_id(1) * BV + tl.arange(0, BV)
        kmask = ks < D_K
        vmask = vs < D_V
        slot = tl.load(idx_ptr + b).to(tl.int64)
        sptr = state_ptr + slot * stride_ss + h * stride_sh + ks[:, None] * stride_sk + vs[None, :]
        smask = kmask[:, None] & vmask[None, :]
        state = tl.load(sptr, mask=smask, other=0.0).to(COMPUTE)
        row_k = bh * D_K + ks
        q = tl.load(q_ptr + row_k, mask=kmask, other=0.0).to(COMPUTE)
        k = tl.load(k_ptr + row_k, mask=kmask, other=0.0).to(COMPUTE)
        g = tl.load(g_ptr + row_k, mask=kmask, other=0.0).to(COMPUTE)
        v = tl.load(v_ptr + bh * D_V + vs, mask=vmask, other=0.0).to(COMPUTE)
        beta = tl.load(beta_ptr + bh).to(COMPUTE)
        state = state * tl.exp(g)[:, None]
        v_new = (v - tl.sum(state * k[:, None], axis=0)) * beta
        state = state + k[:, None] * v_new[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(o_ptr + bh * D_V + vs, out.to(o_ptr.dtype.element_ty), mask=vmask)
        tl.store(sptr, state.to(state_ptr.dtype.element_ty), mask=smask)


def kda_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      ssm_states: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Triton step: grid ``(B*H, ceil(D_v / BV))``; inputs made contiguous first."""
    batch, heads, d_k = q.shape
    d_v = v.shape[-1]
    out = torch.empty(batch, heads, d_v, dtype=_compute_dtype(q.dtype), device=q.device)
    if batch == 0:
        return out
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    bk = triton.next_power_of_2(d_k)
    bv = min(triton.next_power_of_2(d_v), max(16, 4096 // bk))
    compute = tl.float64 if q.dtype == torch.float64 else tl.float32
    grid = (batch * heads, triton.cdiv(d_v, bv))
    _kda_decode_kernel[grid](
        q, k, v, g, beta, ssm_states, idx, out, heads, d_k, d_v,
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        BK=bk, BV=bv, COMPUTE=compute,
    )
    return out


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    *,
    backend: str | None = None,
    checks: bool = True,
) -> torch.Tensor:
    """Apply one gated-delta-rule step for ``B`` requests and return ``o [B, H, D_v]``.

    ``q, k, g``: ``[B, H, D_k]``; ``v``: ``[B, H, D_v]``; ``beta``: ``[B, H]`` (all one
    floating dtype); ``ssm_states``: ``[slots+1, H, D_k, D_v]`` (any floating dtype), updated
    in place at rows ``cache_indices [B]`` (distinct, except padding slot 0). The math runs in
    float64 for float64 inputs, else float32; ``o`` has that dtype. Bad shapes, dtypes or
    indices raise a typed error before anything is written. ``backend``: ``None`` (Triton on
    CUDA, torch elsewhere), ``"torch"`` or ``"triton"``.
    """
    if q.dim() != 3:
        raise InvalidArgumentError(f"q must be [B, H, D_k], got {tuple(q.shape)}")
    batch, heads, d_k = q.shape
    d_v = v.shape[-1] if v.dim() == 3 else -1
    expected = {"k": (batch, heads, d_k), "g": (batch, heads, d_k), "v": (batch, heads, d_v), "beta": (batch, heads)}
    for name, t in (("k", k), ("g", g), ("v", v), ("beta", beta)):
        if tuple(t.shape) != expected[name]:
            raise InvalidArgumentError(f"{name} must be {expected[name]}, got {tuple(t.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.dtype != q.dtype or not t.is_floating_point() or t.device != q.device:
            raise InvalidArgumentError(f"{name} must be {q.dtype} on {q.device}, got {t.dtype} on {t.device}")
    if (
        ssm_states.dim() != 4
        or tuple(ssm_states.shape[1:]) != (heads, d_k, d_v)
        or not ssm_states.is_floating_point()
        or ssm_states.device != q.device
    ):
        raise InvalidArgumentError(
            f"ssm_states must be a floating [slots+1, {heads}, {d_k}, {d_v}] tensor on {q.device}, "
            f"got {ssm_states.dtype} {tuple(ssm_states.shape)} on {ssm_states.device}"
        )
    if cache_indices.dim() != 1 or cache_indices.shape[0] != batch:
        raise LengthMismatchError(f"cache_indices must be [B={batch}], got {tuple(cache_indices.shape)}")
    mode = resolve_backend(backend, q.device)
    if checks:
        idx = validate_slot_indices(cache_indices, ssm_states.shape[0], name="cache_indices", device=q.device)
    else:
        idx = cache_indices.to(device=q.device, dtype=torch.int64)
    if mode == "triton" and ssm_states.stride(3) == 1:
        return kda_decode_triton(q, k, v, g, beta, ssm_states, idx)
    if mode == "triton" and backend == "triton":
        raise InvalidArgumentError("the Triton KDA decode needs ssm_states with unit stride along the value dim")
    return kda_decode_torch(q, k, v, g, beta, ssm_states, idx)
