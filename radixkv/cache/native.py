"""The RadixCache's compiled hot paths, when they are built (``csrc/``, built as ``radixkv.cache._native``).

``setup.py`` builds ``radixkv.cache._native`` as an *optional* C extension: without a C
compiler the install still succeeds and every path runs in Python. The Python code in
``radix_cache`` / ``radix_insert`` / ``rows`` stays the contract and the reference; the
compiled functions replace pieces of it one for one (``tests/cache/test_native_walk.py`` runs both
on the same random operations and compares every result and every node's fields):

* ``walk``: ``match_prefix``'s walk plus the int32 -> int64 widening of the matched rows, a
  tensor made by ``torch._C._from_dlpack`` straight over the C buffer (no numpy array in
  between); a result of 1,024-131,072 rows uses a pooled buffer, given back when the tensor's
  storage dies: no first-touch page faults on fresh heap; ``pool_stats()``;
* ``find``: ``insert``'s read-only walk;
* ``narrow``: the range check and int32 copy of a contiguous int64 tensor's rows (read
  at its ``data_ptr()``: no ``.numpy()`` view);
* ``new_node``: ``TreeNode(...)`` with its fields set in C (no ``__init__`` frame);
* ``match``: ``RadixCache.match_prefix`` whole for its common case (``NativeRadixCache``'s
  method; it hands every other call to the Python method ``RadixCache.match_prefix``);
* ``insert``: ``RadixCache.insert`` likewise (the reference: ``InsertMixin.insert`` in
  ``radix_insert``); it hands a call over before changing anything.

Both entries read and write the cache's own attributes in its instance ``__dict__`` (no
generic attribute protocol) while its class defines none of those names and keeps the
generic protocol; ``insert`` files leaves of a :class:`~radixkv.cache.leaf_index.LeafIndex`
on its slots (its ``add`` / ``remove``, same steps) and adds to ``CacheMetrics``' insert
counters on theirs; ``match`` splits a node its match ends inside in C while the cache's
class has the stock ``_split_end`` / ``_split`` / ``_new_id`` and no ``on_split`` hook
(``csrc/attrs.c``, ``csrc/split.c``).

Where they are used: ``radixkv.cache.radix_cache`` binds ``match`` and ``insert`` as the
methods of its ``NativeRadixCache`` subclass, which ``RadixCache(...)`` is when the
compiled paths are used; ``RadixCache.__init__`` sets the walks (``_cwalk``, ``_cfind``,
``_cnarrow``, ``_new_node``) that the Python methods call.

Why compiled: the issue's target (mean ``match_prefix`` <= 10 µs, ``insert`` <= 15 µs on
``benchmarks/bench_radix.py``) is below what the Python walk reaches on a 2-core VM, where
about half of a match is interpreter work around the ``memcmp`` and the copies
(``docs/bench_radix.md``).

``RADIXKV_PURE_PYTHON=1`` in the environment (read at import) disables the compiled paths
for the whole process; ``RadixCache(..., native=False)`` for one cache.
"""
from __future__ import annotations

from collections.abc import Callable
from heapq import heappush
from typing import Any

import torch

from radixkv.allocator.native import load_optional
from radixkv.cache import leaf_index
from radixkv.cache.metrics import CacheMetrics
from radixkv.cache.tree_node import TreeNode

__all__ = ["available", "walk", "find", "narrow", "new_node", "match", "insert", "unavailable_reason"]

_mod, unavailable_reason = load_optional("radixkv.cache._native")
if _mod is not None:
    # a match's rows: a tensor over a DLPack capsule; torch's C entry point when this torch has
    # it (~1,000 instructions a call), else the public one (same capsule protocol, more checks)
    _mod.bind(TreeNode, getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack)
    # insert files and unfiles leaves of a LeafIndex on its slots (its add/remove, in C)
    _mod.bind_leaves(leaf_index.LeafIndex, heappush, leaf_index._SLACK)
    _mod.bind_metrics(CacheMetrics)  # and adds to its insert counters (slots) itself

# the compiled entries (untyped C functions), None when not built: callers check available().
# ``find`` / ``narrow`` have the signatures of the attributes they are bound to (``_cfind``,
# ``_cnarrow``); the others stay ``Any``: ``walk`` returns its rows as a tensor or, when the
# match ends inside a node, as the bytes list ``_split_end`` takes; ``new_node`` may be None;
# ``match`` / ``insert`` become methods through ``method``; ``bind_*`` take Python callables.
walk: Any = _mod.walk if _mod is not None else None
find: Callable[[TreeNode, bytes, int, int], tuple[int, TreeNode, list[TreeNode], TreeNode | None]] | None = \
    _mod.find if _mod is not None else None
narrow: Callable[[int, int, int], bytes | None] | None = _mod.narrow if _mod is not None else None
new_node: Any = _mod.new_node if _mod is not None else None
match: Any = _mod.match_prefix if _mod is not None else None
bind_match: Any = _mod.bind_match if _mod is not None else None
method: Any = _mod.method if _mod is not None else None
insert: Any = _mod.insert if _mod is not None else None
bind_insert: Any = _mod.bind_insert if _mod is not None else None
bind_split: Any = _mod.bind_split if _mod is not None else None
pool_stats: Any = _mod.pool_stats if _mod is not None else None


def available() -> bool:
    """True when the compiled paths are built and enabled in this process."""
    return _mod is not None
