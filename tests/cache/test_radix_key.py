"""RadixKey: compact int32 storage, namespaces, validation; the common-prefix helper."""
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixkv.cache.radix_key import RadixKey, as_radix_key, common_prefix_tokens
from radixkv.errors import InvalidArgumentError


@pytest.mark.parametrize("make", [
    lambda t: list(t),
    lambda t: np.asarray(t, dtype=np.int64),
    lambda t: np.asarray(t, dtype=np.int32),
    lambda t: np.asarray(t, dtype=np.uint32),
    lambda t: torch.tensor(t, dtype=torch.int64),
    lambda t: torch.tensor(t, dtype=torch.int32),
])
def test_every_container_gives_the_same_int32_key(make):
    toks = [5, 0, 70000, 2**31 - 1, 7]
    key = RadixKey(make(toks), extra_key="lora-1")
    assert key.token_ids.dtype == np.int32
    assert key.token_ids.tolist() == toks
    assert len(key) == 5
    assert key.extra_key == "lora-1"
    assert key.buffer == np.asarray(toks, dtype=np.int32).tobytes()
    assert key == RadixKey(toks, "lora-1")
    assert hash(key) == hash(RadixKey(toks, "lora-1"))


def test_key_is_a_copy_and_read_only():
    src = np.arange(6, dtype=np.int32)
    key = RadixKey(src)
    src[0] = 99
    assert key.token_ids[0] == 0
    with pytest.raises(ValueError):
        key.token_ids[0] = 5


def test_namespaces_make_keys_differ():
    assert RadixKey([1, 2]) != RadixKey([1, 2], extra_key="a")
    assert RadixKey([1, 2], "a") != RadixKey([1, 2], "b")
    assert RadixKey([1, 2], None) == RadixKey([1, 2])


@pytest.mark.parametrize("bad", [
    [1.5, 2.0],
    np.zeros((2, 3), dtype=np.int32),
    np.int32(5),
    torch.tensor([1.0, 2.0]),
    torch.tensor([True, False]),
    [2**31],
    [-(2**31) - 1],
    b"\x00\x01",
])
def test_bad_tokens_raise_invalid_argument(bad):
    with pytest.raises(InvalidArgumentError):
        RadixKey(bad)


def test_unhashable_extra_key_raises():
    with pytest.raises(InvalidArgumentError):
        RadixKey([1, 2], extra_key=["not", "hashable"])


def test_empty_keys():
    for empty in ([], np.empty(0, dtype=np.float32), torch.empty(0, dtype=torch.int64)):
        key = RadixKey(empty)
        assert len(key) == 0 and key.token_ids.dtype == np.int32


def test_slicing_indexing_and_page_alignment():
    key = RadixKey(list(range(10)), extra_key=3)
    part = key[2:7]
    assert isinstance(part, RadixKey) and part.extra_key == 3
    assert part.token_ids.tolist() == [2, 3, 4, 5, 6]
    assert key[-1] == 9 and isinstance(key[0], int)
    assert key[8:2].token_ids.tolist() == []
    with pytest.raises(InvalidArgumentError):
        key[::2]
    assert key.page_aligned(4).token_ids.tolist() == list(range(8))
    assert key.page_aligned(5) is key
    assert "len=10" in repr(key)


def test_as_radix_key():
    key = RadixKey([1, 2], "a")
    assert as_radix_key(key) is key
    assert as_radix_key(key, "a") is key
    with pytest.raises(InvalidArgumentError):
        as_radix_key(key, "b")
    assert as_radix_key([1, 2], "a") == key


def _naive_lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@given(st.lists(st.integers(0, 3), max_size=40), st.lists(st.integers(0, 3), max_size=40),
       st.integers(0, 10))
def test_common_prefix_matches_a_naive_loop(a, b, off):
    off = min(off, len(b))
    ab = np.asarray(a, dtype=np.int32).tobytes()
    bb = np.asarray(b, dtype=np.int32).tobytes()
    assert common_prefix_tokens(ab, bb, off * 4) == _naive_lcp(a, b[off:])
    end = len(b)
    for cut in (off, (off + end) // 2, end):
        assert common_prefix_tokens(ab, bb, off * 4, cut * 4) == _naive_lcp(a, b[off:cut])
