"""The KV allocators' compiled free, when it is built (``csrc/free.c``, built as
``radixkv.allocator._native``).

``setup.py`` builds it as an *optional* C extension: without a C compiler the install still
succeeds and the allocators free through their numpy path, which stays the contract and the
reference (``tests/allocator/test_allocator_native.py`` runs both on the same frees, good and bad, and
compares results, errors and states). ``RADIXKV_PURE_PYTHON=1`` in the environment (read at
import) turns it off for the whole process, as it does the RadixCache's compiled paths.

``mark_free``: the checked free of a batch of slot ids in one pass (range, double free,
repeats: each page is marked in the mask as it is reached, so a page met twice finds its mark;
no sort) straight into the free list's ring. It takes only valid frees in the common layout
and changes nothing otherwise (see :meth:`radixkv.allocator.page_free_list.PageFreeList.free_host`).

Why compiled: an eviction returns a few thousand rows in one call, and the numpy path spends
most of its time in the dispatch of its ~30 small vector ops, not in the work
(``docs/benchmarks.md``, issue 20).
"""
from __future__ import annotations

import importlib
import os
from typing import Any

__all__ = ["load_optional", "mark_free", "unavailable_reason"]


def load_optional(name: str) -> tuple[Any | None, str | None]:
    """``(module, None)``, or ``(None, why not)`` when ``RADIXKV_PURE_PYTHON`` is set or the
    optional C extension ``name`` is not built. Shared by every compiled path's loader (this
    one and ``radixkv.cache.native``)."""
    if os.environ.get("RADIXKV_PURE_PYTHON", "") not in ("", "0"):
        return None, "RADIXKV_PURE_PYTHON is set"
    try:
        return importlib.import_module(name), None
    except ImportError as e:  # not built (no C compiler at install time)
        return None, f"{name} is not built ({e})"


_mod, unavailable_reason = load_optional("radixkv.allocator._native")

#: ``mark_free(ids, mask, ring, pos, shift, num_ids, ascending) -> int`` or ``None`` when not built.
mark_free: Any = _mod.mark_free if _mod is not None else None
