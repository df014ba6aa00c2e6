"""Chained block hashes of the KV events: one unsigned 64-bit hash per page.

Chained SHA-256 reduced to u64, so any process (or language) that knows the seed, the page
size and the tokens computes the same hashes: the chain root ``R`` (8 bytes from the seed,
default :data:`DEFAULT_SEED`), a tagged length-prefixed encoding ``E`` of the extra key, then
per page ``h_i = u64le(sha256(prev_i || E || int32le tokens)[:8])`` with ``prev_0`` the root
or the parent's hash. Every field has a fixed width or a length prefix (no two inputs share
a byte string), and a node split only divides its hash list. :func:`block_hashes` is the
single place the hash is computed (the cache's events, the Dynamo adapter, the state index).
The exact byte layout: ``docs/events.md``, section 5.
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
    """The 8-byte root of the hash chain for ``seed`` (layout step 1, ``docs/events.md`` section 5)."""
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
    """The tagged byte form of a namespace key (layout step 2, ``docs/events.md`` section 5)."""
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
    """Chained per-page hashes of ``token_ids`` (layout: ``docs/events.md``, section 5).

    Args: ``token_ids`` (int tokens, numpy/torch/list, a multiple of ``page_size`` long);
    ``page_size``; ``parent_hash`` (the block just before the first page, ``None`` at the root);
    ``extra_key`` (``None``, ``str``, ``bytes``, ``int`` or tuples of them); ``seed`` (the chain
    seed used when ``parent_hash`` is ``None``). Returns one unsigned 64-bit hash per page.

    Raises AlignmentError (length not a multiple of ``page_size``), InvalidArgumentError (bad
    dtype, page size, parent hash, extra key or seed). O(n) bytes hashed, one ``sha256`` per page.
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
