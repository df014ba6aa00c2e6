"""The host tier's page free list: all-or-nothing allocs, double frees named, and an audit
that names leaked and double-owned pages."""
import numpy as np
import pytest

from radixkv.allocator.host_pages import HostPageAllocator
from radixkv.errors import InvalidArgumentError, InvalidIndexError, InvariantError


def test_alloc_free_and_all_or_nothing():
    a = HostPageAllocator(4)
    got = a.alloc(3)
    assert got.tolist() == [1, 2, 3] and a.available_size() == 1
    assert a.alloc(2) is None and a.available_size() == 1
    a.free(got[:2])
    assert sorted(a.alloc(3).tolist()) == [1, 2, 4]
    a.check_invariants(np.array([1, 2, 3, 4]))


def test_double_and_foreign_frees_raise_and_change_nothing():
    a = HostPageAllocator(4)
    got = a.alloc(2)
    a.free(got[:1])
    with pytest.raises(InvalidArgumentError, match=r"\[1\]"):
        a.free(got)
    with pytest.raises(InvalidIndexError):
        a.free(np.array([9]))
    with pytest.raises(InvalidArgumentError):
        a.free(np.array([2, 2]))
    assert a.available_size() == 3
    a.check_invariants(np.array([2]))


def test_audit_names_leaked_and_double_owned_pages():
    a = HostPageAllocator(4)
    a.alloc(3)
    with pytest.raises(InvariantError, match=r"\[3\] leaked"):
        a.check_invariants(np.array([1, 2]))
    with pytest.raises(InvariantError, match=r"\[2\] owned twice"):
        a.check_invariants(np.array([1, 2, 2, 3]))
    with pytest.raises(InvariantError, match=r"\[4\] owned by a node but free"):
        a.check_invariants(np.array([1, 2, 3, 4]))
    with pytest.raises(InvariantError, match=r"\[0, 5\] owned by a node but out of range"):
        a.check_invariants(np.array([0, 1, 2, 3, 5]))
