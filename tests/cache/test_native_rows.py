"""The compiled match's rows tensor (``csrc/rows.c``): made over a DLPack capsule.

The C walk hands torch its own buffer (a pooled one for 1,024-131,072 rows, else a fresh
block) and gets it back through the capsule's deleter when the tensor's storage dies. These
tests hold the result to what the pure-Python match returns (an int64, contiguous, writable
CPU tensor of exactly the matched rows) at every size class edge, and the buffer's lifetime
to its storage's: a view, a ``.numpy()`` array or a clone made from it, a result outliving
its cache, results freed on another thread. Skipped when the extension is not built.
"""
import gc
import threading

import numpy as np
import pytest
import torch
from debug_malloc import run_under_debug_malloc

from radixkv.cache import RadixCache, RadixKey, native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"{native.unavailable_reason}")

SIZES = [1, 2, 1023, 1024, 1025, 2048, 2049, 131072, 131073]


def in_use():
    return {cls: used for cls, have, used in native.pool_stats() if have}


@pytest.mark.parametrize("n", SIZES)
def test_result_is_the_pure_pythons_tensor(n):
    rows = torch.arange(7, 7 + n)
    key = RadixKey(np.arange(n, dtype=np.int32))
    c, p = RadixCache(page_size=1, native=True), RadixCache(page_size=1, native=False)
    c.insert(key, rows)
    p.insert(key, rows)
    got, want = c.match_prefix(key).device_indices, p.match_prefix(key).device_indices
    for t in (got, want):
        assert t.dtype == torch.int64 and t.device.type == "cpu" and t.shape == (n,)
        assert t.is_contiguous() and t.stride() == (1,) and t.storage_offset() == 0
        assert not t.requires_grad and not t.is_neg()
    assert torch.equal(got, want)
    got[0] = -1  # writable, and not the tree's rows
    assert c.match_prefix(key).device_indices[0].item() == 7
    assert got.numpy().tolist()[1:] == list(range(8, 7 + n))


def test_miss_is_an_empty_int64_tensor():
    c = RadixCache(page_size=1, native=True)
    c.insert(RadixKey(np.arange(10, dtype=np.int32)), torch.arange(10))
    m = c.match_prefix(RadixKey(np.arange(5, 15, dtype=np.int32)))
    assert m.prefix_len == 0 and m.device_indices.dtype == torch.int64 and m.device_indices.numel() == 0


def test_buffer_lives_as_long_as_anything_over_its_storage():
    c = RadixCache(page_size=1, native=True)
    key = RadixKey(np.arange(5000, dtype=np.int32))
    c.insert(key, torch.arange(100, 5100))
    t = c.match_prefix(key).device_indices
    assert in_use()[8192] == 1
    arr, view = t.numpy(), t[4000:]
    del t
    gc.collect()
    assert in_use()[8192] == 1
    del arr
    assert in_use()[8192] == 1
    assert view.tolist() == list(range(4100, 5100))
    other = c.match_prefix(key).device_indices  # another buffer while the first is held
    assert in_use()[8192] == 2
    del view, other
    assert in_use()[8192] == 0
    kept = c.match_prefix(key).device_indices
    del c  # a result outlives its cache
    gc.collect()
    assert kept.sum().item() == sum(range(100, 5100))
    del kept
    assert in_use()[8192] == 0


def test_results_freed_on_other_threads():
    c = RadixCache(page_size=1, native=True)
    keys = [RadixKey(np.arange(k * 10**4, k * 10**4 + 1500 + k, dtype=np.int32)) for k in range(6)]
    for k, key in enumerate(keys):
        c.insert(key, torch.arange(k * 10**4, k * 10**4 + 1500 + k))
    for _ in range(20):
        held = [c.match_prefix(key).device_indices for key in keys]  # 4 pooled, 2 fresh
        threads = [threading.Thread(target=held.pop) for _ in range(len(held))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert held == [] and in_use()[2048] == 0


CHILD = r"""
import numpy as np
import torch
from radixkv.cache import RadixCache, RadixKey, native

c = RadixCache(page_size=1)
live = []
for i, n in enumerate([3, 900, 1024, 1500, 3000, 70000] * 5):
    key = RadixKey(np.arange(i * 10**5, i * 10**5 + n, dtype=np.int32))
    c.insert(key, torch.arange(n))
    t = c.match_prefix(key).device_indices
    assert t.tolist() == list(range(n))
    live.append(t if i % 2 else t[1:].numpy())
    if len(live) > 6:
        live.pop(0)
del live, t
assert all(used == 0 for _, _, used in native.pool_stats())
print("ok")
"""


def test_rows_under_the_debug_allocator():
    run_under_debug_malloc(CHILD, timeout_s=300)


def test_the_public_dlpack_entry_point_serves_too():
    """Where a torch lacks ``torch._C._from_dlpack``, ``native`` binds the public
    ``torch.utils.dlpack.from_dlpack``: the same capsule gives the same tensor."""
    from radixkv.cache.tree_node import TreeNode

    key = RadixKey(np.arange(2048, dtype=np.int32))
    c = RadixCache(page_size=1, native=True)
    c.insert(key, torch.arange(5, 5 + 2048))
    native._mod.bind(TreeNode, torch.utils.dlpack.from_dlpack)
    try:
        got = c.match_prefix(key).device_indices
        assert got.dtype == torch.int64 and torch.equal(got, torch.arange(5, 5 + 2048))
        del got
        gc.collect()
        assert not any(in_use().values())  # its buffer went back to the pool
    finally:
        native._mod.bind(TreeNode, torch._C._from_dlpack)
