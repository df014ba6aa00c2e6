"""Chained block hashes of the KV events: one unsigned 64-bit hash per page.

Split out of :mod:`radixkv.cache.kv_events`; import these names from here. The
cache's events, the Dynamo adapter and the state index all hash pages with
:func:`block_hashes`, the single place the hash is computed.

The exact byte layout
---------------------
Hashes are chained SHA-256, reduced to unsigned 64-bit integers, so that any process (or
language) that knows the seed, the page size and the tokens computes the same hashes.

1. **Chain root.** The seed (``bytes``, ``str`` or ``int``) is reduced to 8 bytes, ``R``:

   * ``int`` ``s`` (``0 <= s < 2**64``): ``R = s.to_bytes(8, "little")``;
   * ``bytes`` ``b``: ``R = sha256(b).digest()[:8]``;
   * ``str`` ``t``: as the bytes ``t.encode("utf-8")``.

   The default seed is :data:`DEFAULT_SEED` (``b"radixkv/kv-events/v1"``).

2. **Extra key** ``E`` (the namespace), a tagged, length-prefixed field:

   * ``None``  -> ``b"\\x00"``
   * ``str``   -> ``b"\\x01" + u32le(len(utf8)) + utf8``
   * ``bytes`` -> ``b"\\x02" + u32le(len(b)) + b``
   * ``int``   -> ``b"\\x03" + i64le(value)`` (``-2**63 <= value < 2**63``)
   * ``tuple`` -> ``b"\\x04" + u32le(len(t)) + E(t[0]) + E(t[1]) + ...`` (nested keys)

   where ``u32le`` / ``i64le`` are little-endian unsigned 32-bit / signed 64-bit integers.

3. **Page ``i``** with tokens ``t[i*P:(i+1)*P]`` (``P`` = page size) and previous link
   ``prev_i`` (8 bytes)::

       digest_i = sha256(prev_i || E || int32le(t[i*P]) || ... || int32le(t[(i+1)*P - 1]))
       h_i      = int.from_bytes(digest_i[:8], "little")          # unsigned 64-bit

   with ``prev_0 = R`` when the block has no parent (the node hangs off the root), else
   ``prev_0 = parent_hash.to_bytes(8, "little")``, and ``prev_i = h_{i-1}.to_bytes(8,
   "little")`` for ``i > 0``.

Every field has a fixed width or a length prefix, so no two different inputs share a byte
string. Since the parent link carries the whole chain, a node's page hashes do not change
when the tree splits the node (the split simply divides its hash list).

:func:`block_hashes` is the single place the hash is computed.
"""
from __future__ import annotations

import hashlib
import struct

import numpy as np

from radixkv.errors import AlignmentError, InvalidArgumentError
from radixkv.validation import int32_tokens

__all__ = ["DEFAULT_SEED", "HASH_BITS", "Seed", "block_hashes", "chain_root", "encode_extra_key",
           "check_hash", "page_tokens"]

#: Seed of the hash chain when the caller gives none. Processes that must agree on hashes
#: only need to agree on this value (and the page size).
DEFAULT_SEED: bytes = b"radixkv/kv-events/v1"
#: Width of a block hash.
HASH_BITS = 64
_HASH_LIMIT = 1 << HASH_BITS

Seed = bytes | int | str


# --------------------------------------------------------------------------- hashing


def chain_root(seed: Seed = DEFAULT_SEED) -> bytes:
    """The 8-byte root of the hash chain for ``seed`` (layout step 1 of the module doc)."""
    if isinstance(seed, bool):
        raise InvalidArgumentError("seed must be bytes, str or int, not bool")
    if isinstance(seed, int):
        if not 0 <= seed < _HASH_LIMIT:
            raise InvalidArgumentError(f"an int seed must lie in [0, 2**64), got {seed}")
        return seed.to_bytes(8, "little")
    if isinstance(seed, str):
        seed = seed.encode("utf-8")
    if isinstance(seed, (bytes, bytearray, memoryview)):
        return hashlib.sha256(bytes(seed)).digest()[:8]
    raise InvalidArgumentError(f"seed must be bytes, str or int, got {type(seed).__name__}")


def encode_extra_key(extra_key: object) -> bytes:
    """The tagged byte form of a namespace key (layout step 2 of the module doc)."""
    if extra_key is None:
        return b"\x00"
    if isinstance(extra_key, bool):
        raise InvalidArgumentError("extra_key must be None, str, bytes or int, not bool")
    if isinstance(extra_key, str):
        raw = extra_key.encode("utf-8")
        return b"\x01" + struct.pack("<I", len(raw)) + raw
    if isinstance(extra_key, (bytes, bytearray)):
        raw = bytes(extra_key)
        return b"\x02" + struct.pack("<I", len(raw)) + raw
    if isinstance(extra_key, (int, np.integer)):
        value = int(extra_key)
        if not -(1 << 63) <= value < (1 << 63):
            raise InvalidArgumentError(f"an int extra_key must fit in int64, got {value}")
        return b"\x03" + struct.pack("<q", value)
    if isinstance(extra_key, tuple):
        return b"\x04" + struct.pack("<I", len(extra_key)) + b"".join(map(encode_extra_key, extra_key))
    raise InvalidArgumentError(
        f"extra_key must be None, str, bytes, int or a tuple of those, got {type(extra_key).__name__}"
    )


def check_hash(value: object, what: str) -> int:
    """``value`` as a u64 block hash; ``InvalidArgumentError`` naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{what} must be an int, got {type(value).__name__}")
    v = int(value)
    if not 0 <= v < _HASH_LIMIT:
        raise InvalidArgumentError(f"{what} must lie in [0, 2**64), got {v}")
    return v


def page_tokens(token_ids: object, page_size: int) -> np.ndarray:
    """Validated tokens as a little-endian int32 array (no copy when already one)."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise InvalidArgumentError(f"page_size must be a positive int, got {page_size!r}")
    arr = int32_tokens(token_ids, "token_ids")
    if arr.size % page_size:
        raise AlignmentError(
            f"{arr.size} tokens is not a whole number of pages of {page_size} tokens"
        )
    return arr


def block_hashes(
    token_ids: object,
    page_size: int,
    parent_hash: int | None = None,
    extra_key: object = None,
    seed: Seed = DEFAULT_SEED,
) -> list[int]:
    """Chained per-page hashes of ``token_ids`` (the layout in the module docstring).

    Args:
        token_ids: int tokens (numpy/torch/list), a multiple of ``page_size`` long.
        page_size: tokens per block.
        parent_hash: hash of the block just before the first page, ``None`` at the root.
        extra_key: the cache namespace (``None``, ``str``, ``bytes`` or ``int``).
        seed: the chain seed used when ``parent_hash`` is ``None``.

    Returns:
        One unsigned 64-bit hash per page, in order.

    Raises:
        AlignmentError: the length is not a multiple of ``page_size``.
        InvalidArgumentError: bad dtype, page size, parent hash, extra key or seed.

    Complexity: O(n) bytes hashed; one ``sha256`` call per page (the token bytes are
    produced by one vectorized conversion, then sliced).
    """
    tokens = page_tokens(token_ids, page_size)
    extra = encode_extra_key(extra_key)
    if parent_hash is None:
        prev = chain_root(seed)
    else:
        prev = check_hash(parent_hash, "parent_hash").to_bytes(8, "little")
    buf = memoryview(tokens.tobytes())
    step = int(page_size) * 4
    out: list[int] = []
    sha256 = hashlib.sha256
    for start in range(0, len(buf), step):
        h = sha256(prev + extra + buf[start:start + step]).digest()[:8]
        out.append(int.from_bytes(h, "little"))
        prev = h
    return out
