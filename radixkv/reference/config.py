"""``HybridConfig``: the shape of the tiny Kimi-Linear-like reference model.

The layer pattern is a string of ``K`` (a KDA layer: linear attention with a recurrent state)
and ``F`` (a full softmax-attention layer with per-token KV), e.g. ``"KKKF" * 2``. Layers are
numbered globally ``0..num_layers-1`` in pattern order; KDA layers are also numbered
``0..num_kda_layers-1`` in order of their global ids (their index in a ``MambaPool``), and full
layers ``0..num_full_layers-1`` (their index in a plain ``MHATokenToKVPool``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixkv.errors import InvalidArgumentError

SUPPORTED_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class HybridConfig:
    """Hyper-parameters of the reference hybrid model (all validated on construction).

    ``vocab``, ``hidden``, ``num_heads``, ``head_dim`` (the KDA state is ``head_dim x head_dim``
    per head), ``conv_kernel`` (>= 2), ``layer_pattern`` (``K`` = KDA, ``F`` = full attention, one
    per layer), ``dtype`` (float32 or float64), ``seed`` (weights drawn in float64 on the CPU, so
    a seed gives the same model on every device and dtype), ``mlp_mult`` (SwiGLU width factor,
    0: none), ``rope_theta``, ``chunk_size`` (64 runs the Triton prefill kernel), ``norm_eps``.
    Each field: ``docs/internals.md``, "Hyper-parameters".
    """

    vocab: int = 64
    hidden: int = 32
    num_heads: int = 2
    head_dim: int = 16
    conv_kernel: int = 4
    layer_pattern: str = "KKKF" * 2
    dtype: torch.dtype = torch.float64
    seed: int = 0
    mlp_mult: int = 2
    rope_theta: float = 10000.0
    chunk_size: int = 64
    norm_eps: float = 1e-6
    _ids: tuple[tuple[int, ...], tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "num_heads", "head_dim", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"HybridConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.conv_kernel, int) or self.conv_kernel < 2:
            raise InvalidArgumentError(f"HybridConfig.conv_kernel must be an int >= 2, got {self.conv_kernel!r}")
        if not isinstance(self.mlp_mult, int) or self.mlp_mult < 0:
            raise InvalidArgumentError(f"HybridConfig.mlp_mult must be an int >= 0, got {self.mlp_mult!r}")
        if self.head_dim % 2:
            raise InvalidArgumentError(f"HybridConfig.head_dim must be even (RoPE), got {self.head_dim}")
        if not self.layer_pattern or set(self.layer_pattern) - {"K", "F"}:
            raise InvalidArgumentError(
                f"HybridConfig.layer_pattern must be a non-empty string of 'K'/'F', got {self.layer_pattern!r}"
            )
        if self.dtype not in SUPPORTED_DTYPES:
            raise InvalidArgumentError(f"HybridConfig.dtype must be float32 or float64, got {self.dtype}")
        kda = tuple(i for i, c in enumerate(self.layer_pattern) if c == "K")
        full = tuple(i for i, c in enumerate(self.layer_pattern) if c == "F")
        object.__setattr__(self, "_ids", (kda, full))

    @property
    def num_layers(self) -> int:
        return len(self.layer_pattern)

    @property
    def kda_layer_ids(self) -> tuple[int, ...]:
        """Global ids of the KDA layers, ascending."""
        return self._ids[0]

    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """Global ids of the full-attention layers, ascending."""
        return self._ids[1]

    @property
    def proj_dim(self) -> int:
        """``num_heads * head_dim``: width of one of q, k, v."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the KDA conv: q|k|v concatenated, ``3 * num_heads * head_dim``."""
        return 3 * self.proj_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """Per-slot conv state of one KDA layer: ``(conv_kernel - 1, conv_dim)``."""
        return (self.conv_kernel - 1, self.conv_dim)

    @property
    def temporal_state_shape(self) -> tuple[int, int, int]:
        """Per-slot recurrent state of one KDA layer: ``(num_heads, head_dim, head_dim)``
        indexed ``[head, key_dim, value_dim]``."""
        return (self.num_heads, self.head_dim, self.head_dim)
