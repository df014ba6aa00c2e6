"""The allocator as the seed describes it: ``need_sort`` merges ``release_pages`` into the
free list before the size check (so a failed ``alloc`` still leaves the merged, sorted
order), and SGLang's names (``free_group``, ``is_not_in_free_group``, ``dtype``,
``enable_memory_saver``) read the same against ours."""
import pytest
import torch

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixkv.errors import InvalidArgumentError
from radixkv.memory import ReqToTokenPool


def test_need_sort_failed_alloc_merges_first_as_the_seed():
    """The issue's case: alloc(3), free([1]), alloc(3) -> None, then alloc(1) returns 1
    (the seed merged [1] into [4] before finding 2 < 3); before, it returned 4."""
    a = TokenToKVPoolAllocator(4, need_sort=True)
    assert a.alloc(3).tolist() == [1, 2, 3]
    a.free(torch.tensor([1]))
    assert a.release_pages.tolist() == [1] and a.free_pages.tolist() == [4]
    assert a.alloc(3) is None
    assert a.release_pages.tolist() == [] and a.free_pages.tolist() == [1, 4]  # merged, sorted
    assert a.available_size() == 2
    assert a.alloc(1).tolist() == [1]
    a.check_invariants()


def test_need_sort_off_and_paged_fail_without_change():
    a = TokenToKVPoolAllocator(4)
    a.alloc(3)
    a.free(torch.tensor([1]))
    assert a.alloc(3) is None and a.free_pages.tolist() == [4, 1]
    assert a.alloc(1).tolist() == [4]
    p = PagedTokenToKVPoolAllocator(16, 4, need_sort=True)
    p.alloc(12)
    p.free(torch.arange(4, 8))
    assert p.alloc(12) is None and p.free_pages.tolist() == [1, 4]
    assert p.alloc(4).tolist() == [4, 5, 6, 7]
    p.check_invariants()


def test_seed_names_free_group_dtype_memory_saver():
    a = TokenToKVPoolAllocator(8, dtype=torch.float16, enable_memory_saver=True)
    assert a.dtype == torch.float16 and a.enable_memory_saver
    assert a.is_not_in_free_group and a.free_group == []
    got = a.alloc(4)
    a.free_group_begin()
    a.free(got[:2])
    a.free(got[2:])
    assert not a.is_not_in_free_group
    assert [t.tolist() for t in a.free_group] == [got[:2].tolist(), got[2:].tolist()]
    a.free_group_end()
    assert a.is_not_in_free_group and a.free_group == [] and a.available_size() == 8
    assert PagedTokenToKVPoolAllocator(16, 4, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert TokenToKVPoolAllocator(4).dtype is None
    with pytest.raises(InvalidArgumentError):
        TokenToKVPoolAllocator(4, dtype="float16")
    assert ReqToTokenPool(2, 8, enable_memory_saver=True).enable_memory_saver
