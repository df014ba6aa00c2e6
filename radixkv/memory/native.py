"""The host tier's compiled page copies on the CPU, when built (``csrc/pagecopy.c``, built as
``radixkv.memory._native``, an optional C extension).

Without it (no compiler, or ``RADIXKV_PURE_PYTHON=1`` at import) :class:`~radixkv.memory.
host_kv_pool.HostKVPool` copies through torch (a gather into a staging buffer, then one indexed
write per layer and K/V: two passes over the bytes), which stays the reference. ``copy_pages``
moves each page chunk with one memcpy, GIL released: one pass (docs/tiers.md, "Load throughput").
"""
from __future__ import annotations

from typing import Any

from radixkv.allocator.native import load_optional

__all__ = ["copy_pages", "unavailable_reason"]

_mod, unavailable_reason = load_optional("radixkv.memory._native")

#: ``copy_pages(host_addr, host_pages, page_bytes, chunk, host_ids, dev_addrs, dev_pages, dev_ids,
#: to_device) -> None`` or ``None`` when not built.
copy_pages: Any = _mod.copy_pages if _mod is not None else None
