"""Input validation of the engine's calls (pure: nothing here mutates anything).

Every engine method runs these on its whole input before it changes any state, so a bad
call raises a :mod:`radixkv.errors` type and leaves the engine exactly as it was. Token
arrays are checked with one vector reduction each, never per token.
"""
from __future__ import annotations

from typing import Any, List, Optional, Type, TypeVar

import numpy as np
import torch

from radixkv.errors import InvalidArgumentError

__all__ = [
    "MAX_RID_LEN", "MAX_EXTRA_KEY_LEN", "check_rid", "check_rids", "check_tokens",
    "check_token_id", "check_extra_key", "check_priority", "check_count", "as_items",
]

MAX_RID_LEN = 256
MAX_EXTRA_KEY_LEN = 1024
_I32 = np.dtype(np.int32)
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

T = TypeVar("T", bound=tuple)


def check_rid(rid: Any) -> str:
    """A request id: a non-empty ``str`` of at most :data:`MAX_RID_LEN` characters."""
    if not isinstance(rid, str) or not rid or len(rid) > MAX_RID_LEN:
        raise InvalidArgumentError(f"a request id must be a non-empty str of at most {MAX_RID_LEN} "
                                   f"characters, got {rid!r:.80}")
    return rid


def check_rids(rids: Any) -> List[str]:
    """A list/tuple of distinct request ids. Raises ``InvalidArgumentError`` naming the
    repeated ones. O(n)."""
    if isinstance(rids, (str, bytes)) or not isinstance(rids, (list, tuple)):
        raise InvalidArgumentError(f"rids must be a list or tuple of str, got {type(rids).__name__}")
    out = [check_rid(r) for r in rids]
    if len(set(out)) != len(out):
        seen, dup = set(), []
        for r in out:
            if r in seen:
                dup.append(r)
            seen.add(r)
        raise InvalidArgumentError(f"request ids repeated in one call: {sorted(set(dup))}")
    return out


def check_tokens(tokens: Any, what: str, allow_empty: bool = False) -> np.ndarray:
    """Token ids: a 1-D int32 numpy array (or int32 torch tensor), values >= 0.

    Returns the tokens as a contiguous int32 numpy array (no copy when they already are
    one). Raises ``InvalidArgumentError`` for another container or dtype (int64 included:
    tokens travel as int32), another shape, negative ids, or emptiness when not allowed.
    O(n): one reduction."""
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


def check_token_id(token_id: Any, what: str) -> int:
    """One token id: an int (or numpy integer) in ``[0, 2**31)``."""
    if isinstance(token_id, bool) or not isinstance(token_id, (int, np.integer)):
        raise InvalidArgumentError(f"{what}: token_id must be an int, got {type(token_id).__name__}")
    t = int(token_id)
    if not 0 <= t < (1 << 31):
        raise InvalidArgumentError(f"{what}: token_id {t} outside [0, 2**31)")
    return t


def check_extra_key(extra_key: Any, what: str) -> Optional[str]:
    """A cache namespace: ``None`` or a ``str`` of at most :data:`MAX_EXTRA_KEY_LEN`."""
    if extra_key is None:
        return None
    if not isinstance(extra_key, str) or len(extra_key) > MAX_EXTRA_KEY_LEN:
        raise InvalidArgumentError(f"{what}: extra_key must be None or a str of at most "
                                   f"{MAX_EXTRA_KEY_LEN} characters")
    return extra_key


def check_priority(priority: Any, what: str) -> int:
    """An eviction priority: an int that fits in int64."""
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)) \
            or not _I64_MIN <= int(priority) <= _I64_MAX:
        raise InvalidArgumentError(f"{what}: priority must be an int64, got {priority!r}")
    return int(priority)


def check_count(n: Any, what: str) -> int:
    """A non-negative int."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or int(n) < 0:
        raise InvalidArgumentError(f"{what} must be a non-negative int, got {n!r}")
    return int(n)


def as_items(items: Any, cls: Type[T], what: str) -> List[T]:
    """``items`` (a list/tuple) as a list of ``cls`` NamedTuples: each entry an instance,
    or a plain tuple with that many fields (trailing defaults allowed)."""
    if not isinstance(items, (list, tuple)) or isinstance(items, cls):
        raise InvalidArgumentError(f"{what} must be a list or tuple of {cls.__name__}, got "
                                   f"{type(items).__name__}")
    out = []
    n_req = len(cls._fields) - len(cls._field_defaults)
    for i, item in enumerate(items):
        if isinstance(item, cls):
            out.append(item)
        elif type(item) is tuple and n_req <= len(item) <= len(cls._fields):
            out.append(cls(*item))
        else:
            raise InvalidArgumentError(f"{what}[{i}] must be a {cls.__name__}, got {type(item).__name__}")
    return out

