"""``RadixKey``: the token ids of one lookup, stored compactly, plus its cache namespace.

A key holds its tokens once, as the raw bytes of a contiguous int32 array (native byte
order); ``token_ids`` is a read-only numpy view of those same bytes. The RadixCache works
on the bytes directly: ``bytes.startswith(node_key, offset)`` is a ``memcmp`` with no
allocation, and a child is found by hashing the bytes of its first page. So a key costs
4 bytes per token plus a fixed ~150 bytes, and building one is a single copy.

``extra_key`` is the namespace (LoRA id, tenant, cache salt): keys with different extra keys
never share a tree node, and ``None`` is a namespace of its own. It must be hashable.

The module also holds the two array helpers the tree needs (longest common prefix of two
int32 byte strings) so the tree itself has no per-token Python loop.
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import overload

import numpy as np

from radixkv.errors import InvalidArgumentError
from radixkv.validation import int32_tokens

__all__ = ["RadixKey", "as_radix_key", "common_prefix_tokens", "TOKEN_BYTES"]

#: Bytes per token id in a key's buffer.
TOKEN_BYTES = 4
_I32 = np.dtype(np.int32)


class RadixKey:
    """Token ids (int32) plus a namespace; immutable.

    Args:
        token_ids: a list, numpy integer array or torch integer tensor (1-D), values in int32.
        extra_key: the namespace; any hashable value, ``None`` by default.

    Attributes: ``token_ids`` (read-only int32 numpy view), ``extra_key``.

    Raises InvalidArgumentError: non-integer or multi-dimensional tokens, values outside int32,
    or an unhashable ``extra_key``. Construction is O(n) (one copy); ``len``, slicing with step
    1 and ``buffer`` are O(1) apart from the copy a slice makes.
    """

    __slots__ = ("_buf", "token_ids", "extra_key")
    _buf: bytes
    token_ids: np.ndarray
    extra_key: Hashable

    def __init__(self, token_ids: object, extra_key: Hashable = None):
        try:
            hash(extra_key)
        except TypeError:
            raise InvalidArgumentError(
                f"extra_key must be hashable, got {type(extra_key).__name__}"
            ) from None
        buf = token_ids._buf if isinstance(token_ids, RadixKey) else int32_tokens(token_ids).tobytes()
        self._buf = buf
        self.token_ids = np.frombuffer(buf, dtype=_I32)
        self.extra_key = extra_key

    @classmethod
    def _from_buffer(cls, buf: bytes, extra_key: Hashable) -> RadixKey:
        """Wrap int32 bytes already validated (internal; no copy, no checks)."""
        key = cls.__new__(cls)
        key._buf = buf
        key.token_ids = np.frombuffer(buf, dtype=_I32)
        key.extra_key = extra_key
        return key

    @property
    def buffer(self) -> bytes:
        """The tokens as int32 bytes (native order); shared, never copied."""
        return self._buf

    def __len__(self) -> int:
        return len(self._buf) >> 2

    @overload
    def __getitem__(self, idx: slice) -> RadixKey: ...
    @overload
    def __getitem__(self, idx: int) -> int: ...
    def __getitem__(self, idx: int | slice) -> RadixKey | int:
        """``key[a:b]`` is a ``RadixKey`` in the same namespace (step must be 1);
        ``key[i]`` is the token ``int``."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise InvalidArgumentError("RadixKey slices must have step 1")
            stop = max(stop, start)
            return RadixKey._from_buffer(self._buf[start * 4:stop * 4], self.extra_key)
        return int(self.token_ids[idx])

    def page_aligned(self, page_size: int) -> RadixKey:
        """The longest prefix whose length is a multiple of ``page_size`` (self if it is)."""
        n = len(self)
        aligned = n - n % page_size
        return self if aligned == n else self[:aligned]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, RadixKey) and self.extra_key == other.extra_key
                and self._buf == other._buf)

    def __hash__(self) -> int:
        return hash((self.extra_key, self._buf))

    def __repr__(self) -> str:
        head = self.token_ids[:8].tolist()
        more = ", ..." if len(self) > 8 else ""
        return f"RadixKey(len={len(self)}, tokens={head}{more}, extra_key={self.extra_key!r})"


def as_radix_key(key: RadixKey | object, extra_key: Hashable = None) -> RadixKey:
    """``key`` itself when it is a ``RadixKey`` (then ``extra_key`` must be ``None`` or
    equal to the key's own), else ``RadixKey(key, extra_key)``."""
    if type(key) is RadixKey:
        if extra_key is not None and extra_key != key.extra_key:
            raise InvalidArgumentError(
                f"extra_key {extra_key!r} conflicts with the RadixKey's own {key.extra_key!r}"
            )
        return key
    return RadixKey(key, extra_key)


def common_prefix_tokens(a: bytes, b: bytes, b_start: int = 0, b_end: int | None = None) -> int:
    """Length, in tokens, of the longest common prefix of the int32 strings ``a`` and
    ``b[b_start:b_end]`` (offsets in bytes, multiples of 4).

    Vectorized: one equality over ``min(len)`` tokens and one ``flatnonzero``; callers try
    ``bytes.startswith`` (a ``memcmp``) first and come here only on a mismatch.
    """
    if b_end is None:
        b_end = len(b)
    n = min(len(a), b_end - b_start) >> 2
    if n <= 0:
        return 0
    x = np.frombuffer(a, dtype=_I32, count=n)
    y = np.frombuffer(b, dtype=_I32, count=n, offset=b_start)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
