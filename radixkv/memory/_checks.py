"""Input validation shared by the pools (pure checks: they never mutate anything).

Every pool validates first and mutates after, so a raise leaves its state unchanged. Range
checks are vectorized (one min/max reduction; offenders are listed only on the error path).
On CUDA a range check costs one device sync, which is why pools take ``checks=True`` and let
a hot loop that trusts its caller turn it off.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    LengthMismatchError,
    describe_ids,
)


def layer_index(layer: Any, layer_num: int) -> int:
    """The layer id of ``layer`` (an int, or an object with ``.layer_id`` like SGLang's
    ``RadixAttention``), checked to lie in ``[0, layer_num)``.

    Raises:
        InvalidIndexError: out of range. InvalidArgumentError: not an integer.
    """
    lid = getattr(layer, "layer_id", layer)
    if isinstance(lid, torch.Tensor) and lid.numel() == 1:
        lid = lid.item()
    if isinstance(lid, bool) or not isinstance(lid, (int, np.integer)):
        raise InvalidArgumentError(f"layer id must be an integer, got {lid!r}")
    lid = int(lid)
    if not 0 <= lid < layer_num:
        raise InvalidIndexError(f"layer id {lid} out of range [0, {layer_num})")
    return lid


def index_tensor(idx: Any, device: torch.device, what: str = "indices") -> torch.Tensor:
    """``idx`` (tensor, numpy array, sequence or int) as a 1-D int64 tensor on ``device``.

    Raises:
        InvalidArgumentError: not integer-typed (bool and float tensors are rejected).
    """
    if isinstance(idx, torch.Tensor):
        t = idx
    elif isinstance(idx, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(idx))
    elif isinstance(idx, (int, np.integer)) and not isinstance(idx, bool):
        t = torch.tensor([int(idx)], dtype=torch.int64)
    else:
        try:
            t = torch.as_tensor(idx)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidArgumentError(f"{what} must be integers: {e}") from None
        if t.numel() == 0:
            t = t.to(torch.int64)
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise InvalidArgumentError(f"{what} must be an integer tensor, got dtype {t.dtype}")
    return t.reshape(-1).to(device=device, dtype=torch.int64)


def check_range(idx: torch.Tensor, lo: int, hi: int, what: str = "index") -> None:
    """Every element of the 1-D int64 ``idx`` lies in ``[lo, hi)``.

    O(n), one reduction (one device sync on CUDA). Raises ``InvalidIndexError`` naming the
    offending ids.
    """
    if idx.numel() == 0:
        return
    mn, mx = torch.stack([idx.min(), idx.max()]).tolist()  # one host sync
    if mn < lo or mx >= hi:
        bad = idx[(idx < lo) | (idx >= hi)].cpu().tolist()
        raise InvalidIndexError(f"{what} out of range [{lo}, {hi}): {describe_ids(bad)}")


def check_unique(idx: torch.Tensor, what: str = "indices", error=InvalidArgumentError) -> None:
    """No id appears twice in ``idx``. O(n log n). Raises ``error`` naming the repeated ids."""
    if idx.numel() < 2:
        return
    s, _ = torch.sort(idx)
    dup = s[1:][s[1:] == s[:-1]]
    if dup.numel():
        raise error(f"{what} repeated in one call: {describe_ids(torch.unique(dup).cpu().tolist())}")


def check_allocated(free_slots, idx: torch.Tensor, what: str = "slot") -> None:
    """Every id of ``idx`` is allocated (not free) in ``free_slots``.

    Raises ``InvalidArgumentError`` naming the free ids.
    """
    if idx.numel() == 0:
        return
    free = free_slots.is_free(idx)
    free = torch.as_tensor(free, device=idx.device)
    if bool(free.any()):
        bad = idx[free].cpu().tolist()
        raise InvalidArgumentError(f"{what} not allocated: {describe_ids(bad)}")


def check_free_target(free_slots, idx: torch.Tensor, what: str = "slot") -> None:
    """``idx`` may be freed: no repeats and every id currently allocated.

    Raises ``DoubleFreeError`` naming the ids that are already free or repeated.
    """
    check_unique(idx, what, error=DoubleFreeError)
    if idx.numel() == 0:
        return
    free = torch.as_tensor(free_slots.is_free(idx), device=idx.device)
    if bool(free.any()):
        raise DoubleFreeError(f"{what} already free: {describe_ids(idx[free].cpu().tolist())}")


def check_same_length(a: int, b: int, what: str) -> None:
    if a != b:
        raise LengthMismatchError(f"{what}: {a} != {b}")
