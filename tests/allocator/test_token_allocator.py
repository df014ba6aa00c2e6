"""TokenToKVPoolAllocator: unit tests for every method and bad input, a state machine
against a plain-list model of SGLang's allocator, and a seeded stress run."""
import numpy as np
import pytest
import torch
from allocator_model import FreeListModel, FreeListRules, assert_unchanged, state_of
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixkv.allocator import (
    AllocatorStats,
    FreeGroupError,
    StaleBackupError,
    TokenToKVPoolAllocator,
)
from radixkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    InvariantError,
    StaleSessionError,
)


def t(ids, device="cpu", dtype=torch.int64):
    return torch.tensor(ids, dtype=dtype, device=device)


# ------------------------------------------------------------------------------- units
def test_construction_and_attributes(device):
    kv = object()
    a = TokenToKVPoolAllocator(16, device, kvcache=kv)
    assert a.size == 16 and a.page_size == 1 and a.device == device
    assert a.get_kvcache() is kv and a.available_size() == 16
    assert a.stats() == AllocatorStats(16, 1, 16, 16, 16, 0, 0, 0)
    assert a.debug_state() == a.stats()
    a.check_invariants()
    with pytest.raises(InvalidArgumentError):
        TokenToKVPoolAllocator(-4)


def test_alloc_and_free_fifo(device):
    a = TokenToKVPoolAllocator(8, device)
    x = a.alloc(5)
    assert x.dtype == torch.int64 and x.device.type == device.type
    assert x.tolist() == [1, 2, 3, 4, 5]
    a.free(x[[3, 0]].to(torch.int32))
    assert a.available_size() == 5
    assert a.alloc(5).tolist() == [6, 7, 8, 4, 1]
    assert a.available_size() == 0
    a.check_invariants()


def test_alloc_too_many_returns_none_unchanged(device):
    for need_sort in (False, True):
        a = TokenToKVPoolAllocator(6, device, need_sort=need_sort)
        x = a.alloc(5)
        a.free(x[:2])
        before = state_of(a)
        assert a.alloc(4) is None  # 1 free + 2 pending
        if not need_sort:
            assert_unchanged(a, before)
        else:  # the seed merges release_pages before the size check: same ids, merged order
            assert a.release_pages.tolist() == [] and a.free_pages.tolist() == sorted(before[1] + before[2])
            assert a.available_size() == before[0].available_size


@pytest.mark.parametrize("bad", [-1, 2.0, None])
def test_alloc_bad_size(bad):
    a = TokenToKVPoolAllocator(4)
    with pytest.raises(InvalidArgumentError):
        a.alloc(bad)
    assert a.available_size() == 4


def test_need_sort_defers_and_sorts(device):
    a = TokenToKVPoolAllocator(8, device, need_sort=True)
    x = a.alloc(6)
    a.free(x[[5, 1, 3]])
    assert a.release_pages.tolist() == [6, 2, 4]
    assert a.free_pages.tolist() == [7, 8]
    assert a.available_size() == 5
    assert a.alloc(2).tolist() == [7, 8]  # enough in free_pages: no merge
    assert a.release_pages.tolist() == [6, 2, 4]
    assert a.alloc(2).tolist() == [2, 4]  # falls short: merge, sort
    assert a.release_pages.numel() == 0 and a.free_pages.tolist() == [6]
    a.check_invariants()


def test_merge_and_sort_free_explicit(device):
    a = TokenToKVPoolAllocator(5, device, need_sort=True)
    x = a.alloc(5)
    a.free(x[[4, 0, 2]])
    a.merge_and_sort_free()
    assert a.free_pages.tolist() == [1, 3, 5] and a.release_pages.numel() == 0
    a.merge_and_sort_free()  # nothing pending: no-op
    assert a.free_pages.tolist() == [1, 3, 5]
    a.check_invariants()


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize(
    "ids, err, named",
    [
        ([0], InvalidIndexError, "[0]"),
        ([3, 11], InvalidIndexError, "[11]"),
        ([3, -1], InvalidIndexError, "[-1]"),
        ([3, 9], DoubleFreeError, "[9]"),  # never allocated
        ([3, 1], DoubleFreeError, "[1]"),  # freed before (free list or release_pages)
        ([3, 4, 3], DoubleFreeError, "[3]"),  # repeated in the call
        # runs of consecutive ids (the per-run checks of free_runs, then the exact path)
        ([4, 5, 6, 7, 8], DoubleFreeError, "7"),  # a run reaching into free ids
        ([5, 6, 3, 4, 5], DoubleFreeError, "[5]"),  # two overlapping runs
        ([0, 1, 2, 3], InvalidIndexError, "[0]"),
        ([3, 4, 5, 6, 7, 8, 9, 10, 11], InvalidIndexError, "[11]"),
    ],
)
def test_free_bad_indices_leave_state_unchanged(device, need_sort, ids, err, named):
    a = TokenToKVPoolAllocator(10, device, need_sort=need_sort)
    a.alloc(6)
    a.free(t([1, 2], device))
    before = state_of(a)
    with pytest.raises(err) as e:
        a.free(t(ids, device))
    assert named in str(e.value)
    assert_unchanged(a, before)
    a.check_invariants()
    nxt = a.alloc(4)
    ref = TokenToKVPoolAllocator(10, device, need_sort=need_sort)
    ref.alloc(6)
    ref.free(t([1, 2], device))
    assert nxt.tolist() == ref.alloc(4).tolist()


def test_free_wrong_dtype():
    a = TokenToKVPoolAllocator(4)
    a.alloc(4)
    before = state_of(a)
    for bad in (torch.tensor([1.0]), torch.tensor([True]), [1, 2], "1"):
        with pytest.raises(InvalidArgumentError):
            a.free(bad)
    assert_unchanged(a, before)


def test_free_numpy_and_empty():
    a = TokenToKVPoolAllocator(4)
    a.alloc(3)
    a.free(np.array([2, 1], dtype=np.int32))
    a.free(torch.empty(0, dtype=torch.int64))
    assert a.available_size() == 3
    a.check_invariants()


@pytest.mark.parametrize("need_sort", [False, True])
def test_free_group_batches_and_detects_double_free(device, need_sort):
    a = TokenToKVPoolAllocator(8, device, need_sort=need_sort)
    x = a.alloc(8)
    a.free_group_begin()
    a.free(x[[2, 5]])
    a.free(x[[0]])
    assert a.available_size() == 0 and a.stats().group_pages == 3
    a.check_invariants()
    before = state_of(a)
    with pytest.raises(DoubleFreeError, match=r"\[3\]"):
        a.free(x[[7, 2]])  # slot 3 is pending in the open group
    assert_unchanged(a, before)
    assert a.alloc(1) is None
    a.free_group_end()
    assert a.available_size() == 3 and a.stats().group_pages == 0
    where = a.release_pages if need_sort else a.free_pages
    assert where.tolist() == [3, 6, 1]
    a.check_invariants()


def test_free_group_misuse():
    a = TokenToKVPoolAllocator(4)
    with pytest.raises(FreeGroupError):
        a.free_group_end()
    a.free_group_begin()
    with pytest.raises(FreeGroupError):
        a.free_group_begin()
    with pytest.raises(FreeGroupError):
        a.backup_state()
    a.free_group_end()
    s = a.backup_state()
    a.free_group_begin()
    with pytest.raises(FreeGroupError):
        a.restore_state(s)
    a.free_group_end()  # empty group: nothing released
    assert a.available_size() == 4


def test_empty_group_end_is_noop():
    a = TokenToKVPoolAllocator(4)
    a.alloc(2)
    a.free_group_begin()
    a.free_group_end()
    assert a.available_size() == 2


@pytest.mark.parametrize("need_sort", [False, True])
def test_backup_alloc_restore_is_exact(device, need_sort):
    a = TokenToKVPoolAllocator(12, device, need_sort=need_sort)
    x = a.alloc(9)
    a.free(x[[6, 1, 4]])
    before = state_of(a)
    s = a.backup_state()
    d = a.alloc(5)  # need_sort: merges the release list
    a.free(d[:2])
    a.free(x[[0]])
    a.alloc(1)
    a.restore_state(s)
    assert_unchanged(a, before)
    a.check_invariants()
    a.restore_state(s)  # the same backup twice
    assert_unchanged(a, before)


def test_restore_after_a_merge_and_rejects_once_overwritten():
    a = TokenToKVPoolAllocator(6, need_sort=True)
    x = a.alloc(4)
    a.free(x[[1, 3]])
    before = state_of(a)
    s = a.backup_state()
    y = a.alloc(3)  # merges: writes the sorted list after the ring tail
    a.free(y)
    a.restore_state(s)  # guaranteed: one merge writes at most num_pages entries
    assert_unchanged(a, before)
    a.check_invariants()
    for _ in range(3):  # each merge writes 4 more entries: the 12-entry ring wraps
        y = a.alloc(4)
        a.free(y)
    before = state_of(a)
    with pytest.raises(StaleBackupError, match="overwritten"):
        a.restore_state(s)
    assert_unchanged(a, before)
    a.check_invariants()


def test_stale_backups_are_rejected_unchanged():
    a = TokenToKVPoolAllocator(4)
    s0 = a.backup_state()
    a.clear()
    with pytest.raises(StaleBackupError):
        a.restore_state(s0)
    assert issubclass(StaleBackupError, StaleSessionError)
    a.alloc(2)
    s1 = a.backup_state()
    a.alloc(1)
    s2 = a.backup_state()
    a.restore_state(s1)  # s2 is now a discarded future
    before = state_of(a)
    with pytest.raises(StaleBackupError, match="rolled-back"):
        a.restore_state(s2)
    assert_unchanged(a, before)
    # overwritten: more than num_pages frees after the backup
    a = TokenToKVPoolAllocator(4)
    a.alloc(4)
    s = a.backup_state()
    for _ in range(3):
        a.free(t([1, 2, 3, 4]))
        a.alloc(4)
    before = state_of(a)
    with pytest.raises(StaleBackupError, match="overwritten"):
        a.restore_state(s)
    assert_unchanged(a, before)
    with pytest.raises(InvalidArgumentError):
        a.restore_state((1, 2, 3))
    with pytest.raises(InvalidArgumentError):
        a.restore_state(TokenToKVPoolAllocator(4).backup_state())


def test_older_backup_in_lineage_still_restores():
    a = TokenToKVPoolAllocator(8)
    s_a = a.backup_state()
    st_a = state_of(a)
    a.alloc(3)
    s_b = a.backup_state()
    st_b = state_of(a)
    a.alloc(2)
    a.restore_state(s_b)
    assert_unchanged(a, st_b)
    a.restore_state(s_a)
    assert_unchanged(a, st_a)


def test_is_free(device):
    a = TokenToKVPoolAllocator(4, device, need_sort=True)
    x = a.alloc(3)
    a.free(x[:1])
    assert a.is_free(t([0, 1, 2, 4], device)).tolist() == [False, True, False, True]
    with pytest.raises(InvalidIndexError):
        a.is_free(t([5], device))


def test_clear(device):
    a = TokenToKVPoolAllocator(5, device, need_sort=True)
    x = a.alloc(5)
    a.free(x[[3]])
    a.free_group_begin()
    a.free(x[[1]])
    a.clear()
    assert a.available_size() == 5 and a.stats().group_pages == 0
    assert a.alloc(5).tolist() == [1, 2, 3, 4, 5]
    a.check_invariants()


def test_checks_false_still_correct_on_good_input():
    a = TokenToKVPoolAllocator(6, need_sort=True, checks=False)
    x = a.alloc(6)
    a.free(x)
    assert a.alloc(6).tolist() == [1, 2, 3, 4, 5, 6]
    a.check_invariants()


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda a: a._fl._not_in_use.__setitem__(2, True), "leaked"),
        (lambda a: a._fl._not_in_use.__setitem__(6, False), "marked in use"),
        (lambda a: a._fl._rel.push(t([5])), "held twice"),
        (lambda a: a._fl._ring.push(t([9])), "out of range"),
    ],
)
def test_check_invariants_names_the_ids(corrupt, message):
    a = TokenToKVPoolAllocator(8, need_sort=True)
    x = a.alloc(4)
    a.free(x[:1])
    corrupt(a)
    with pytest.raises(InvariantError, match=message):
        a.check_invariants()


def test_seeded_stress_need_sort():
    rng = np.random.default_rng(7)
    a = TokenToKVPoolAllocator(300, need_sort=True)
    free = set(range(1, 301))
    held = []
    for step in range(300):
        if held and rng.random() < 0.5:
            k = int(rng.integers(1, len(held) + 1))
            idx = rng.permutation(len(held))
            ids, held = [held[i] for i in idx[:k]], [held[i] for i in idx[k:]]
            a.free(t(ids, dtype=torch.int32))
            free.update(ids)
        else:
            n = int(rng.integers(1, 50))
            got = a.alloc(n)
            if n > len(free):
                assert got is None
            else:
                got = got.tolist()
                assert set(got) <= free and len(set(got)) == n
                free.difference_update(got)
                held += got
        assert a.available_size() == len(free)
        if step % 50 == 0:
            a.check_invariants()
    a.check_invariants()


# ----------------------------------------------------------------------- state machine
class TokenAllocatorMachine(FreeListRules, RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.size = 8

    @initialize(need_sort=st.booleans())
    def create(self, need_sort):
        self.a = TokenToKVPoolAllocator(self.size, need_sort=need_sort)
        self.m = FreeListModel(self.size, need_sort)
        self.backups = []
        self.stale = []

    @rule(n=st.integers(0, 10))
    def alloc(self, n):
        got = self.a.alloc(n)
        want = self.m.alloc(n)
        assert (None if got is None else got.tolist()) == want

    @precondition(lambda self: self.m.in_use())
    @rule(data=st.data())
    def free(self, data):
        used = sorted(self.m.in_use())
        ids = data.draw(st.lists(st.sampled_from(used), min_size=1, max_size=6, unique=True))
        self.a.free(torch.tensor(ids, dtype=data.draw(st.sampled_from([torch.int32, torch.int64]))))
        self.m.free(ids)

    @precondition(lambda self: self.m.group is None and self.m.in_use())
    @rule(times=st.integers(1, 4))
    def churn(self, times):
        """Free everything in use and take it back, a few times (wraps the rings)."""
        for _ in range(times):
            ids = sorted(self.m.in_use())
            self.a.free(torch.tensor(ids))
            self.m.free(ids)
            got = self.a.alloc(len(ids))
            assert got.tolist() == self.m.alloc(len(ids))

    @rule(data=st.data())
    def bad_free(self, data):
        not_used = sorted(set(range(1, self.size + 1)) - self.m.in_use())
        choices = [st.just([0]), st.just([self.size + 1])]
        if not_used:
            choices.append(st.sampled_from(not_used).map(lambda i: [i]))
        used = sorted(self.m.in_use())
        if used:
            choices.append(st.sampled_from(used).map(lambda i: [i, i]))
        ids = data.draw(st.one_of(*choices))
        before = state_of(self.a)
        with pytest.raises((InvalidIndexError, DoubleFreeError)):
            self.a.free(torch.tensor(ids))
        assert_unchanged(self.a, before)

    @precondition(lambda self: self.m.need_sort)
    @rule()
    def merge(self):
        self.a.merge_and_sort_free()
        self.m.merge()

    @rule()
    def clear(self):
        self.a.clear()
        self._cleared(FreeListModel(self.size, self.m.need_sort))

    @invariant()
    def matches_model(self):
        self.a.check_invariants()
        assert self.a.available_size() == self.m.available()
        assert self.a.free_pages.tolist() == self.m.free_pages
        assert self.a.release_pages.tolist() == self.m.release
        assert self.a.stats().group_pages == len(self.m.group or [])
        mask = self.a.is_free(torch.arange(0, self.size + 1))
        assert set(torch.nonzero(~mask).reshape(-1).tolist()) - {0} == self.m.in_use()


TestTokenAllocatorMachine = TokenAllocatorMachine.TestCase

# More examples than the profile's default: these machines are cheap and the bugs they
# catch (backup lineage, merges) need longer runs. Inherits the loaded profile otherwise.
TestTokenAllocatorMachine.settings = settings(max_examples=150)


def test_large_batches_free_and_merge():
    """Batches above the numpy-sort threshold: duplicate detection and the merge."""
    from radixkv.validation import _NUMPY_SORT_MIN, sort_ids

    n = 4 * _NUMPY_SORT_MIN
    x = torch.randperm(n)[: n // 2]
    assert torch.equal(sort_ids(x), x.sort().values)
    a = TokenToKVPoolAllocator(n, need_sort=True)
    held = a.alloc(n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3))
    bad = held[perm[: n // 2]].clone()
    bad[-1] = bad[7]  # one repeat among n/2 ids
    before = state_of(a)
    with pytest.raises(DoubleFreeError, match=rf"\[{int(bad[7])}\]"):
        a.free(bad)
    assert_unchanged(a, before)
    a.free(held[perm[: n // 2]])
    got = a.alloc(n // 2)  # merges the release list: ascending
    assert torch.equal(got, held[perm[: n // 2]].sort().values)
    a.check_invariants()
