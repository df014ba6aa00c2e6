"""The KV allocators' compiled free, when it is built (``csrc/free.c``, built as
``radixkv.allocator._native``, an optional C extension).

Without it (no compiler, or ``RADIXKV_PURE_PYTHON=1`` at import) the allocators free through
their numpy path, which stays the contract and the reference. ``mark_free``: the checked free
of a batch of slot ids in one pass (range, double free, repeats; no sort) straight into the
free list's ring; it takes only valid frees in the common layout and changes nothing
otherwise (see :meth:`radixkv.allocator.page_free_list.PageFreeList.free_host`). Why compiled:
``docs/internals.md``, "The compiled free".
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
