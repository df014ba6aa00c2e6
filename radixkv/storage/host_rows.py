"""``fresh_rows``: new host memory for page rows that a storage read hands to its caller.

A fresh buffer's first touch costs the kernel a minor fault per 4 KiB page (about 2.5 us each
on the 2-core test VM: a 64 MiB copy into new ``torch.empty`` rows took 36 ms, 8 ms into
reused ones). Buffers of 2 MiB or more are mapped anonymously and advised ``MADV_HUGEPAGE``,
so where transparent huge pages are ``madvise`` or ``always`` one fault covers 2 MiB (the same
copy: 12 ms). Elsewhere (no THP, not Linux) they are plain ``torch.empty`` rows. The memory is
returned when the last tensor viewing it is freed. docs/tiers.md has the figures.
"""
from __future__ import annotations

import mmap

import torch

__all__ = ["fresh_rows", "HUGE_PAGE_BYTES"]

#: Buffers at least this large are huge-page advised.
HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def fresh_rows(n: int, row_bytes: int) -> torch.Tensor:
    """``[n, row_bytes]`` uint8 CPU rows of new, uninitialised (in practice zero) memory.
    Cost: one ``mmap`` and ``madvise`` at 2 MiB or more, else one ``torch.empty``."""
    nbytes = n * row_bytes
    if _MADV_HUGEPAGE is None or nbytes < HUGE_PAGE_BYTES:
        return torch.empty((n, row_bytes), dtype=torch.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(_MADV_HUGEPAGE)
    except OSError:  # THP not built into the kernel: 4 KiB pages, still correct
        pass
    return torch.frombuffer(m, dtype=torch.uint8).view(n, row_bytes)
