"""KV row indices crossing the RadixCache's boundary: validation and conversion.

The tree stores rows as int32 bytes (see ``tree_node``); callers hand them in as integer
tensors (any device) or numpy arrays and get them back as int64 tensors on the cache's
device. Every function here is O(rows) with a constant number of numpy calls.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError

__all__ = ["check_value", "rows_bytes", "rows_tensor", "row_max"]

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
_U32 = np.dtype(np.uint32)
_U64 = np.dtype(np.uint64)
_ROW_LIMIT = 1 << 31
# integer dtypes the general check accepts, for check_value's fast path (plain tensors)
_INT_TENSOR_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})
_Tensor = torch.Tensor


def check_value(value: object, n_tokens: int) -> torch.Tensor | np.ndarray:
    """Validate an ``insert`` value's type, dtype, shape and length (O(1))."""
    if type(value) is _Tensor and value.dtype in _INT_TENSOR_DTYPES and value.ndim == 1:
        size = value.shape[0]  # fast path: a plain 1-D integer tensor (three attribute reads)
        if size != n_tokens:
            raise LengthMismatchError(f"key has {n_tokens} tokens but value has {size} rows")
        return value
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise InvalidArgumentError(f"value must be an integer tensor, got dtype {value.dtype}")
        if value.dim() != 1:
            raise InvalidArgumentError(f"value must be 1-D, got shape {tuple(value.shape)}")
        size = value.numel()
    else:
        if not isinstance(value, np.ndarray):
            if value is None or isinstance(value, (str, bytes)):
                raise InvalidArgumentError("value must be an integer tensor or array of KV rows")
            value = np.asarray(value)
        if value.ndim != 1:
            raise InvalidArgumentError(f"value must be 1-D, got shape {value.shape}")
        if value.dtype.kind not in "iu" and value.size:
            raise InvalidArgumentError(f"value must be integers, got dtype {value.dtype}")
        size = value.size
    if size != n_tokens:
        raise LengthMismatchError(f"key has {n_tokens} tokens but value has {size} rows")
    return value


def row_max(a: np.ndarray) -> Any:
    """The largest element of a non-empty 1-D array, as ``a[a.argmax()]``: ``argmax`` is one
    typed loop, where ``ndarray.max`` / ``np.maximum.reduce`` go through the ufunc reduction
    machinery (2.5x the time here, and ~640 more first-level instruction-cache misses per call
    in the benchmark's cycle, counted by ``benchmarks/count_radix.py``). Callers check the
    array is not empty; hot paths inline the expression."""
    return a[a.argmax()]


def rows_bytes(value: torch.Tensor | np.ndarray, start: int) -> bytes:
    """``value[start:]`` as int32 bytes, after checking every row lies in ``[0, 2**31)``.
    One host copy and one reduction (a uint view's max checks both bounds at once)."""
    if isinstance(value, torch.Tensor):
        if value.is_cpu:
            tail = value.numpy()[start:]
        else:
            tail = value[start:].cpu().numpy()
    else:
        tail = value[start:]
    if tail.size == 0:
        return b""
    dtype = tail.dtype
    if dtype is _I32 or dtype == _I32:
        if row_max(tail.view(_U32)) >= _ROW_LIMIT:
            raise InvalidIndexError("KV rows must be non-negative")
        return tail.tobytes()
    if dtype is not _I64 and dtype != _I64:
        tail = tail.astype(_I64)
    if row_max(tail.view(_U64)) >= _ROW_LIMIT:
        raise InvalidIndexError("KV rows must lie in [0, 2**31)")
    return tail.astype(_I32).tobytes()


def rows_tensor(joined: bytes, device: torch.device) -> torch.Tensor:
    """int32 row bytes as an int64 tensor on ``device`` (one conversion, one transfer)."""
    t = torch.from_numpy(np.frombuffer(joined, dtype=_I32).astype(_I64))
    return t if device.type == "cpu" else t.to(device)
