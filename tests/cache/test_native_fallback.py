"""Without the compiled paths (``RADIXKV_PURE_PYTHON=1``, or no C compiler at install time)
the RadixCache runs its Python methods and gives the same results."""
import os
import subprocess
import sys

SCRIPT = r"""
import numpy as np, torch
from radixkv.cache import RadixCache, RadixKey, native
from radixkv.cache.radix_cache import NativeRadixCache
from radixkv.cache.radix_insert import InsertMixin
assert not native.available() and native.unavailable_reason == "RADIXKV_PURE_PYTHON is set"
assert NativeRadixCache.match_prefix is RadixCache.match_prefix  # no compiled entries bound
assert NativeRadixCache.insert is RadixCache.insert is InsertMixin.insert
c = RadixCache(page_size=2)
assert type(c) is RadixCache  # never a NativeRadixCache without the compiled paths
assert c.native is False and c._native_walk is None and c._native_find is None
c.insert(RadixKey(np.arange(8, dtype=np.int32)), torch.arange(8))
m = c.match_prefix(RadixKey(np.r_[np.arange(6), [9, 9]].astype(np.int32)))
assert m.prefix_len == 6 and m.device_indices.tolist() == list(range(6))
c.check_invariants()
print("ok")
"""


def test_pure_python_mode_runs_the_reference_methods():
    env = dict(os.environ, RADIXKV_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
