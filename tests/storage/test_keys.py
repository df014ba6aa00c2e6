"""Storage page keys: SGLang's chained SHA-256, seeded by namespace and layout."""
import hashlib

import numpy as np
import pytest

from radixkv.errors import AlignmentError, InvalidArgumentError
from radixkv.storage.keys import layout_fingerprint, page_keys, storage_seed


def _sglang_get_hash_str(token_ids: list[int], prior_hash: str | None = None) -> str:
    """SGLang's ``get_hash_str`` as its HiCache storage computes it (re-typed here)."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def test_chain_equals_sglang_with_the_seed_as_first_prior():
    seed = storage_seed(b"\x00", layout_fingerprint(kind="mha", layers=2))
    tokens = np.arange(12, dtype=np.int32)
    keys = page_keys(tokens, 4, seed)
    prior = seed.hex()
    for i, key in enumerate(keys):
        prior = _sglang_get_hash_str(tokens[4 * i:4 * i + 4].tolist(), prior)
        assert key == prior


def test_chain_resumes_from_prior_and_namespace_layout_separate():
    fp = layout_fingerprint(kind="mha", layers=2, dtype="float16")
    seed = storage_seed(b"\x00", fp)
    tokens = np.arange(16, dtype=np.int32)
    whole = page_keys(tokens, 4, seed)
    assert page_keys(tokens[8:], 4, seed, prior=whole[1]) == whole[2:]
    other_ns = page_keys(tokens, 4, storage_seed(b"\x01\x01\x00\x00\x00a", fp))
    other_layout = page_keys(tokens, 4, storage_seed(b"\x00", layout_fingerprint(kind="mha", layers=3,
                                                                                   dtype="float16")))
    assert not set(whole) & set(other_ns) and not set(whole) & set(other_layout)
    assert layout_fingerprint(a=1, b=2) == layout_fingerprint(b=2, a=1)


def test_bad_input_raises():
    seed = storage_seed(b"\x00", layout_fingerprint(kind="mha"))
    with pytest.raises(AlignmentError):
        page_keys(np.arange(5, dtype=np.int32), 4, seed)
    with pytest.raises(InvalidArgumentError):
        page_keys(np.arange(4, dtype=np.int64), 4, seed)
    with pytest.raises(InvalidArgumentError):
        page_keys(np.arange(4, dtype=np.int32), 0, seed)
    with pytest.raises(InvalidArgumentError):
        layout_fingerprint()
