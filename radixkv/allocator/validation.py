"""Vectorized validation shared by the free lists and allocators.

Every check here runs in O(k) (or O(k log k) for the duplicate check) over the ``k`` ids of
one call, with a single host synchronisation for the happy path; the slower work of naming
the offending ids happens only when a check fails. Nothing here mutates state.
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

from radixkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    describe_ids,
)


# Above this many ids a CPU sort goes through numpy: torch's CPU sort is several times
# slower, worst on presorted input (a merge of ascending lists, a request's slots).
_NUMPY_SORT_MIN = 2048


def sort_ids(ids: torch.Tensor) -> torch.Tensor:
    """An ascending copy of the 1-D id tensor ``ids``, on its device. O(k log k)."""
    if ids.device.type == "cpu" and ids.numel() > _NUMPY_SORT_MIN:
        return torch.from_numpy(np.sort(ids.numpy()))
    return ids.sort().values


def as_id_tensor(ids, device: torch.device, what: str = "ids") -> torch.Tensor:
    """``ids`` (tensor or numpy array of an integer dtype) as a flat int64 tensor on
    ``device``. Raises InvalidArgumentError for a non-integer (or bool) dtype. O(k)."""
    if isinstance(ids, torch.Tensor):
        t = ids
    elif isinstance(ids, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(ids))
    elif isinstance(ids, numbers.Integral):
        t = torch.tensor([int(ids)], dtype=torch.int64)
    else:
        raise InvalidArgumentError(
            f"{what} must be an integer tensor or numpy array, got {type(ids).__name__}"
        )
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise InvalidArgumentError(f"{what} must have an integer dtype, got {t.dtype}")
    return t.reshape(-1).to(device=device, dtype=torch.int64)


def check_count(n, what: str = "n") -> int:
    """``n`` as a non-negative Python int; InvalidArgumentError otherwise."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise InvalidArgumentError(f"{what} must be an int, got {type(n).__name__}")
    if n < 0:
        raise InvalidArgumentError(f"{what} must be >= 0, got {n}")
    return int(n)


def check_ids_to_free(
    ids: torch.Tensor,
    free_mask: torch.Tensor,
    lo: int,
    hi: int,
    *,
    kind: str = "id",
    check_duplicates: bool = True,
) -> None:
    """Raise unless every id in ``ids`` (flat int64, on ``free_mask``'s device) lies in
    ``[lo, hi]``, is not already free (``free_mask[id]`` is False) and, when
    ``check_duplicates``, occurs once. O(k log k) for k ids (O(k) without the duplicate
    check); a handful of vector ops and one host sync when valid.

    Raises:
        InvalidIndexError: ids outside ``[lo, hi]`` (names them).
        DoubleFreeError: ids already free, or repeated within ``ids`` (names them).
    """
    k = ids.numel()
    if k == 0:
        return
    if ids.device.type == "cpu" and free_mask.device.type == "cpu":
        # The same checks on numpy views of the same memory: no torch dispatch, and numpy's
        # gather / sort are ~2x cheaper for the few-thousand-id frees of an eviction.
        # argmin / argmax / count_nonzero: one typed loop each, far less code than the ufunc
        # reductions behind .min() / .max() / .any() (radixkv.cache.rows.row_max)
        a = ids.numpy()
        if a[a.argmin()] >= lo and a[a.argmax()] <= hi:
            if not np.count_nonzero(free_mask.numpy()[a]):
                if not check_duplicates or k == 1:
                    return
                s = np.sort(a)
                if not np.count_nonzero(s[1:] == s[:-1]):
                    return
        # else: fall through; the torch path below finds and names the bad ids
    mn, mx = torch.aminmax(ids)
    parts = [mn, mx, free_mask[ids.clamp(0, free_mask.numel() - 1)].any()]
    if check_duplicates and k > 1:
        s = sort_ids(ids)
        parts.append((s[1:] == s[:-1]).any())
    flags = torch.stack(parts).tolist()
    if flags[0] < lo or flags[1] > hi:
        oob = (ids < lo) | (ids > hi)
        raise InvalidIndexError(
            f"{kind}s out of range [{lo}, {hi}]: {describe_ids(ids[oob].tolist())}"
        )
    if flags[2]:
        raise DoubleFreeError(
            f"{kind}s already free: {describe_ids(ids[free_mask[ids]].tolist())}"
        )
    if len(flags) > 3 and flags[3]:
        raise DoubleFreeError(
            f"{kind}s repeated in one free call: {describe_ids(repeated(ids).tolist())}"
        )


def repeated(ids: torch.Tensor) -> torch.Tensor:
    """The distinct values that occur more than once in ``ids``. O(k log k)."""
    s = sort_ids(ids)
    return torch.unique_consecutive(s[1:][s[1:] == s[:-1]])


def check_ids_in_range(ids: torch.Tensor, lo: int, hi: int, kind: str = "id") -> None:
    """InvalidIndexError naming the ids of ``ids`` outside ``[lo, hi]``. O(k)."""
    if ids.numel() == 0:
        return
    mn, mx = torch.stack(torch.aminmax(ids)).tolist()
    if mn < lo or mx > hi:
        oob = (ids < lo) | (ids > hi)
        raise InvalidIndexError(
            f"{kind}s out of range [{lo}, {hi}]: {describe_ids(ids[oob].tolist())}"
        )
