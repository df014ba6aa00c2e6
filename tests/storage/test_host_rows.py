"""fresh_rows: the shape, dtype and bytes of new page rows on each path (huge-page advised,
plain, madvise refused), and a view keeps a mapping alive after its base is gone."""
import gc

import pytest
import torch

from radixkv.storage import host_rows
from radixkv.storage.host_rows import HUGE_PAGE_BYTES, fresh_rows


def _writes_back(t):
    t.copy_(torch.arange(t.numel(), dtype=torch.int64).remainder(251).to(torch.uint8).view(t.shape))
    return int(t[-1, -1]) == (t.numel() - 1) % 251 and int(t[0, 0]) == 0


@pytest.mark.parametrize("n, row", [(3, 100), (4, HUGE_PAGE_BYTES // 4), (7, HUGE_PAGE_BYTES // 2 + 4096)])
def test_rows_have_the_shape_and_keep_what_is_written(n, row):
    t = fresh_rows(n, row)
    assert t.shape == (n, row) and t.dtype == torch.uint8 and t.device.type == "cpu" and t.is_contiguous()
    assert _writes_back(t)


def test_a_view_outlives_its_base():
    t = fresh_rows(4, HUGE_PAGE_BYTES)
    t.fill_(7)
    v = t[1:3]
    del t
    gc.collect()
    assert int(v.sum()) == 7 * 2 * HUGE_PAGE_BYTES


def test_without_madvise_the_rows_are_plain(monkeypatch):
    monkeypatch.setattr(host_rows, "_MADV_HUGEPAGE", None)
    t = fresh_rows(2, HUGE_PAGE_BYTES)
    assert t.shape == (2, HUGE_PAGE_BYTES) and _writes_back(t)


def test_a_refused_madvise_still_gives_rows(monkeypatch):
    monkeypatch.setattr(host_rows, "_MADV_HUGEPAGE", 0x7FFF)  # no such advice: madvise raises EINVAL
    t = fresh_rows(2, HUGE_PAGE_BYTES)
    assert t.shape == (2, HUGE_PAGE_BYTES) and _writes_back(t)
