"""``KimiLinearCacheParams``: the per-model cache parameters of a Kimi Linear (KDA) model, as
the seed names them (section 10, SGLang's ``configs/mamba_utils.py``): the state shape of one
KDA layer, which global layers are KDA layers, and the state dtypes -- everything a
``MambaPool`` needs besides its size and device (:meth:`KimiLinearCacheParams.pool`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from radixkv.errors import InvalidArgumentError
from radixkv.memory.arena import parse_dtype
from radixkv.memory.mamba_pool import KimiLinearStateShape, MambaPool

__all__ = ["Mamba2StateDType", "KimiLinearCacheParams"]


class Mamba2StateDType(NamedTuple):
    """The dtypes of the conv and the temporal (delta-rule) states (SGLang's name)."""

    conv: torch.dtype = torch.float32
    temporal: torch.dtype = torch.float32


@dataclass(frozen=True)
class KimiLinearCacheParams:
    """``shape``: one KDA layer's :class:`KimiLinearStateShape`; ``layers``: the global ids of
    the KDA layers (ascending, distinct); ``dtype``: a :class:`Mamba2StateDType` (dtype names
    accepted). Validated on construction (``InvalidArgumentError``).

    Per request slot (:attr:`mamba_cache_per_req`): every KDA layer's three conv windows
    (q, k, v: ``3 x conv``) and its temporal state; the seed's 32 x 128 example takes
    ``2 MiB`` of fp32 temporal state per layer."""

    shape: KimiLinearStateShape
    layers: tuple[int, ...]
    dtype: Mamba2StateDType = field(default_factory=Mamba2StateDType)

    def __post_init__(self) -> None:
        if not isinstance(self.shape, KimiLinearStateShape):
            raise InvalidArgumentError(f"shape must be a KimiLinearStateShape, got {type(self.shape).__name__}")
        try:
            layers = tuple(int(i) for i in self.layers)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"layers must be layer ids, got {self.layers!r}") from None
        if not layers or any(i < 0 for i in layers) or list(layers) != sorted(set(layers)):
            raise InvalidArgumentError(f"layers must be distinct ascending ids >= 0, got {list(layers)}")
        object.__setattr__(self, "layers", layers)
        conv: Any = self.dtype[0] if isinstance(self.dtype, tuple) else None
        temporal: Any = self.dtype[1] if isinstance(self.dtype, tuple) and len(self.dtype) > 1 else None
        if conv is None or temporal is None:
            raise InvalidArgumentError(f"dtype must be a Mamba2StateDType, got {self.dtype!r}")
        object.__setattr__(self, "dtype", Mamba2StateDType(parse_dtype(conv), parse_dtype(temporal)))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def mamba_cache_per_req(self) -> int:
        """Bytes of one request's states over every KDA layer."""
        conv = math.prod(self.shape.pool_conv) * self.dtype.conv.itemsize
        temporal = math.prod(self.shape.temporal) * self.dtype.temporal.itemsize
        return (conv + temporal) * self.num_layers

    def pool(self, size: int, device: str | torch.device = "cpu", **kwargs: Any) -> MambaPool:
        """A ``MambaPool`` of ``size`` slots for these layers (``kwargs``: as ``MambaPool``)."""
        return MambaPool(size, self.shape.pool_conv, self.shape.temporal, self.num_layers, self.dtype.conv,
                         device, conv_dtype=self.dtype.conv, temporal_dtype=self.dtype.temporal, **kwargs)
