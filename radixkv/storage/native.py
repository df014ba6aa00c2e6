"""The file tier's compiled page reads, when built (``csrc/pageread.c``, built as
``radixkv.storage._native``, an optional C extension; xxh3 from the vendored ``csrc/xxhash.h``).

Without it (no compiler, or ``RADIXKV_PURE_PYTHON=1`` at import) :class:`~radixkv.storage.file.
FileStorage` reads each page in Python (``_read_one``), which stays the reference.
``read_pages`` reads a run of pages with the GIL released throughout: open, one ``preadv``,
close, the trailer's checks and xxh3 per page, no Python between them (docs/tiers.md).
"""
from __future__ import annotations

from typing import Any

from radixkv.allocator.native import load_optional

__all__ = ["MAX_PARTS", "read_pages", "unavailable_reason"]

_mod, unavailable_reason = load_optional("radixkv.storage._native")

#: ``read_pages(paths, keys, parts, version) -> bytes`` (0 hit, 1 absent, 2 corrupt, 3 error per
#: page) or ``None`` when not built.
read_pages: Any = _mod.read_pages if _mod is not None else None
#: Most buffers one page may have for ``read_pages``.
MAX_PARTS = 16
