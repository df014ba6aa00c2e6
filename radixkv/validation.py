"""Input validation for every layer: ids, indices, counts, tokens and request fields.

One module, beside :mod:`radixkv.errors`, at the bottom of the package graph (it imports only
numpy, torch and the errors). Nothing here mutates anything: every layer validates its whole
input first and mutates after, so a raise leaves its state unchanged.

Checks are vectorized (one reduction, one host synchronisation for the happy path); naming
the offending ids, the slower work, happens only when a check fails. On CUDA a range check
costs one device sync, which is why pools and allocators take ``checks=True`` and let a hot
loop that trusts its caller turn it off.

Sections: counts; id and index tensors (allocators, pools); tokens; request fields (the
engine's calls and the gRPC client's, which validates with the engine's own rules).
"""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from radixkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    LengthMismatchError,
    describe_ids,
)

__all__ = [
    "MAX_RID_LEN", "MAX_EXTRA_KEY_LEN",
    "check_count", "check_same_length",
    "sort_ids", "repeated", "index_tensor", "check_range", "check_unique", "check_ids_to_free",
    "check_allocated", "layer_index",
    "as_token_array", "int32_tokens", "check_tokens", "check_token_id",
    "check_rid", "check_rids", "check_extra_key", "check_priority", "as_items",
]

MAX_RID_LEN = 256
MAX_EXTRA_KEY_LEN = 1024
_I32 = np.dtype(np.int32)
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
# Above this many ids a CPU sort goes through numpy: torch's CPU sort is several times
# slower, worst on presorted input (a merge of ascending lists, a request's slots).
_NUMPY_SORT_MIN = 2048


# --------------------------------------------------------------------------- counts


def check_count(n: object, what: str = "n") -> int:
    """``n`` (an int or numpy integer, not a bool) as a non-negative Python int.

    Raises:
        InvalidArgumentError: another type, or a negative value.
    """
    if type(n) is int and n >= 0:  # the common case, without the ABC check (evict's hot path)
        return n
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or int(n) < 0:
        raise InvalidArgumentError(f"{what} must be a non-negative int, got {n!r:.80}")
    return int(n)


def check_same_length(a: int, b: int, what: str) -> None:
    """LengthMismatchError unless ``a == b``."""
    if a != b:
        raise LengthMismatchError(f"{what}: {a} != {b}")


# --------------------------------------------------------------------------- ids and indices


def sort_ids(ids: torch.Tensor) -> torch.Tensor:
    """An ascending copy of the 1-D id tensor ``ids``, on its device. O(k log k)."""
    if ids.device.type == "cpu" and ids.numel() > _NUMPY_SORT_MIN:
        return torch.from_numpy(np.sort(ids.numpy()))
    return ids.sort().values


def repeated(ids: torch.Tensor) -> torch.Tensor:
    """The distinct values that occur more than once in ``ids``. O(k log k)."""
    s = sort_ids(ids)
    out: torch.Tensor = torch.unique_consecutive(s[1:][s[1:] == s[:-1]])
    return out


def index_tensor(idx: object, device: torch.device | str, what: str = "indices", *,
                 sequences: bool = True) -> torch.Tensor:
    """``idx`` (tensor, numpy array or int; any sequence of ints too when ``sequences``) as a
    flat int64 tensor on ``device``. O(k).

    Raises:
        InvalidArgumentError: not integer-typed (bool, float and complex are rejected), or
            a sequence when ``sequences`` is False.
    """
    if type(idx) is torch.Tensor and idx.dtype is torch.int64 and idx.dim() == 1 \
            and idx.device == torch.device(device):
        return idx  # already what is asked (the allocators' frees): no dispatch
    if isinstance(idx, torch.Tensor):
        t = idx
    elif isinstance(idx, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(idx))
    elif isinstance(idx, numbers.Integral) and not isinstance(idx, bool):
        t = torch.tensor([int(idx)], dtype=torch.int64)
    elif not sequences:
        raise InvalidArgumentError(
            f"{what} must be an integer tensor or numpy array, got {type(idx).__name__}")
    else:
        try:
            t = torch.as_tensor(idx)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidArgumentError(f"{what} must be integers: {e}") from None
        if t.numel() == 0:
            t = t.to(torch.int64)
    if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise InvalidArgumentError(f"{what} must have an integer dtype, got {t.dtype}")
    return t.reshape(-1).to(device=device, dtype=torch.int64)


def check_range(idx: torch.Tensor, lo: int, hi: int, what: str = "index") -> None:
    """Every element of the 1-D int64 ``idx`` lies in ``[lo, hi)``.

    O(k), one reduction (one device sync on CUDA).

    Raises:
        InvalidIndexError: naming the ids outside ``[lo, hi)``.
    """
    if idx.numel() == 0:
        return
    mn, mx = torch.stack(torch.aminmax(idx)).tolist()  # one host sync
    if mn < lo or mx >= hi:
        bad = idx[(idx < lo) | (idx >= hi)].cpu().tolist()
        raise InvalidIndexError(f"{what} out of range [{lo}, {hi}): {describe_ids(bad)}")


def check_unique(idx: torch.Tensor, what: str = "indices",
                 error: type[InvalidArgumentError] = InvalidArgumentError) -> None:
    """No id appears twice in ``idx``. O(k log k). Raises ``error`` naming the repeated ids."""
    if idx.numel() < 2:
        return
    dup = repeated(idx)
    if dup.numel():
        raise error(f"{what} repeated in one call: {describe_ids(dup.cpu().tolist())}")


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
        srt = sort_ids(ids)
        parts.append((srt[1:] == srt[:-1]).any())
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


class _HasIsFree(Protocol):
    def is_free(self, ids: torch.Tensor) -> torch.Tensor: ...


def check_allocated(free_slots: _HasIsFree, idx: torch.Tensor, what: str = "slot") -> None:
    """Every id of ``idx`` is allocated (not free) in ``free_slots``.

    Raises:
        InvalidArgumentError: naming the free ids.
    """
    if idx.numel() == 0:
        return
    free = torch.as_tensor(free_slots.is_free(idx), device=idx.device)
    if bool(free.any()):
        bad = idx[free].cpu().tolist()
        raise InvalidArgumentError(f"{what} not allocated: {describe_ids(bad)}")


def layer_index(layer: object, layer_num: int) -> int:
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
    n = int(lid)
    if not 0 <= n < layer_num:
        raise InvalidIndexError(f"layer id {n} out of range [0, {layer_num})")
    return n


# --------------------------------------------------------------------------- tokens


def as_token_array(tokens: object) -> np.ndarray:
    """Tokens (list, numpy array or torch tensor of integers) as a flat, contiguous int32
    numpy array (no copy when they already are one). The lenient coercion, for records
    built in process (``Req``); calls from outside go through :func:`check_tokens`.

    Raises:
        InvalidArgumentError: a non-integer dtype.
    """
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.dtype != _I32:
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgumentError(f"token ids must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr.reshape(-1))


def int32_tokens(tokens: object, what: str = "token ids") -> np.ndarray:
    """Token ids (a list, numpy array or torch tensor of integers, 1-D, any integer dtype)
    as a contiguous int32 numpy array in native byte order: no copy when they already are
    one, else one range check and one conversion. The one coercion of the tree's keys
    (``RadixKey``), the KV-event block hashes and the router's queries. O(n).

    Raises:
        InvalidArgumentError: raw bytes, not 1-D, a non-integer dtype, or values outside
            int32.
    """
    if type(tokens) is np.ndarray and tokens.dtype == _I32 and tokens.ndim == 1:  # hot path
        return tokens if tokens.flags.c_contiguous else np.ascontiguousarray(tokens)
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
            raise InvalidArgumentError(f"{what} must be integers, got dtype {tokens.dtype}")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"pass {what} as a sequence of ints, not raw bytes")
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype != _I32:
        if arr.size == 0:
            return np.empty(0, dtype=_I32)
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentError(f"{what} must be integers, got dtype {arr.dtype}")
        # argmin / argmax: one typed loop each (see check_ids_to_free)
        if int(arr[arr.argmin()]) < _I32_MIN or int(arr[arr.argmax()]) > _I32_MAX:
            raise InvalidArgumentError(f"{what} do not fit in int32")
        arr = arr.astype(_I32)
    return np.ascontiguousarray(arr)


def check_tokens(tokens: object, what: str, allow_empty: bool = False) -> np.ndarray:
    """Token ids: a 1-D int32 numpy array (or int32 torch tensor), values >= 0.

    Returns the tokens as a contiguous int32 numpy array (no copy when they already are
    one). O(n): one reduction.

    Raises:
        InvalidArgumentError: another container or dtype (int64 included: tokens travel as
            int32), another shape, negative ids, or emptiness when not allowed.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype != torch.int32:
            raise InvalidArgumentError(f"{what}: token ids must be int32, got {tokens.dtype}")
        tokens = tokens.detach().cpu().numpy()
    if not isinstance(tokens, np.ndarray):
        raise InvalidArgumentError(f"{what}: token ids must be an int32 numpy array, got "
                                   f"{type(tokens).__name__}")
    if tokens.dtype != _I32:
        raise InvalidArgumentError(f"{what}: token ids must be int32, got dtype {tokens.dtype}")
    if tokens.ndim != 1:
        raise InvalidArgumentError(f"{what}: token ids must be 1-D, got shape {tokens.shape}")
    if tokens.size == 0:
        if not allow_empty:
            raise InvalidArgumentError(f"{what}: no token ids")
        return np.ascontiguousarray(tokens)
    if int(tokens.min()) < 0:
        raise InvalidArgumentError(f"{what}: negative token ids")
    return np.ascontiguousarray(tokens)


def check_token_id(token_id: object, what: str) -> int:
    """One token id: an int (or numpy integer) in ``[0, 2**31)``."""
    if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
        raise InvalidArgumentError(f"{what}: token_id must be an int, got {type(token_id).__name__}")
    t = int(token_id)
    if not 0 <= t < (1 << 31):
        raise InvalidArgumentError(f"{what}: token_id {t} outside [0, 2**31)")
    return t


# --------------------------------------------------------------------------- request fields


def check_rid(rid: object) -> str:
    """A request id: a non-empty ``str`` of at most :data:`MAX_RID_LEN` characters."""
    if not isinstance(rid, str) or not rid or len(rid) > MAX_RID_LEN:
        raise InvalidArgumentError(f"a request id must be a non-empty str of at most {MAX_RID_LEN} "
                                   f"characters, got {rid!r:.80}")
    return rid


def check_rids(rids: object) -> list[str]:
    """A list/tuple of distinct request ids. O(n).

    Raises:
        InvalidArgumentError: another container, a bad id, or repeated ids (names them).
    """
    if isinstance(rids, (str, bytes)) or not isinstance(rids, (list, tuple)):
        raise InvalidArgumentError(f"rids must be a list or tuple of str, got {type(rids).__name__}")
    out = [check_rid(r) for r in rids]
    if len(set(out)) != len(out):
        seen: set[str] = set()
        dup: list[str] = []
        for r in out:
            if r in seen:
                dup.append(r)
            seen.add(r)
        raise InvalidArgumentError(f"request ids repeated in one call: {sorted(set(dup))}")
    return out


def check_extra_key(extra_key: object, what: str) -> str | None:
    """A cache namespace: ``None`` or a ``str`` of at most :data:`MAX_EXTRA_KEY_LEN`."""
    if extra_key is None:
        return None
    if not isinstance(extra_key, str) or len(extra_key) > MAX_EXTRA_KEY_LEN:
        raise InvalidArgumentError(f"{what}: extra_key must be None or a str of at most "
                                   f"{MAX_EXTRA_KEY_LEN} characters")
    return extra_key


def check_priority(priority: object, what: str) -> int:
    """An eviction priority: an int that fits in int64."""
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) \
            or not _I64_MIN <= int(priority) <= _I64_MAX:
        raise InvalidArgumentError(f"{what}: priority must be an int64, got {priority!r}")
    return int(priority)


T = TypeVar("T", bound=NamedTuple)


def as_items(items: object, cls: type[T], what: str) -> list[T]:
    """``items`` (a list/tuple) as a list of ``cls`` NamedTuples: each entry an instance,
    or a plain tuple with that many fields (trailing defaults allowed)."""
    if not isinstance(items, (list, tuple)) or isinstance(items, cls):
        raise InvalidArgumentError(f"{what} must be a list or tuple of {cls.__name__}, got "
                                   f"{type(items).__name__}")
    out: list[T] = []
    fields: tuple[str, ...] = cls._fields
    defaults: dict[str, Any] = cls._field_defaults
    n_req = len(fields) - len(defaults)
    for i, item in enumerate(items):
        if isinstance(item, cls):
            out.append(item)
        elif type(item) is tuple and n_req <= len(item) <= len(fields):
            out.append(cls(*item))
        else:
            raise InvalidArgumentError(f"{what}[{i}] must be a {cls.__name__}, got {type(item).__name__}")
    return out
