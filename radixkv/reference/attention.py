"""The full (softmax) attention layer of the reference model.

Per token ``x``: ``q, k, v = x @ W_q, x @ W_k, x @ W_v`` (``[H, D]`` each), RoPE on ``q`` and
``k`` at the token's ABSOLUTE position (so cached keys stay valid when a prefix is reused),
causal softmax attention with scale ``D**-0.5``, then ``W_o``. The KV cache holds the rotated
``k`` and ``v`` of every token, one row per token (``[rows, H, D]`` per layer).

Two ways to run, computing the same function:

* ``forward_reference(x)``: whole sequence with a causal mask, no cache.
* ``extend`` / ``decode``: new tokens' k/v are written to the pool with
  ``kv_pool.set_kv_buffer(layer_id, rows, k, v)``; attention reads every key/value of the
  sequence back from ``kv_pool.get_kv_buffer(layer_id)`` through the request's rows.
"""
from __future__ import annotations

from typing import Protocol

import torch

from radixkv.reference.config import HybridConfig


class LayerKV(Protocol):
    """The KV pool API the attention layer uses (``MHATokenToKVPool``, ``HybridLinearKVPool``,
    ``WorkerBuffers``): one layer's ``(k_buf, v_buf)``, each ``[rows, H, D]``, and a write of
    the rows ``loc``."""

    def get_kv_buffer(self, layer_id: int, /) -> tuple[torch.Tensor, torch.Tensor]: ...
    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor,
                      cache_v: torch.Tensor, /) -> None: ...


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE: ``x [N, H, D]`` at integer ``positions [N]``. Angles are computed in
    float64 and cast, so every path of the model rotates identically."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=x.device) * 2.0 / x.shape[-1])
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cos(angles).to(x.dtype)[:, None, :]
    sin = torch.sin(angles).to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``q [B, Tq, H, D]``, ``k, v [B, Tk, H, D]``, ``allowed [B, Tq, Tk]`` (bool; every query has
    at least one allowed key) -> ``[B, Tq, H, D]``."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # masked keys may hold anything (stale or padding rows): zero them so 0 * garbage stays 0
    v = v.masked_fill(~allowed.any(1)[:, :, None, None], 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


class FullAttentionLayer:
    """One causal softmax-attention mixer with random weights (plain tensors, ``config.dtype``).
    Never validates: ``HybridModel`` validates every request before calling it."""

    def __init__(self, config: HybridConfig, gen: torch.Generator, device: torch.device):
        self.config = config
        hid, pd = config.hidden, config.proj_dim

        def draw(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device, config.dtype)

        self.w_q = draw(hid, pd, scale=hid**-0.5)
        self.w_k = draw(hid, pd, scale=hid**-0.5)
        self.w_v = draw(hid, pd, scale=hid**-0.5)
        self.w_o = draw(pd, hid, scale=pd**-0.5)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        shape = (x.shape[0], cfg.num_heads, cfg.head_dim)
        q = rope((x @ self.w_q).view(shape), positions, cfg.rope_theta)
        k = rope((x @ self.w_k).view(shape), positions, cfg.rope_theta)
        return q, k, (x @ self.w_v).view(shape)

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        return o.reshape(o.shape[0], -1) @ self.w_o

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Whole sequence ``x [T, hidden]`` at positions ``0..T-1``, causal mask, no cache."""
        n = x.shape[0]
        q, k, v = self._qkv(x, torch.arange(n, device=x.device))
        pos = torch.arange(n, device=x.device)
        allowed = pos[:, None] >= pos[None, :]
        return self._out(_attend(q[None], k[None], v[None], allowed[None])[0])

    def extend(self, x: torch.Tensor, start_pos: int, kv_pool: LayerKV, pool_layer_id: int,
               rows_prefix: torch.Tensor, rows_new: torch.Tensor) -> torch.Tensor:
        """Tokens ``x [T, hidden]`` at positions ``start_pos..start_pos+T-1`` of one sequence:
        write their k/v to ``rows_new [T]``, attend over ``rows_prefix [start_pos]`` + ``rows_new``
        read back from the pool. Returns ``[T, hidden]``."""
        n = x.shape[0]
        positions = torch.arange(start_pos, start_pos + n, device=x.device)
        q, k, v = self._qkv(x, positions)
        kv_pool.set_kv_buffer(pool_layer_id, rows_new, k, v)
        k_buf, v_buf = kv_pool.get_kv_buffer(pool_layer_id)
        rows = torch.cat([rows_prefix, rows_new])
        keys = k_buf.index_select(0, rows).to(x.dtype)
        values = v_buf.index_select(0, rows).to(x.dtype)
        allowed = torch.arange(start_pos + n, device=x.device)[None, :] <= positions[:, None]
        return self._out(_attend(q[None], keys[None], values[None], allowed[None])[0])

    def decode(self, x: torch.Tensor, positions: torch.Tensor, kv_pool: LayerKV, pool_layer_id: int,
               out_cache_loc: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """One token per request: ``x [B, hidden]`` at ``positions [B]``; write k/v to
        ``out_cache_loc [B]``; attend over ``rows [B, L]`` (each request's KV rows, padded) where
        ``valid [B, L]`` marks the real ones (the new token's row included). Returns ``[B, hidden]``."""
        q, k, v = self._qkv(x, positions)
        kv_pool.set_kv_buffer(pool_layer_id, out_cache_loc, k, v)
        k_buf, v_buf = kv_pool.get_kv_buffer(pool_layer_id)
        flat = rows.reshape(-1)
        shape = (rows.shape[0], rows.shape[1], k.shape[1], k.shape[2])
        keys = k_buf.index_select(0, flat).view(shape).to(x.dtype)
        values = v_buf.index_select(0, flat).view(shape).to(x.dtype)
        return self._out(_attend(q[:, None], keys, values, valid[:, None, :])[:, 0])
