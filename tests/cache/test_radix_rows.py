"""``radixkv.cache.rows``: the value checks and row conversion of ``RadixCache.insert``
(the fast path for plain 1-D integer tensors must accept and reject exactly what the
general path does)."""
import numpy as np
import pytest
import torch

from radixkv.cache.rows import check_value, rows_bytes
from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_check_value_accepts_integer_tensors(dtype):
    v = torch.arange(5, dtype=dtype)
    assert check_value(v, 5) is v
    with pytest.raises(LengthMismatchError):
        check_value(v, 4)


@pytest.mark.parametrize("value, err", [
    (torch.zeros(3, dtype=torch.bool), InvalidArgumentError),
    (torch.zeros(3, dtype=torch.float32), InvalidArgumentError),
    (torch.zeros(3, dtype=torch.complex64), InvalidArgumentError),
    (torch.zeros((3, 1), dtype=torch.int64), InvalidArgumentError),
    (torch.zeros((), dtype=torch.int64), InvalidArgumentError),
    (torch.zeros(4, dtype=torch.int64), LengthMismatchError),
    (np.zeros(3, dtype=np.float64), InvalidArgumentError),
    (np.zeros((3, 1), dtype=np.int64), InvalidArgumentError),
    (None, InvalidArgumentError),
    (b"abc", InvalidArgumentError),
])
def test_check_value_rejects(value, err):
    with pytest.raises(err):
        check_value(value, 3)


def test_check_value_tensor_subclass_takes_general_path():
    v = torch.nn.Parameter(torch.arange(3, dtype=torch.float32), requires_grad=False)
    with pytest.raises(InvalidArgumentError):
        check_value(v, 3)
    w = torch.nn.Parameter(torch.arange(3), requires_grad=False)
    assert check_value(w, 3) is w


@pytest.mark.parametrize("make", [
    lambda a: torch.from_numpy(a.astype(np.int64)),
    lambda a: torch.from_numpy(a.astype(np.int32)),
    lambda a: a.astype(np.int64),
    lambda a: a.astype(np.int32),
    lambda a: a.astype(np.uint32),
])
def test_rows_bytes_round_trip_and_range(make):
    rng = np.random.default_rng(3)
    a = rng.integers(0, 1 << 31, 257, dtype=np.int64)
    assert np.array_equal(np.frombuffer(rows_bytes(make(a), 10), np.int32), a[10:])
    assert rows_bytes(make(a), a.size) == b""
    bad = a.copy()
    bad[200] = (1 << 31) if make(a).dtype not in (np.int32, torch.int32) else -1
    with pytest.raises(InvalidIndexError):
        rows_bytes(make(bad), 10)
    assert rows_bytes(make(bad), 201)  # the bad row is before the tail: not read


def test_rows_bytes_rejects_negative_int64():
    with pytest.raises(InvalidIndexError):
        rows_bytes(torch.tensor([1, -1, 2]), 0)
    with pytest.raises(InvalidIndexError):
        rows_bytes(torch.tensor([1, 1 << 40]), 1)
