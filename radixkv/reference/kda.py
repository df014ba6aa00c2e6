"""The KDA (Kimi Delta Attention) layer of the reference model: its math and its two ways to run.

Per token: a q | k | v projection through a short causal conv1d and SiLU, L2-normalised q and
k per head, a channel-wise log decay ``g < 0`` and a gate ``beta`` per head, then the gated
delta rule on a per-head state ``S [D_k, D_v]`` (the formulas: ``docs/internals.md``, "The
KDA layer"). A sequence's layer state is ``(conv_state [K-1, 3*H*D], S [H, D, D])``, zeros
at the start.

* ``kda_recurrent``: the rule token by token (the ground truth, used by ``forward_reference``).
* ``extend`` runs ``chunk_kda`` (:mod:`radixkv.reference.kda_chunk`: torch, or Triton on CUDA).
  Cost per chunk of length L: O(H * L^2 * D) plus O(H * L * D^2).
* ``decode`` uses the fused kernels ``causal_conv1d_update`` and ``kda_decode``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from radixkv.memory.mamba_pool import Mamba2LayerCache
from radixkv.reference.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from radixkv.reference.config import HybridConfig
from radixkv.reference.kda_chunk import CHUNK, KDAOutput, chunk_kda
from radixkv.reference.kda_decode import kda_decode

__all__ = ["KDALayer", "kda_recurrent"]


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None = None) -> KDAOutput:
    """The gated delta rule token by token (ground truth). ``q, k, g [T, H, D_k]``,
    ``v [T, H, D_v]``, ``beta [T, H]``, ``initial_state [H, D_k, D_v]`` or ``None`` (zeros).
    Cost: O(T * H * D_k * D_v) in a Python loop over T (vectorised over heads)."""
    state = (q.new_zeros(q.shape[1], q.shape[2], v.shape[2]) if initial_state is None
             else initial_state.to(q.dtype).clone())
    outs = []
    for t in range(q.shape[0]):
        state = state * torch.exp(g[t])[:, :, None]
        v_new = (v[t] - (state * k[t][:, :, None]).sum(1)) * beta[t][:, None]
        state = state + k[t][:, :, None] * v_new[:, None, :]
        outs.append((state * q[t][:, :, None]).sum(1))
    o = torch.stack(outs) if outs else v.new_zeros(v.shape)
    return KDAOutput(o, state)


class KDALayer:
    """One KDA mixer with random weights (plain tensors on ``device``, ``config.dtype``).

    ``gen`` is the model's CPU float64 generator; weights are drawn in a fixed order from it.
    The layer never validates: ``HybridModel`` validates every request before calling it.
    """

    def __init__(self, config: HybridConfig, gen: torch.Generator, device: torch.device):
        self.config = config
        hid, pd, heads, kw = config.hidden, config.proj_dim, config.num_heads, config.conv_kernel

        def draw(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
            t = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift
            return t.to(device=device, dtype=config.dtype)

        self.w_qkv = draw(hid, 3 * pd, scale=hid**-0.5)
        self.conv_w = draw(3 * pd, kw, scale=kw**-0.5)
        self.conv_b = draw(3 * pd, scale=0.1)
        self.w_g = draw(hid, pd, scale=hid**-0.5)
        self.g_bias = (torch.rand(pd, generator=gen, dtype=torch.float64) * 4.0 - 4.0).to(device, config.dtype)
        self.w_beta = draw(hid, heads, scale=hid**-0.5)
        self.w_o = draw(pd, hid, scale=pd**-0.5)

    # ---- shared pieces -------------------------------------------------------------------
    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``g [N, H, D]`` (log decay) and ``beta [N, H]`` from the layer input ``x [N, hidden]``."""
        cfg = self.config
        g = -F.softplus(x @ self.w_g + self.g_bias).view(-1, cfg.num_heads, cfg.head_dim)
        beta = torch.sigmoid(x @ self.w_beta)
        return g, beta

    def _split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv output ``[N, 3*H*D]`` -> L2-normalised ``q, k`` and ``v``, each ``[N, H, D]``."""
        cfg = self.config
        q, k, v = qkv.view(-1, 3, cfg.num_heads, cfg.head_dim).unbind(1)
        return F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6), v

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return o.reshape(o.shape[0], -1).to(self.w_o.dtype) @ self.w_o

    # ---- ground truth ------------------------------------------------------------------
    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequence ``x [T, hidden]`` from a zero state: the conv as a sum over its taps
        of shifted inputs (zero history), then ``kda_recurrent``."""
        kw, n = self.config.conv_kernel, x.shape[0]
        qkv = x @ self.w_qkv  # [T, C]
        padded = torch.cat([qkv.new_zeros(kw - 1, qkv.shape[1]), qkv])
        conv = sum(self.conv_w[:, j] * padded[j : j + n] for j in range(kw)) + self.conv_b
        qkv = F.silu(conv)
        q, k, v = self._split(qkv)
        g, beta = self._gates(x)
        return self._out(kda_recurrent(q, k, v, g, beta).o)

    # ---- incremental ---------------------------------------------------------------------
    def extend(self, x: torch.Tensor, cache: Mamba2LayerCache, slot: int, fresh: bool,
               track: tuple[int, int] | None = None, backend: str | None = None) -> torch.Tensor:
        """Continue one sequence by ``x [T, hidden]`` from its state in ``slot`` of ``cache``
        (``cache.conv[0] [slots+1, K-1, C]``, ``cache.temporal [slots+1, H, D, D]``; zeros instead
        when ``fresh``), write the new state back to ``slot``, return ``[T, hidden]``.
        ``track = (track_slot, n)``: also write the state after the first ``n`` of the ``T``
        tokens (``1 <= n <= T``) into ``track_slot`` (the prefill is split there)."""
        conv_all, ssm_all = cache.conv[0], cache.temporal
        init_conv = None if fresh else conv_all[slot]
        init_ssm = None if fresh else ssm_all[slot]
        raw = x @ self.w_qkv
        qkv, conv_state = causal_conv1d_fn(raw, self.conv_w, self.conv_b, init_conv, "silu")
        q, k, v = self._split(qkv)
        g, beta = self._gates(x)
        cs = self.config.chunk_size
        be = backend if cs == CHUNK else "torch"  # the Triton kernel runs the seed's chunk size only

        def run(lo: int, hi: int, h0: torch.Tensor | None) -> KDAOutput:  # one sequence of the varlen call
            cu = torch.tensor([0, hi - lo], dtype=torch.int64, device=x.device)
            r = chunk_kda(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], cu,
                          None if h0 is None else h0[None], chunk_size=cs, backend=be)
            return KDAOutput(r.o, r.final_state[0])

        n_tok = x.shape[0]
        if track is None:
            out = run(0, n_tok, init_ssm)
            o = out.o
        else:
            t_slot, n = track
            head = run(0, n, init_ssm)
            out = run(n, n_tok, head.final_state) if n < n_tok else head
            o = torch.cat([head.o, out.o]) if n < n_tok else head.o
            kw = self.config.conv_kernel
            hist = raw.new_zeros(kw - 1, raw.shape[1]) if init_conv is None else init_conv.to(raw.dtype)
            conv_all[t_slot] = torch.cat([hist, raw[:n]])[n:n + kw - 1].to(conv_all.dtype)  # last K-1 inputs
            ssm_all[t_slot] = head.final_state.to(ssm_all.dtype)
        conv_all[slot] = conv_state.to(conv_all.dtype)
        ssm_all[slot] = out.final_state.to(ssm_all.dtype)
        return self._out(o)

    def decode(self, x: torch.Tensor, cache: Mamba2LayerCache, slots: torch.Tensor, backend: str | None,
               track: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One token for each of ``B`` requests: ``x [B, hidden]``, ``slots [B]`` (int64, already
        validated); states updated in place by the fused kernels. ``track = (src, dst)``: then
        copy the new states of slots ``src`` into slots ``dst``. Returns ``[B, hidden]``."""
        qkv = causal_conv1d_update(
            x @ self.w_qkv, cache.conv[0], self.conv_w, self.conv_b, "silu", slots, backend=backend, checks=False
        )
        q, k, v = self._split(qkv)
        g, beta = self._gates(x)
        o = kda_decode(q, k, v, g, beta, cache.temporal, slots, backend=backend, checks=False)
        if track is not None:  # the state after this token, for the requests passing a boundary
            src, dst = track
            cache.conv[0][dst] = cache.conv[0][src]
            cache.temporal[dst] = cache.temporal[src]
        return self._out(o)
