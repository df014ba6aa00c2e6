"""FreeSlots: unit tests for every method and bad input, a state machine against a set
model, and a seeded stress run."""
import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixkv.allocator import FreeSlots
from radixkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    InvariantError,
)


def snapshot(fs):
    return fs.available(), fs._ring.live().tolist(), fs._free.clone()


def assert_same(fs, snap):
    avail, live, mask = snapshot(fs)
    assert (avail, live) == snap[:2]
    assert torch.equal(mask, snap[2])


def test_alloc_hands_out_ascending_ids_and_never_zero(device):
    fs = FreeSlots(8, device)
    assert fs.size == 8 and fs.device == device and fs.available() == 8
    ids = fs.alloc(3)
    assert ids.dtype == torch.int64 and ids.device.type == device.type
    assert ids.tolist() == [1, 2, 3]
    assert fs.available() == 5
    assert fs.alloc(5).tolist() == [4, 5, 6, 7, 8]
    assert fs.available() == 0
    fs.check_invariants()


def test_alloc_zero_and_too_many(device):
    fs = FreeSlots(4, device)
    assert fs.alloc(0).numel() == 0
    fs.alloc(3)
    snap = snapshot(fs)
    assert fs.alloc(2) is None
    assert_same(fs, snap)
    assert fs.alloc(1).tolist() == [4]


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_alloc_bad_count(bad):
    fs = FreeSlots(4)
    with pytest.raises(InvalidArgumentError):
        fs.alloc(bad)
    assert fs.available() == 4


def test_free_is_fifo_and_accepts_int32_and_numpy(device):
    fs = FreeSlots(6, device)
    a = fs.alloc(6)
    fs.free(a[[4, 1]].to(torch.int32))
    fs.free(np.array([3], dtype=np.int64))
    assert fs.available() == 3
    assert fs.alloc(3).tolist() == [5, 2, 3]
    fs.check_invariants()


def test_free_empty_is_noop():
    fs = FreeSlots(3)
    fs.alloc(2)
    fs.free(torch.empty(0, dtype=torch.int64))
    assert fs.available() == 1


@pytest.mark.parametrize(
    "ids, err, named",
    [
        ([0], InvalidIndexError, "[0]"),
        ([2, 9], InvalidIndexError, "[9]"),
        ([-3], InvalidIndexError, "[-3]"),
        ([2, 5], DoubleFreeError, "[5]"),  # 5 was never allocated: already free
        ([2, 3, 2], DoubleFreeError, "[2]"),  # repeated within the call
    ],
)
def test_free_bad_ids_raise_and_leave_state_unchanged(device, ids, err, named):
    fs = FreeSlots(5, device)
    fs.alloc(4)
    snap = snapshot(fs)
    with pytest.raises(err) as e:
        fs.free(torch.tensor(ids, device=device))
    assert named in str(e.value)
    assert_same(fs, snap)
    assert fs.alloc(1).tolist() == [5]
    fs.check_invariants()


def test_double_free_after_a_good_free(device):
    fs = FreeSlots(4, device)
    ids = fs.alloc(4)
    fs.free(ids[:2])
    snap = snapshot(fs)
    with pytest.raises(DoubleFreeError, match=r"\[2\]"):
        fs.free(torch.tensor([3, 2], device=device))
    assert_same(fs, snap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_free_wrong_dtype(dtype):
    fs = FreeSlots(4)
    fs.alloc(2)
    with pytest.raises(InvalidArgumentError, match="integer dtype"):
        fs.free(torch.tensor([1, 0], dtype=dtype))
    with pytest.raises(InvalidArgumentError):
        fs.free([1, 2])  # Python lists are not accepted on the hot path
    assert fs.available() == 2


def test_is_free(device):
    fs = FreeSlots(4, device)
    fs.alloc(2)
    got = fs.is_free(torch.tensor([0, 1, 2, 3, 4], device=device))
    assert got.dtype == torch.bool
    assert got.tolist() == [False, False, False, True, True]
    with pytest.raises(InvalidIndexError):
        fs.is_free(torch.tensor([5]))


def test_clear(device):
    fs = FreeSlots(5, device)
    a = fs.alloc(5)
    fs.free(a[[3, 1]])
    fs.clear()
    assert fs.available() == 5
    assert fs.alloc(5).tolist() == [1, 2, 3, 4, 5]
    fs.check_invariants()


def test_size_zero_and_bad_size():
    fs = FreeSlots(0)
    assert fs.available() == 0 and fs.alloc(1) is None and fs.alloc(0).numel() == 0
    fs.check_invariants()
    with pytest.raises(InvalidArgumentError):
        FreeSlots(-1)


def test_checks_false_skips_validation_but_works():
    fs = FreeSlots(4, checks=False)
    a = fs.alloc(4)
    fs.free(a)
    assert fs.available() == 4
    fs.check_invariants()


def test_ring_wraps_around():
    fs = FreeSlots(5)
    for _step in range(12):
        ids = fs.alloc(3)
        fs.free(ids.flip(0))
        fs.check_invariants()
    assert fs.available() == 5


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda fs: fs._free.__setitem__(2, True), "leaked"),
        (lambda fs: fs._free.__setitem__(5, False), "marked in use"),
        (lambda fs: fs._ring.buf.__setitem__(0, 5), "held twice"),
        (lambda fs: fs._free.__setitem__(0, True), "reserved"),
    ],
)
def test_check_invariants_detects_corruption(corrupt, message):
    fs = FreeSlots(5)
    fs.alloc(2)
    fs.free(torch.tensor([1]))  # ring: 3 4 5 1 at buf[2:5] + buf[0]
    corrupt(fs)
    with pytest.raises(InvariantError, match=message):
        fs.check_invariants()


def test_check_invariants_names_the_leaked_id():
    fs = FreeSlots(6)
    fs.alloc(3)
    fs._free[2] = True
    with pytest.raises(InvariantError, match=r"\[2\]"):
        fs.check_invariants()


def test_seeded_stress():
    rng = np.random.default_rng(1234)
    fs = FreeSlots(500)
    model_free = set(range(1, 501))
    held = []
    for _ in range(400):
        if held and rng.random() < 0.45:
            k = int(rng.integers(1, len(held) + 1))
            pick = rng.choice(len(held), size=k, replace=False)
            ids = [held[i] for i in pick]
            held = [h for i, h in enumerate(held) if i not in set(pick.tolist())]
            fs.free(torch.tensor(ids, dtype=torch.int32))
            model_free.update(ids)
        else:
            n = int(rng.integers(0, 60))
            got = fs.alloc(n)
            if n > len(model_free):
                assert got is None
            else:
                got = got.tolist()
                assert len(set(got)) == n and set(got) <= model_free
                model_free.difference_update(got)
                held.extend(got)
        assert fs.available() == len(model_free)
    fs.check_invariants()
    assert set(torch.nonzero(fs._free).reshape(-1).tolist()) == model_free


class FreeSlotsMachine(RuleBasedStateMachine):
    """FreeSlots against a plain set of free ids."""

    def __init__(self):
        super().__init__()
        self.size = 12
        self.fs = FreeSlots(self.size)
        self.free = set(range(1, self.size + 1))

    @rule(n=st.integers(0, 14))
    def alloc(self, n):
        got = self.fs.alloc(n)
        if n > len(self.free):
            assert got is None
            return
        got = got.tolist()
        assert len(set(got)) == n and set(got) <= self.free and 0 not in got
        self.free.difference_update(got)

    @precondition(lambda self: len(self.free) < self.size)
    @rule(data=st.data())
    def free_some(self, data):
        used = sorted(set(range(1, self.size + 1)) - self.free)
        ids = data.draw(st.lists(st.sampled_from(used), min_size=1, max_size=len(used), unique=True))
        self.fs.free(torch.tensor(ids, dtype=data.draw(st.sampled_from([torch.int32, torch.int64]))))
        self.free.update(ids)

    @rule(data=st.data())
    def bad_free(self, data):
        bad = data.draw(
            st.one_of(
                st.just([0]),
                st.integers(self.size + 1, self.size + 5).map(lambda i: [i]),
                st.sampled_from(sorted(self.free) or [0]).map(lambda i: [i]),
            )
        )
        before = (self.fs.available(), self.fs._ring.live().tolist())
        with pytest.raises((InvalidIndexError, DoubleFreeError)):
            self.fs.free(torch.tensor(bad))
        assert (self.fs.available(), self.fs._ring.live().tolist()) == before

    @rule()
    def clear(self):
        self.fs.clear()
        self.free = set(range(1, self.size + 1))

    @invariant()
    def consistent(self):
        self.fs.check_invariants()
        assert self.fs.available() == len(self.free)
        mask = self.fs.is_free(torch.arange(0, self.size + 1))
        assert set(torch.nonzero(mask).reshape(-1).tolist()) == self.free


TestFreeSlotsMachine = FreeSlotsMachine.TestCase
