"""Storage-tier page keys: SGLang's chained SHA-256 (``get_hash_str``), seeded per namespace and
KV layout, so that a manager serving another model (or another layout of the same one) never
loads a foreign page.

``key_0 = sha256(seed || int32le(tokens of page 0))``, ``key_i = sha256(key_{i-1} || int32le(
tokens of page i))`` as hex strings, with ``seed = sha256(b"radixkv/storage/v1" || u32le(len(ns))
|| ns || fingerprint)`` where ``ns`` is the namespace's tagged bytes (the KV events' encoding,
``radixkv.cache.block_hash.encode_extra_key``) and ``fingerprint`` is :func:`layout_fingerprint`.
For page-aligned tokens this is SGLang's ``get_hash_str(page, prior_hash)`` chain with the seed
as the first prior hash. Cost: one ``sha256`` per page over ``4 * page_size`` bytes.
"""
from __future__ import annotations

import hashlib
import struct

import numpy as np

from radixkv.errors import AlignmentError, InvalidArgumentError

__all__ = ["STORAGE_KEY_VERSION", "layout_fingerprint", "storage_seed", "page_keys"]

#: Bumped whenever the page format or the key derivation changes: old pages become misses.
STORAGE_KEY_VERSION = b"radixkv/storage/v1"


def layout_fingerprint(**fields: object) -> str:
    """A stable hex digest of the KV layout's fields (kind, layers, heads, head dim, dtype,
    page size, ...): the same fields in any order give the same fingerprint."""
    if not fields:
        raise InvalidArgumentError("a layout fingerprint needs at least one field")
    text = ";".join(f"{k}={fields[k]!s}" for k in sorted(fields))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def storage_seed(namespace: bytes, fingerprint: str) -> bytes:
    """The 32-byte prior hash of a chain's first page, for one namespace and layout."""
    return hashlib.sha256(STORAGE_KEY_VERSION + struct.pack("<I", len(namespace)) + namespace
                          + fingerprint.encode("ascii")).digest()


def page_keys(tokens: np.ndarray, page_size: int, seed: bytes, prior: str | None = None) -> list[str]:
    """One key per whole page of ``tokens`` (int32), chained from ``prior`` (the key of the
    page before the first, as hex) or, when ``None``, from ``seed``.

    Raises:
        AlignmentError: ``tokens`` is not a whole number of pages.
        InvalidArgumentError: ``tokens`` is not a 1-D int32 array, or ``page_size`` < 1.
    """
    if not isinstance(tokens, np.ndarray) or tokens.dtype != np.int32 or tokens.ndim != 1:
        raise InvalidArgumentError("tokens must be a 1-D int32 numpy array")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InvalidArgumentError(f"page_size must be an int >= 1, got {page_size!r}")
    if tokens.size % page_size:
        raise AlignmentError(f"{tokens.size} tokens is not a whole number of pages of {page_size}")
    buf = memoryview(tokens.astype("<i4", copy=False).tobytes())
    prev = seed if prior is None else bytes.fromhex(prior)
    step = 4 * page_size
    out: list[str] = []
    sha256 = hashlib.sha256
    for start in range(0, len(buf), step):
        digest = sha256(prev + buf[start:start + step]).digest()
        out.append(digest.hex())
        prev = digest
    return out
