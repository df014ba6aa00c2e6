"""The RadixCache's compiled hot paths, when they are built (``csrc/``, built as ``radixkv.cache._native``).

An optional C extension: without it every path runs in Python, which stays the contract and
the reference (``tests/cache/test_native_walk.py`` compares both on random operations). ``walk``
(match's walk + int64 widening, DLPack over a pooled C buffer), ``find`` (insert's read-only
walk), ``narrow`` (range check + int32 copy of rows), ``new_node``, and ``match`` /
``insert`` (the common call whole, as ``NativeRadixCache``'s methods; other calls and any
call they cannot take go to the Python methods before anything changes). The entries read
the cache's instance ``__dict__`` directly. ``RADIXKV_PURE_PYTHON=1`` (read at import)
disables them for the process, ``RadixCache(..., native=False)`` for one cache. What each
entry assumes and why compiled: ``docs/internals.md``, "The compiled hot paths".
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
# ``find`` / ``narrow`` have the signatures of the attributes they are bound to (``_native_find``,
# ``_native_narrow``); the others stay ``Any``: ``walk`` returns its rows as a tensor or, when the
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
