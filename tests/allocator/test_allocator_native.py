"""The KV allocators' compiled free (``radixkv.allocator.native.mark_free``) against their
numpy path: the same seeded frees, good and bad (out of range, double frees, repeats, pages
split over runs, unordered runs, free groups, backups), on two allocators, one with the
compiled free and one without; every result, error message and state must match."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from allocator_model import state_of

from radixkv.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator, native
from radixkv.allocator.page_free_list import PageFreeList
from radixkv.errors import RadixKVError

pytestmark = pytest.mark.skipif(native.mark_free is None, reason=f"not built: {native.unavailable_reason}")


class _NoNative(PageFreeList):
    """The numpy path: ``free_host`` declines every free."""

    def free_host(self, ids, shift=0, ascending=False):
        return False


class _Counting(PageFreeList):
    """The compiled path, counting the frees it took."""

    taken = 0

    def free_host(self, ids, shift=0, ascending=False):
        took = super().free_host(ids, shift, ascending)
        type(self).taken += took
        return took


def _pair(page_size, size, need_sort, paged):
    def make():
        if not paged:
            return TokenToKVPoolAllocator(size, need_sort=need_sort)
        return PagedTokenToKVPoolAllocator(size, page_size, need_sort=need_sort)
    ref = make()
    ref._fl.__class__ = _NoNative
    a = make()
    a._fl.__class__ = _Counting
    return a, ref


def _same_state(a, b):
    sa, sb = state_of(a), state_of(b)
    assert sa[:3] == sb[:3]
    assert torch.equal(sa[3], sb[3])


def _call(alloc, fn, *args):
    try:
        return ("ok", fn(alloc, *args))
    except RadixKVError as e:
        return (type(e).__name__, str(e))


def _free(alloc, ids):
    alloc.free(ids)


def _bad_variant(rng, ids, used, page_size, size):
    """``ids`` made bad (or odd but valid) one way, chosen by ``rng``."""
    kind = rng.integers(7)
    if kind == 0 and ids.size:  # a repeat
        return np.insert(ids, rng.integers(ids.size + 1), ids[rng.integers(ids.size)])
    if kind == 1:  # out of range
        return np.append(ids, rng.choice([0, -3, size + page_size, 10 * size]))
    if kind == 2 and used.size < size:  # a slot of a free page
        free = np.setdiff1d(np.arange(page_size, size + page_size), used)
        return np.append(ids, rng.choice(free))
    if kind == 3 and ids.size > 1:  # reordered (runs broken, pages split over runs)
        return rng.permutation(ids)
    if kind == 4 and ids.size > 1:  # reversed
        return ids[::-1].copy()
    return ids


@pytest.mark.parametrize("page_size,paged", [(1, False), (1, True), (4, True), (16, True)])
@pytest.mark.parametrize("need_sort", [False, True])
def test_compiled_free_matches_the_numpy_path(page_size, paged, need_sort):
    rng = np.random.default_rng(page_size * 10 + need_sort + 100 * paged)
    size = 64 * page_size
    a, ref = _pair(page_size, size, need_sort, paged)
    held: list[np.ndarray] = []  # slot id arrays allocated and not yet freed
    _Counting.taken = 0
    for step in range(600):
        op = rng.integers(10)
        if op < 4 or not held:
            n = int(rng.integers(1, 5 * page_size))
            if page_size > 1:
                n = -(-n // page_size) * page_size
            x, y = a.alloc(n), ref.alloc(n)
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.equal(x, y)
                held.append(x.numpy().copy())
        elif op < 9:
            # free some held allocations, whole or in part, maybe several joined, maybe bad
            take = [held.pop(int(rng.integers(len(held)))) for _ in range(min(len(held), int(rng.integers(1, 4))))]
            ids = np.concatenate(take)
            used = np.concatenate(held + [ids]) if held or ids.size else ids
            bad = _bad_variant(rng, ids, used, page_size, size) if rng.random() < 0.4 else ids
            dtype = rng.choice([np.int64, np.int32])
            before = state_of(a)
            ra = _call(a, _free, torch.from_numpy(bad.astype(dtype)))
            rb = _call(ref, _free, torch.from_numpy(bad.astype(dtype)))
            assert ra == rb, (step, bad)
            if ra[0] != "ok":
                sa = state_of(a)
                assert sa[:3] == before[:3] and torch.equal(sa[3], before[3])
                held.append(ids)  # nothing was freed
        else:
            kind = rng.integers(3)
            if kind == 0:
                a.free_group_begin(), ref.free_group_begin()
                for _ in range(min(len(held), 2)):
                    ids = torch.from_numpy(held.pop())
                    assert _call(a, _free, ids) == _call(ref, _free, ids)
                a.free_group_end(), ref.free_group_end()
            elif kind == 1:
                sa, sb = a.backup_state(), ref.backup_state()
                x, y = a.alloc(page_size), ref.alloc(page_size)
                if x is not None:
                    a.free(x), ref.free(y)
                a.restore_state(sa), ref.restore_state(sb)
            else:
                a.merge_and_sort_free(), ref.merge_and_sort_free()
        _same_state(a, ref)
        a.check_invariants()
    assert _Counting.taken > 30  # the compiled free did take most of the good frees


def test_mark_free_declines_other_buffers_and_changes_nothing():
    mask = np.zeros(9, dtype=bool)
    ring = np.zeros(8, dtype=np.int32)
    ids = np.array([3, 4, 5], dtype=np.int64)
    assert native.mark_free(ids.astype(np.int32), mask, ring, 0, 0, 8, False) == -1  # int32 ids
    assert native.mark_free(ids[::2], mask, ring, 0, 0, 8, False) == -1  # not contiguous
    assert native.mark_free(ids, mask.astype(np.int32), ring, 0, 0, 8, False) == -1
    assert native.mark_free(ids, mask, ring.astype(np.int64), 0, 0, 8, False) == -1
    assert native.mark_free(np.array([3, 9, 4]), mask, ring, 0, 0, 8, False) == -1  # 9 > num_ids
    assert native.mark_free(np.array([3, 4, 3]), mask, ring, 0, 0, 8, False) == -1  # a repeat
    assert not mask.any() and not ring.any()
    assert native.mark_free(np.array([5, 3, 4]), mask, ring, 6, 0, 8, False) == 3  # wraps
    assert ring.tolist() == [4, 0, 0, 0, 0, 0, 5, 3] and mask.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0]
    ring[:], mask[:] = 0, False
    # pages of 4 slots (shift 2), pushed ascending: slots 20-23 (page 5), 8-9 (page 2)
    assert native.mark_free(np.array([20, 21, 22, 23, 8, 9]), mask, ring, 0, 2, 8, True) == 2
    assert ring[:2].tolist() == [2, 5]
    assert native.mark_free(np.array([27, 26]), mask, ring, 2, 2, 8, True) == -1  # unordered in a page
    assert mask.tolist() == [0, 0, 1, 0, 0, 1, 0, 0, 0]


def test_pure_python_mode_turns_it_off():
    env = dict(os.environ, RADIXKV_PURE_PYTHON="1")
    script = ("from radixkv.allocator import native; "
              "assert native.mark_free is None and native.unavailable_reason == 'RADIXKV_PURE_PYTHON is set'; "
              "print('ok')")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
