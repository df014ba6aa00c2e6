"""Chunked KDA (Kimi Delta Attention) prefill for a batch of variable-length sequences.

The gated delta rule of :mod:`radixkv.reference.kda_decode`, computed chunk by chunk in
parallel form (SGLang's ``chunk_kda``; chunk size 64; formulas in ``docs/internals.md``,
"Chunked KDA prefill"). Decay ratios are differences in log space, so nothing overflows.
Sequences are packed along the token axis, delimited by ``cu_seqlens`` (``[N+1]``, ascending
from 0), each with its own initial state.

* :func:`kda_chunked`: one sequence, torch (the reference; any chunk size).
* :func:`chunk_kda`: the batch; torch loops over sequences, the Triton kernel runs one program
  per (sequence, head), its state in registers.
Cost per chunk: O(H * L^2 * D) for the in-chunk products plus O(H * L * D^2).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.kernels.state_copy import resolve_backend
from radixkv.kernels.triton_util import HAS_TRITON

if HAS_TRITON:
    from radixkv.kernels.triton_util import tl, triton

CHUNK = 64  # the seed's chunk size, the Triton kernel's


class KDAOutput(NamedTuple):
    """Outputs ``o [T, H, D_v]`` and the state(s) after the last token (``[H, D_k, D_v]``
    for one sequence, ``[N, H, D_k, D_v]`` for a batch)."""

    o: torch.Tensor
    final_state: torch.Tensor


def _zero_state(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=q.dtype, device=q.device)


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: torch.Tensor | None = None, chunk_size: int = CHUNK) -> KDAOutput:
    """One sequence: ``q, k, g [T, H, D_k]``, ``v [T, H, D_v]``, ``beta [T, H]``,
    ``initial_state [H, D_k, D_v]`` or ``None`` (zeros); ``chunk_size >= 1``."""
    state = _zero_state(q, v) if initial_state is None else initial_state.to(q.dtype)
    qh, kh, vh, gh = (t.transpose(0, 1) for t in (q, k, v, g))  # heads first: [H, T, D]
    bh = beta.transpose(0, 1)
    outs = []
    for start in range(0, q.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        qc, kc, vc, gc, bc = qh[:, sl], kh[:, sl], vh[:, sl], gh[:, sl], bh[:, sl]
        length = qc.shape[1]
        cum = gc.cumsum(1)  # [H, L, Dk]
        diff = cum[:, :, None, :] - cum[:, None, :, :]  # [H, t, s, Dk]: G_t - G_s
        pos = torch.arange(length, device=q.device)
        causal = pos[:, None] >= pos[None, :]
        decay = torch.exp(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
        strict = (pos[:, None] > pos[None, :]).to(q.dtype)
        attn_kk = torch.einsum("htd,hsd,htsd->hts", kc, kc, decay) * strict * bc[:, :, None]
        attn_qk = torch.einsum("htd,hsd,htsd->hts", qc, kc, decay)
        rhs = bc[:, :, None] * (vc - (kc * torch.exp(cum)) @ state)
        u = torch.linalg.solve_triangular(attn_kk, rhs, upper=False, unitriangular=True)
        outs.append((qc * torch.exp(cum)) @ state + attn_qk @ u)
        last = cum[:, -1:, :]  # [H, 1, Dk]
        state = torch.exp(last).transpose(1, 2) * state + (kc * torch.exp(last - cum)).transpose(1, 2) @ u
    o = torch.cat(outs, dim=1).transpose(0, 1) if outs else v.new_zeros(v.shape)
    return KDAOutput(o, state)


def chunk_kda_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None = None,
                    chunk_size: int = CHUNK) -> KDAOutput:
    """The batch by :func:`kda_chunked`, sequence after sequence."""
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        sl = slice(bounds[n], bounds[n + 1])
        h0 = None if initial_state is None else initial_state[n]
        r = kda_chunked(q[sl], k[sl], v[sl], g[sl], beta[sl], h0, chunk_size)
        outs.append(r.o)
        finals.append(r.final_state)
    o = torch.cat(outs) if outs else v.new_zeros(v.shape)
    return KDAOutput(o, torch.stack(finals) if finals else v.new_zeros(0, q.shape[1], q.shape[2], v.shape[2]))


if HAS_TRITON:

    @triton.jit
    def _mm(a, b):
        """``a [M, K] @ b [K, N]`` by a broadcast sum (any float dtype, fp64 included)."""
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)

    @triton.jit
    def _chunk_kda_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, h0_ptr, o_ptr, ht_ptr,
                          H, D_K, D_V, HAS_H0: tl.constexpr, BT: tl.constexpr, SQUARINGS: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, COMPUTE: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
        ks = tl.arange(0, BK)
        vs = tl.arange(0, BV)
        ts = tl.arange(0, BT)
        kmask, vmask = ks < D_K, vs < D_V
        smask = kmask[:, None] & vmask[None, :]
        soff = ((n * H + h) * D_K + ks[:, None]) * D_V + vs[None, :]
        state = tl.zeros((BK, BV), dtype=COMPUTE)
        if HAS_H0:
            state = tl.load(h0_ptr + soff, mask=smask, other=0.0).to(COMPUTE)
        strict = ts[:, None] > ts[None, :]
        causal = ts[:, None] >= ts[None, :]
        eye = tl.where(ts[:, None] == ts[None, :], 1.0, 0.0).to(COMPUTE)
        for c in range(0, tl.cdiv(eos - bos, BT)):
            rows = bos + c * BT + ts
            tmask = rows < eos
            km = tmask[:, None] & kmask[None, :]
            vm = tmask[:, None] & vmask[None, :]
            kof = (rows[:, None] * H + h) * D_K + ks[None, :]
            vof = (rows[:, None] * H + h) * D_V + vs[None, :]
            q = tl.load(q_ptr + kof, mask=km, other=0.0).to(COMPUTE)
            k = tl.load(k_ptr + kof, mask=km, other=0.0).to(COMPUTE)
            g = tl.load(g_ptr + kof, mask=km, other=0.0).to(COMPUTE)
            v = tl.load(v_ptr + vof, mask=vm, other=0.0).to(COMPUTE)
            beta = tl.load(beta_ptr + rows * H + h, mask=tmask, other=0.0).to(COMPUTE)
            cum = tl.cumsum(g, axis=0)  # [BT, BK]; rows past the end add 0
            diff = cum[:, None, :] - cum[None, :, :]  # [t, s, d]
            decay = tl.exp(tl.where(causal[:, :, None], diff, float("-inf")))
            a = tl.sum(k[:, None, :] * k[None, :, :] * decay, axis=2)
            a = tl.where(strict, a, 0.0) * beta[:, None]
            p = tl.sum(q[:, None, :] * k[None, :, :] * decay, axis=2)
            rhs = beta[:, None] * (v - _mm(k * tl.exp(cum), state))
            inv = eye - a  # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^(BT/2))
            power = a
            for _ in tl.static_range(SQUARINGS):
                power = _mm(power, power)
                inv = _mm(inv, eye + power)
            u = _mm(inv, rhs)
            o = _mm(q * tl.exp(cum), state) + _mm(p, u)
            tl.store(o_ptr + vof, o.to(o_ptr.dtype.element_ty), mask=vm)
            last = tl.sum(g, axis=0)  # G_L: the chunk's total log decay
            kw = k * tl.exp(last[None, :] - cum)
            state = tl.exp(last)[:, None] * state + tl.sum(kw[:, :, None] * u[:, None, :], axis=0)
        tl.store(ht_ptr + soff, state.to(ht_ptr.dtype.element_ty), mask=smask)


def chunk_kda_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None = None) -> KDAOutput:
    """The Triton kernel (chunk size 64): grid ``(N, H)``; inputs made contiguous first."""
    t, heads, d_k = q.shape
    d_v = v.shape[-1]
    n = cu_seqlens.numel() - 1
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    o = torch.empty(t, heads, d_v, dtype=cdt, device=q.device)
    ht = torch.empty(n, heads, d_k, d_v, dtype=cdt, device=q.device)
    if n == 0:
        return KDAOutput(o, ht)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = initial_state.to(cdt).contiguous() if initial_state is not None else ht
    _chunk_kda_kernel[(n, heads)](
        q, k, v, g, beta, cu_seqlens.to(torch.int64).contiguous(), h0, o, ht, heads, d_k, d_v,
        HAS_H0=initial_state is not None, BT=CHUNK, SQUARINGS=CHUNK.bit_length() - 2, BK=triton.next_power_of_2(d_k),
        BV=triton.next_power_of_2(d_v), COMPUTE=tl.float64 if cdt == torch.float64 else tl.float32)
    return KDAOutput(o, ht)


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None = None, *,
              chunk_size: int = CHUNK, backend: str | None = None) -> KDAOutput:
    """The gated delta rule over ``N`` packed sequences: ``q, k, g [T, H, D_k]``,
    ``v [T, H, D_v]``, ``beta [T, H]`` (one floating dtype, one device), ``cu_seqlens
    [N+1]`` (int, from 0 to T, non-decreasing), ``initial_state [N, H, D_k, D_v]`` or
    ``None`` (zeros). Returns ``o [T, H, D_v]`` and the final states ``[N, H, D_k, D_v]``
    (float64 for float64 inputs, else float32). ``backend``: ``None`` (Triton on CUDA, torch
    elsewhere), ``"torch"`` or ``"triton"`` (chunk size 64 only).

    Raises ``InvalidArgumentError`` / ``LengthMismatchError`` for bad shapes, dtypes or
    ``cu_seqlens``."""
    if q.dim() != 3 or v.dim() != 3:
        raise InvalidArgumentError(f"q must be [T, H, D_k] and v [T, H, D_v], got {tuple(q.shape)}, {tuple(v.shape)}")
    t, heads, d_k = q.shape
    want = {"k": (t, heads, d_k), "g": (t, heads, d_k), "v": (t, heads, v.shape[2]), "beta": (t, heads)}
    for name, x in (("k", k), ("g", g), ("v", v), ("beta", beta)):
        if tuple(x.shape) != want[name]:
            raise LengthMismatchError(f"{name} must be {want[name]}, got {tuple(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device or not x.is_floating_point():
            raise InvalidArgumentError(f"{name} must be {q.dtype} on {q.device}, got {x.dtype} on {x.device}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise InvalidArgumentError(f"cu_seqlens must be a 1-D int tensor [N+1], got {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != t or bool((cu[1:] < cu[:-1]).any()):
        raise InvalidArgumentError(f"cu_seqlens must go from 0 to {t} without decreasing, got {cu.tolist()}")
    n = cu.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (n, heads, d_k, v.shape[2]):
        raise LengthMismatchError(f"initial_state must be {(n, heads, d_k, v.shape[2])}, "
                                  f"got {tuple(initial_state.shape)}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidArgumentError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    mode = resolve_backend(backend, q.device)
    if mode == "triton" and chunk_size == CHUNK:
        return chunk_kda_triton(q, k, v, g, beta, cu.to(q.device), initial_state)
    if backend == "triton":
        raise InvalidArgumentError(f"the Triton chunked KDA runs chunk size {CHUNK}, got {chunk_size}")
    return chunk_kda_torch(q, k, v, g, beta, cu, initial_state, chunk_size)
