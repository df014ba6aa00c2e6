"""ReqToTokenPool: rows for requests, the int32 table, validation leaving state unchanged."""
import numpy as np
import pytest
import torch

from radixkv.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    InvariantError,
    LengthMismatchError,
)
from radixkv.memory import ReqToTokenPool
from radixkv.scheduler.req import Req


def reqs(n, start=0):
    return [Req(f"r{start + i}", np.arange(3, dtype=np.int32)) for i in range(n)]


def snapshot(pool, rs=()):
    ids = torch.arange(0, pool.size + 1)
    return (pool.available_size(), pool.free_slots.is_free(ids).clone(), pool.arena.buffer.clone(),
            [r.req_pool_idx for r in rs])


def assert_unchanged(pool, snap, rs=()):
    now = snapshot(pool, rs)
    assert now[0] == snap[0]
    assert torch.equal(now[1], snap[1])
    assert torch.equal(now[2], snap[2])
    assert now[3] == snap[3]
    pool.check_invariants()


def test_table_shape_dtype_device(device):
    pool = ReqToTokenPool(5, 16, device)
    assert pool.req_to_token.shape == (6, 16)
    assert pool.req_to_token.dtype == torch.int32
    assert pool.req_to_token.device.type == device.type
    assert int(pool.req_to_token.count_nonzero()) == 0
    assert pool.available_size() == 5
    assert pool.req_to_token.data_ptr() == pool.arena.buffer.data_ptr()
    pool.check_invariants()


def test_alloc_gives_distinct_rows_and_keeps_held_rows(device):
    pool = ReqToTokenPool(4, 8, device)
    a = reqs(2)
    rows = pool.alloc(a)
    assert sorted(rows) == sorted({r.req_pool_idx for r in a}) and len(set(rows)) == 2
    assert all(1 <= r <= 4 for r in rows) and pool.available_size() == 2
    # chunked prefill: a request with a row keeps it; only the new one takes a row
    b = reqs(1, start=10)
    rows2 = pool.alloc([a[1], b[0], a[0]])
    assert rows2[0] == rows[1] and rows2[2] == rows[0]
    assert rows2[1] not in rows and pool.available_size() == 1
    assert pool.alloc([]) == []
    pool.check_invariants()


def test_alloc_is_all_or_nothing(device):
    pool = ReqToTokenPool(3, 8, device)
    held = reqs(2)
    pool.alloc(held)
    new = reqs(2, start=5)
    snap = snapshot(pool, held + new)
    assert pool.alloc(new + held) is None  # 2 new, 1 free row
    assert_unchanged(pool, snap, held + new)
    assert pool.alloc(new[:1] + held) is not None
    assert pool.available_size() == 0
    assert pool.alloc(reqs(1, start=9)) is None


def test_alloc_rejects_bad_requests_unchanged(device):
    pool = ReqToTokenPool(4, 8, device)
    a = reqs(2)
    pool.alloc(a)
    fresh = reqs(1, start=7)[0]
    snap = snapshot(pool, a + [fresh])
    with pytest.raises(InvalidArgumentError, match="twice"):
        pool.alloc([fresh, fresh])
    claim = Req("claim", np.arange(2, dtype=np.int32), req_pool_idx=a[0].req_pool_idx)
    with pytest.raises(InvalidArgumentError, match="same row"):
        pool.alloc([a[0], claim, fresh])
    stale = Req("stale", np.arange(2, dtype=np.int32), req_pool_idx=4)  # row 4 is free
    with pytest.raises(InvalidArgumentError, match="free"):
        pool.alloc([fresh, stale])
    for bad in (0, 5, -1):
        with pytest.raises(InvalidIndexError):
            pool.alloc([fresh, Req("oob", np.arange(2, dtype=np.int32), req_pool_idx=bad)])
    assert_unchanged(pool, snap, a + [fresh])


def test_free_returns_the_row_and_rejects_bad_frees(device):
    pool = ReqToTokenPool(3, 8, device)
    a = reqs(3)
    pool.alloc(a)
    row = a[1].req_pool_idx
    pool.free(a[1])
    assert a[1].req_pool_idx is None and pool.available_size() == 1
    assert bool(pool.free_slots.is_free(torch.tensor([row]))[0])
    snap = snapshot(pool, a)
    with pytest.raises(InvalidArgumentError, match="no row"):
        pool.free(a[1])
    ghost = Req("ghost", np.arange(2, dtype=np.int32), req_pool_idx=row)  # already free
    with pytest.raises(DoubleFreeError):
        pool.free(ghost)
    for bad in (0, 4, -2):
        with pytest.raises(InvalidIndexError):
            pool.free(Req("oob", np.arange(2, dtype=np.int32), req_pool_idx=bad))
    assert_unchanged(pool, snap, a)
    assert ghost.req_pool_idx == row
    # the freed row is handed out again
    c = reqs(1, start=9)
    assert pool.alloc(c) == [row]


def test_write_prefix_and_extend_then_lookup(device):
    """The seed's 5.1 example: prefix rows [5, 11], new rows [17, 42, 89]."""
    pool = ReqToTokenPool(4, 8, device)
    (r,) = reqs(1)
    pool.alloc([r])
    idx = r.req_pool_idx
    pool.write((idx, slice(0, 2)), torch.tensor([5, 11], dtype=torch.int64, device=device))
    pool.write((idx, slice(2, 5)), torch.tensor([17, 42, 89], dtype=torch.int32, device=device))
    assert pool.req_to_token[idx, :5].tolist() == [5, 11, 17, 42, 89]
    assert pool.req_to_token.dtype == torch.int32
    # decode: one token per request at (req_pool_indices, seq_lens)
    (s,) = reqs(1, start=3)
    pool.alloc([s])
    rows = torch.tensor([idx, s.req_pool_idx], device=device)
    cols = torch.tensor([5, 0], device=device)
    pool.write((rows, cols), torch.tensor([103, 104], device=device))
    assert pool.req_to_token[idx, :6].tolist() == [5, 11, 17, 42, 89, 103]
    assert pool.req_to_token[s.req_pool_idx, 0].item() == 104
    pool.write((idx, 7), 3)
    assert pool.req_to_token[idx, 7].item() == 3


def test_write_rejects_bad_input_unchanged(device):
    pool = ReqToTokenPool(3, 6, device)
    a = reqs(2)
    pool.alloc(a)
    pool.write((a[0].req_pool_idx, slice(0, 3)), torch.tensor([1, 2, 3], device=device))
    snap = snapshot(pool, a)
    row = a[0].req_pool_idx
    with pytest.raises(InvalidIndexError):
        pool.write((4, slice(0, 2)), torch.tensor([1, 2], device=device))  # row past size
    with pytest.raises(InvalidIndexError):
        pool.write((-1, 0), 5)  # negative rows are rejected, not wrapped
    with pytest.raises(InvalidIndexError):
        pool.write((torch.tensor([row, 9], device=device), torch.tensor([0, 1], device=device)),
                   torch.tensor([7, 7], device=device))
    with pytest.raises(InvalidIndexError):
        pool.write((row, 6), 1)  # column past max_context_len
    with pytest.raises(InvalidArgumentError, match="integers"):
        pool.write((row, slice(0, 2)), torch.tensor([1.0, 2.0], device=device))
    with pytest.raises(LengthMismatchError):
        pool.write((row, slice(0, 3)), torch.tensor([1, 2], device=device))
    with pytest.raises(InvalidArgumentError):
        pool.write((row, 0, 1), 1)  # the table is 2-D
    assert_unchanged(pool, snap, a)


def test_clear_frees_every_row(device):
    pool = ReqToTokenPool(3, 4, device)
    pool.alloc(reqs(3))
    assert pool.available_size() == 0
    pool.clear()
    assert pool.available_size() == 3
    pool.check_invariants()
    assert sorted(pool.alloc(reqs(3, start=5))) == [1, 2, 3]


def test_check_invariants_names_a_corrupted_row():
    pool = ReqToTokenPool(4, 4)
    pool.alloc(reqs(2))
    pool.check_invariants()
    pool.free_slots._free[1] = True  # row 1 marked free while held: the free list disagrees
    with pytest.raises(InvariantError, match=r"leaked\): \[1\]"):
        pool.check_invariants()


def test_bad_constructor_arguments():
    for size, ctx in ((0, 4), (4, 0), (-1, 4), (2.5, 4), (True, 4)):
        with pytest.raises(InvalidArgumentError):
            ReqToTokenPool(size, ctx)


def test_attach_to_an_existing_buffer_shares_the_table():
    owner = ReqToTokenPool(3, 5)
    worker = ReqToTokenPool(3, 5, buffer=owner.arena.buffer)
    owner.req_to_token[2, 3] = 77
    assert worker.req_to_token[2, 3].item() == 77


def test_check_invariants_with_live_requests_names_leaked_and_stale_rows():
    pool = ReqToTokenPool(4, 4)
    a = reqs(3)
    pool.alloc(a)
    pool.check_invariants(a)
    lost = a[1].req_pool_idx
    with pytest.raises(InvariantError, match=rf"leaked\): \[{lost}\]"):
        pool.check_invariants([a[0], a[2]])  # a[1] dropped without freeing its row
    twin = Req("twin", np.arange(2, dtype=np.int32), req_pool_idx=a[0].req_pool_idx)
    with pytest.raises(InvariantError, match=rf"two requests: \[{a[0].req_pool_idx}\]"):
        pool.check_invariants(a + [twin])
    ghost = Req("ghost", np.arange(2, dtype=np.int32), req_pool_idx=4)  # row 4 is free
    with pytest.raises(InvariantError, match=r"but free: \[4\]"):
        pool.check_invariants(a + [ghost])
