"""The compiled match's split (``csrc/split.c``) under CPython's debug allocator.

A split replaces the node's key and row buffers, which may free them; anything read from
them afterwards reads freed memory. With the normal allocator such a read usually still sees
the old bytes, so lockstep tests pass; ``PYTHONMALLOC=debug`` overwrites freed blocks, so a
stale read corrupts the tree at once. A child process runs seeded inserts / matches that end
inside nodes (page sizes 1 and 2, namespaces, locks, evictions) with ``check_invariants``
after every step. Skipped when the extension is not built.
"""

import pytest
from debug_malloc import run_under_debug_malloc

from radixkv.cache import native

pytestmark = pytest.mark.skipif(not native.available(), reason=f"{native.unavailable_reason}")

CHILD = r"""
import random
import numpy as np
import torch
from radixkv.cache import RadixCache, RadixKey

for seed in range(40):
    for ps in (1, 2):
        rng = random.Random(seed)
        c = RadixCache(page_size=ps)
        locked, nxt = [], 1
        for _ in range(300):
            op, ek = rng.random(), rng.choice([None, None, "a"])
            toks = [rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 12))]
            if op < 0.45:
                m = c.match_prefix(RadixKey(np.array(toks, dtype=np.int32), ek))
                if rng.random() < 0.3:
                    c.inc_lock_ref(m.last_node)
                    locked.append(m.last_node)
            elif op < 0.85:
                al = len(toks) - len(toks) % ps
                c.insert(RadixKey(np.array(toks[:al], dtype=np.int32), ek),
                         torch.arange(nxt, nxt + al, dtype=torch.int64))
                nxt += al
            elif op < 0.93:
                c.evict(rng.randint(0, 10))
            elif locked:
                c.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
            c.check_invariants()
print("ok")
"""


def test_split_reads_no_freed_buffer():
    run_under_debug_malloc(CHILD, timeout_s=600)
