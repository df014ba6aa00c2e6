"""The index math of alloc_extend / alloc_decode: torch reference vs Triton kernel (run
under TRITON_INTERPRET=1 on CPU) vs a plain per-token Python statement of the semantics."""
import numpy as np
import pytest
import torch

from radixkv.kernels.paged_alloc import (
    alloc_decode_indices,
    alloc_decode_torch,
    alloc_decode_triton,
    alloc_extend_indices,
    alloc_extend_torch,
    alloc_extend_triton,
    page_layout,
)
from radixkv.kernels.triton_util import HAS_TRITON, triton_runnable

needs_triton = pytest.mark.skipif(
    not (HAS_TRITON and triton_runnable("cpu" if not torch.cuda.is_available() else "cuda")),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def python_extend(pre, seq, last, free_pages, ps):
    """The semantics, one token at a time."""
    out, nxt = [], 0
    for p, s, ll in zip(pre, seq, last):
        own_page = None
        for pos in range(p, s):
            if pos < -(-p // ps) * ps:
                out.append(ll + 1 + (pos - p))
                continue
            if pos % ps == 0 or own_page is None:
                own_page = free_pages[nxt]
                nxt += 1
            out.append(own_page * ps + pos % ps)
    return out, nxt


def python_decode(seq, last, free_pages, ps):
    out, nxt = [], 0
    for s, ll in zip(seq, last):
        if (s - 1) % ps == 0:
            out.append(free_pages[nxt] * ps)
            nxt += 1
        else:
            out.append(ll + 1)
    return out, nxt


def random_batch(rng, bs, ps, max_pre=40, max_ext=40, num_pages=4000):
    pre = rng.integers(0, max_pre + 1, bs)
    ext = rng.integers(0, max_ext + 1, bs)
    seq = pre + ext
    page_of_last = rng.integers(1, num_pages, bs)
    last = np.where(pre > 0, page_of_last * ps + (pre - 1) % ps, rng.integers(-1, 50, bs))
    new = -(-seq // ps) - (-(-pre // ps))
    free = rng.permutation(np.arange(1, num_pages + 1))[: int(new.sum()) + int(rng.integers(0, 3))]
    return pre, seq, last, free


def as_t(a, dtype=torch.int64, device="cpu"):
    return torch.as_tensor(np.asarray(a), dtype=dtype, device=device)


@pytest.mark.parametrize("ps", [1, 3, 4, 16])
def test_extend_torch_matches_python_semantics(ps):
    rng = np.random.default_rng(ps)
    for _ in range(20):
        pre, seq, last, free = random_batch(rng, int(rng.integers(1, 9)), ps)
        want, used = python_extend(pre.tolist(), seq.tolist(), last.tolist(), free.tolist(), ps)
        E = int((seq - pre).sum())
        got = alloc_extend_torch(as_t(pre), as_t(seq), as_t(last), as_t(free, torch.int32), ps, E)
        assert got.dtype == torch.int64
        assert got.tolist() == want
        assert int(page_layout(as_t(pre), as_t(seq), ps).total_new_pages) == used


@pytest.mark.parametrize("ps", [1, 3, 4, 16])
def test_decode_torch_matches_python_semantics(ps):
    rng = np.random.default_rng(100 + ps)
    for _ in range(20):
        seq = rng.integers(1, 60, int(rng.integers(1, 12)))
        pre = seq - 1
        last = np.where(pre > 0, rng.integers(1, 500, seq.size) * ps + (pre - 1) % ps, -1)
        free = rng.permutation(np.arange(1, 600))[: seq.size]
        want, _ = python_decode(seq.tolist(), last.tolist(), free.tolist(), ps)
        got = alloc_decode_torch(as_t(seq), as_t(last), as_t(free, torch.int32), ps)
        assert got.tolist() == want


def test_extend_worked_example():
    # page size 4; request 0 new (5 tokens), request 1 has 3 tokens ending in slot 18
    # (page 4), request 2 extends by nothing, request 3 has 5 tokens ending in slot 36.
    got = alloc_extend_torch(
        torch.tensor([0, 3, 4, 5]), torch.tensor([5, 9, 4, 6]), torch.tensor([-1, 18, 27, 36]),
        torch.tensor([7, 8, 9, 10, 11], dtype=torch.int32), 4, 12,
    )
    assert got.tolist() == [28, 29, 30, 31, 32, 19, 36, 37, 38, 39, 40, 37]


def test_empty_inputs():
    e = torch.empty(0, dtype=torch.int64)
    assert alloc_extend_torch(e, e, e, e, 4, 0).numel() == 0
    assert alloc_decode_torch(e, e, e, 4).numel() == 0
    # extension entirely inside the prefix's page: no free pages needed
    got = alloc_extend_torch(torch.tensor([1]), torch.tensor([3]), torch.tensor([8]), e, 4, 2)
    assert got.tolist() == [9, 10]


@needs_triton
@pytest.mark.parametrize("ps", [1, 3, 4, 16, 64])
def test_extend_triton_equals_torch(ps):
    rng = np.random.default_rng(1000 + ps)
    for trial in range(6):
        bs = int(rng.integers(1, 7))
        pre, seq, last, free = random_batch(rng, bs, ps, max_pre=300 if trial == 0 else 40,
                                            max_ext=600 if trial == 0 else 40)
        E = int((seq - pre).sum())
        for dtype in (torch.int32, torch.int64):
            args = (as_t(pre, dtype), as_t(seq, dtype), as_t(last, dtype), as_t(free, torch.int32))
            ref = alloc_extend_torch(*args, ps, E)
            tri = alloc_extend_triton(*args, ps, E)
            assert tri.dtype == torch.int64
            assert torch.equal(ref, tri), (ps, trial, pre, seq)


@needs_triton
@pytest.mark.parametrize("ps", [1, 3, 4, 16])
def test_decode_triton_equals_torch(ps):
    rng = np.random.default_rng(2000 + ps)
    for bs in (1, 7, 300):  # 300 > one 256-wide block
        seq = rng.integers(1, 100, bs)
        pre = seq - 1
        last = np.where(pre > 0, rng.integers(1, 2000, bs) * ps + (pre - 1) % ps, -1)
        free = rng.permutation(np.arange(1, 3000))[:bs]
        args = (as_t(seq), as_t(last), as_t(free, torch.int32))
        assert torch.equal(alloc_decode_torch(*args, ps), alloc_decode_triton(*args, ps))


@needs_triton
def test_triton_empty_and_no_fresh_pages():
    e = torch.empty(0, dtype=torch.int64)
    assert alloc_extend_triton(e, e, e, e, 4, 0).numel() == 0
    assert alloc_decode_triton(e, e, e, 4).numel() == 0
    got = alloc_extend_triton(torch.tensor([1]), torch.tensor([3]), torch.tensor([8]), e, 4, 2)
    assert got.tolist() == [9, 10]
    got = alloc_decode_triton(torch.tensor([3, 2]), torch.tensor([9, 12]), e, 4)
    assert got.tolist() == [10, 13]


def test_dispatch_uses_torch_on_cpu():
    fp = torch.tensor([3], dtype=torch.int32)
    got = alloc_extend_indices(torch.tensor([0]), torch.tensor([2]), torch.tensor([-1]), fp, 4, 2)
    assert got.tolist() == [12, 13]
    assert alloc_decode_indices(torch.tensor([1]), torch.tensor([0]), fp, 4).tolist() == [12]


@pytest.mark.cuda
def test_cuda_triton_equals_torch():
    rng = np.random.default_rng(5)
    pre, seq, last, free = random_batch(rng, 64, 16, max_pre=500, max_ext=500)
    E = int((seq - pre).sum())
    args = [as_t(x, device="cuda") for x in (pre, seq, last)] + [as_t(free, torch.int32, "cuda")]
    assert torch.equal(alloc_extend_torch(*args, 16, E), alloc_extend_indices(*args, 16, E))
