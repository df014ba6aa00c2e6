"""write_cache_indices: the Triton kernel (CPU interpreter here) and the torch reference give
identical req_to_token tables; bad batches raise before writing anything."""
import numpy as np
import pytest
import torch

from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError
from radixkv.kernels.triton_util import triton_runnable
from radixkv.kernels.write_cache_indices import write_cache_indices


def _naive(table, rows, pre, seq, ext, loc, prefixes):
    """The seed's per-request loop (section 5.1), the ground truth."""
    pt = 0
    for i in range(len(rows)):
        table[rows[i], 0:pre[i]] = prefixes[i].to(table.dtype)
        table[rows[i], pre[i]:seq[i]] = loc[pt:pt + ext[i]].to(table.dtype)
        pt += ext[i]


def _random_batch(rng, n_rows, width, bs, max_len):
    rows = rng.choice(np.arange(1, n_rows), size=bs, replace=False)
    pre = rng.integers(0, max_len + 1, bs)
    ext = rng.integers(0, max_len + 1, bs)
    ext = np.minimum(ext, width - pre)
    seq = pre + ext
    prefixes = [torch.from_numpy(rng.integers(1, 10_000, int(p))) for p in pre]
    loc = torch.from_numpy(rng.integers(1, 10_000, int(ext.sum())))
    return rows.tolist(), pre.tolist(), seq.tolist(), ext.tolist(), loc, prefixes


@pytest.mark.parametrize("seed", range(6))
def test_torch_matches_naive_loop(device, seed):
    rng = np.random.default_rng(seed)
    n_rows, width = 12, 700
    batch = _random_batch(rng, n_rows, width, int(rng.integers(1, 10)), 600)
    want = torch.full((n_rows, width), -7, dtype=torch.int32)
    _naive(want, *batch)
    got = torch.full((n_rows, width), -7, dtype=torch.int32, device=device)
    rows, pre, seq, ext, loc, prefixes = batch
    write_cache_indices(got, rows, pre, seq, ext, loc.to(device), [p.to(device) for p in prefixes], impl="torch")
    assert torch.equal(got.cpu(), want)


@pytest.mark.skipif(not triton_runnable("cpu") and not torch.cuda.is_available(), reason="needs triton")
@pytest.mark.parametrize("seed", range(4))
def test_triton_matches_torch(seed):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(100 + seed)
    n_rows, width = 10, 1200
    # lengths beyond one 512 block exercise the kernel's loop over blocks
    rows, pre, seq, ext, loc, prefixes = _random_batch(rng, n_rows, width, int(rng.integers(1, 7)), 1100)
    a = torch.full((n_rows, width), -1, dtype=torch.int32, device=dev)
    b = a.clone()
    args = (rows, pre, seq, ext, loc.to(dev), [p.to(dev) for p in prefixes])
    write_cache_indices(a, *args, impl="torch")
    write_cache_indices(b, *args, impl="triton")
    assert torch.equal(a, b)
    assert (a != -1).sum().item() == sum(seq)  # something was written, and only that


def test_empty_batch_and_empty_parts(device):
    t = torch.zeros((4, 8), dtype=torch.int32, device=device)
    write_cache_indices(t, [], [], [], [], torch.empty(0, dtype=torch.int64, device=device), [])
    assert t.abs().sum() == 0
    # a request with only a prefix and one with only new slots
    write_cache_indices(
        t, [1, 2], [3, 0], [3, 2], [0, 2], torch.tensor([9, 8], device=device),
        [torch.tensor([5, 6, 7], device=device), torch.empty(0, dtype=torch.int64, device=device)],
    )
    assert t[1, :4].tolist() == [5, 6, 7, 0] and t[2, :3].tolist() == [9, 8, 0]


@pytest.mark.parametrize(
    "args, err",
    [
        (([1, 2], [1, 0], [2, 1], [1], "loc2", "pre10"), LengthMismatchError),  # extend_lens short
        (([1], [1], [3], [1], "loc1", "pre1"), LengthMismatchError),  # seq != pre + ext
        (([1], [2], [3], [1], "loc1", "pre1"), LengthMismatchError),  # prefix tensor length
        (([1], [1], [2], [1], "loc2", "pre1"), LengthMismatchError),  # out_cache_loc length
        (([0], [1], [2], [1], "loc1", "pre1"), InvalidIndexError),  # padding row
        (([4], [1], [2], [1], "loc1", "pre1"), InvalidIndexError),  # row out of range
        (([1], [1], [9], [8], "loc8", "pre1"), InvalidIndexError),  # beyond table width
        (([1, 1], [1, 0], [2, 1], [1, 1], "loc2", "pre10"), InvalidArgumentError),  # row twice
        (([1], [-1], [0], [1], "loc1", "pre-"), InvalidArgumentError),  # negative
    ],
)
def test_bad_batches_write_nothing(args, err):
    rows, pre, seq, ext, loc, pref = args
    loc_t = torch.arange(1, 1 + int(loc[3:]))
    pref_t = {"pre1": [torch.tensor([3])], "pre10": [torch.tensor([3]), torch.empty(0, dtype=torch.int64)],
              "pre-": [torch.empty(0, dtype=torch.int64)]}[pref]
    t = torch.full((4, 8), -3, dtype=torch.int32)
    before = t.clone()
    with pytest.raises(err):
        write_cache_indices(t, rows, pre, seq, ext, loc_t, pref_t)
    assert torch.equal(t, before)


def test_wrong_dtypes_rejected():
    t = torch.zeros((4, 8), dtype=torch.int32)
    with pytest.raises(InvalidArgumentError):
        write_cache_indices(t, [1], [0], [1], [1], torch.tensor([1.0]), [torch.empty(0)])
    with pytest.raises(InvalidArgumentError):
        write_cache_indices(t.float(), [1], [0], [1], [1], torch.tensor([1]), [torch.empty(0)])
    with pytest.raises(InvalidArgumentError):
        write_cache_indices(t, [1], [0], [1], [1], torch.tensor([1]), [torch.empty(0)], impl="cuda")
    assert t.abs().sum() == 0


def test_non_contiguous_table_torch_path():
    rng = np.random.default_rng(9)
    rows, pre, seq, ext, loc, prefixes = _random_batch(rng, 6, 40, 4, 30)
    want = torch.zeros((6, 40), dtype=torch.int32)
    _naive(want, rows, pre, seq, ext, loc, prefixes)
    got = torch.zeros((6, 80), dtype=torch.int32)[:, ::2]
    assert not got.is_contiguous()
    write_cache_indices(got, rows, pre, seq, ext, loc, prefixes, impl="torch")
    assert torch.equal(got, want)
