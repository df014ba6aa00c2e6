"""FreeSlots.free_among: the host-side lookup of a few ids (used by the Mamba tree's slot
checks) agrees with ``is_free`` and with a set model, and rejects bad ids unchanged."""
import numpy as np
import pytest
import torch

from radixkv.allocator import FreeSlots
from radixkv.errors import DoubleFreeError, InvalidArgumentError, InvalidIndexError


def _state(fs):
    return fs.available(), fs._ring.live().tolist(), fs._free.clone()


def _refused_unchanged(fs, call, err):
    """``call()`` raises ``err`` and leaves the free list exactly as it was."""
    before = _state(fs)
    with pytest.raises(err):
        call()
    after = _state(fs)
    assert after[:2] == before[:2] and torch.equal(after[2], before[2])
    fs.check_invariants()


def test_free_among_basic(device):
    fs = FreeSlots(6, device)
    ids = fs.alloc(4)  # 1..4 allocated, 5 and 6 free
    assert ids.tolist() == [1, 2, 3, 4]
    assert fs.free_among([]) == []
    assert fs.free_among([2]) == []
    assert fs.free_among([5]) == [5]
    assert fs.free_among([0]) == []  # the padding id is never free
    assert fs.free_among([6, 1, 5, 0]) == [6, 5]
    assert fs.free_among([np.int64(3), np.int32(6)]) == [6]
    fs.free(torch.tensor([2], device=device))
    assert fs.free_among([1, 2, 3]) == [2]  # sees the change (a view, not a stale copy)
    fs.clear()
    assert fs.free_among([1, 2, 3, 4, 5, 6]) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("bad, err", [
    ([7], InvalidIndexError), ([-1], InvalidIndexError), ([1, 99], InvalidIndexError),
    ([True], InvalidArgumentError), ([1.0], InvalidArgumentError), ([None], InvalidArgumentError),
    (["1"], InvalidArgumentError),
])
def test_free_among_bad_ids_leave_state_unchanged(device, bad, err):
    fs = FreeSlots(6, device)
    fs.alloc(3)
    _refused_unchanged(fs, lambda: fs.free_among(bad), err)


def test_free_among_matches_model_and_is_free_seeded(device):
    rng = np.random.default_rng(7)
    size = 64
    fs = FreeSlots(size, device)
    free = set(range(1, size + 1))
    held = []
    for _ in range(300):
        if held and rng.random() < 0.45:
            k = int(rng.integers(1, len(held) + 1))
            rng.shuffle(held)
            back, held = held[:k], held[k:]
            fs.free(torch.tensor(back, device=device))
            free.update(back)
        else:
            n = int(rng.integers(0, 6))
            got = fs.alloc(n)
            if got is not None:
                ids = got.tolist()
                held.extend(ids)
                free.difference_update(ids)
        query = [int(x) for x in rng.integers(0, size + 1, int(rng.integers(1, 9)))]
        want = [i for i in query if i in free]
        assert fs.free_among(query) == want
        mask = fs.is_free(torch.tensor(query, device=device)).tolist()
        assert [i for i, f in zip(query, mask) if f] == want
    fs.check_invariants()


# ------------------------------------------------------------------ one-id alloc / free
def test_one_id_paths_match_the_general_paths(device):
    """alloc_one / free_one hand out and take back exactly what alloc(1) / free([i]) do,
    over a seeded random sequence that wraps the ring several times."""
    fast, ref = FreeSlots(9, device), FreeSlots(9, device)
    rng = np.random.default_rng(0)
    held = []
    for _ in range(400):
        if held and (rng.random() < 0.5 or fast.available() == 0):
            i = held.pop(int(rng.integers(len(held))))
            fast.free_one(i)
            ref.free(torch.tensor([i], device=device))
        else:
            got, want = fast.alloc_one(), ref.alloc(1)
            assert (got is None) == (want is None)
            if got is not None:
                assert got == int(want[0])
                held.append(got)
        assert _state(fast)[0] == _state(ref)[0] and _state(fast)[1] == _state(ref)[1]
        assert torch.equal(fast._free, ref._free)
        fast.check_invariants()
    while fast.alloc_one() is not None:
        pass
    assert fast.alloc_one() is None and fast.available() == 0


@pytest.mark.parametrize("bad, err", [
    (0, InvalidIndexError), (10, InvalidIndexError), (-1, InvalidIndexError),
    (True, InvalidArgumentError), (1.0, InvalidArgumentError), ("1", InvalidArgumentError),
    (5, DoubleFreeError),  # free, never allocated
])
def test_free_one_bad_ids_leave_state_unchanged(device, bad, err):
    fs = FreeSlots(9, device)
    fs.alloc(3)
    _refused_unchanged(fs, lambda: fs.free_one(bad), err)


def test_free_one_numpy_int_and_copy_independence():
    import copy

    fs = FreeSlots(4)
    a = fs.alloc_one()
    twin = copy.deepcopy(fs)  # the cached host views must not be shared with the copy
    fs.free_one(np.int64(a))
    assert fs.available() == 4 and twin.available() == 3
    assert not bool(twin.is_free(torch.tensor([a]))[0])
    twin.check_invariants()
    fs.check_invariants()
