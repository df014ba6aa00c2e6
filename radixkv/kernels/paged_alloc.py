"""Index math of the paged allocator's ``alloc_extend`` / ``alloc_decode``.

Given per-request lengths and the free pages about to be taken, compute the KV slot of
every new token. Written twice with identical results: a vectorized torch reference (no
Python loop over requests or tokens; used on CPU) and Triton kernels (used on CUDA;
tested on CPU under ``TRITON_INTERPRET=1``). Pure functions: no allocator state.

Semantics (SGLang's ``alloc_extend_kernel`` / ``alloc_decode_kernel``): a request with
``prefix_len`` tokens whose last token sits in slot ``last_loc`` first fills the rest of
that page (slots ``last_loc + 1, ...`` up to the page end), then takes fresh pages in the
order of ``free_pages``; request ``i`` takes the pages after those of requests ``< i``.
``last_loc`` of a request with ``prefix_len == 0`` is never read. Page ``p`` holds slots
``p * page_size .. p * page_size + page_size - 1``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from radixkv.kernels.triton_util import HAS_TRITON, use_triton

if HAS_TRITON:
    from radixkv.kernels.triton_util import tl, triton


class PageLayout(NamedTuple):
    """Per-request page bookkeeping (int64 tensors of length ``bs``)."""

    new_pages: torch.Tensor  # fresh pages each request takes
    page_start: torch.Tensor  # index into free_pages of its first fresh page (exclusive cumsum)
    total_new_pages: torch.Tensor  # 0-dim: sum of new_pages


def _floordiv(a: torch.Tensor, b: int) -> torch.Tensor:
    if b & (b - 1) == 0:  # a power of two: a shift is floor division, and much faster
        return a >> (b.bit_length() - 1)
    return torch.div(a, b, rounding_mode="floor")


def _cdiv(a: torch.Tensor, b: int) -> torch.Tensor:
    return _floordiv(a + (b - 1), b)


def page_layout(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> PageLayout:
    """Fresh pages needed per request going from ``prefix_lens`` to ``seq_lens`` tokens,
    and where each request's pages start in the free list. O(bs), no host sync."""
    new = _cdiv(seq_lens.to(torch.int64), page_size) - _cdiv(prefix_lens.to(torch.int64), page_size)
    csum = torch.cumsum(new, 0)
    total = csum[-1] if new.numel() else new.new_zeros(())
    return PageLayout(new, csum - new, total)


# ---------------------------------------------------------------------------- torch
def alloc_extend_torch(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                       free_pages: torch.Tensor, page_size: int, extend_num_tokens: int) -> torch.Tensor:
    """Slots (int64, length ``extend_num_tokens = sum(seq_lens - prefix_lens)``) for the
    tokens ``prefix_lens[i] .. seq_lens[i] - 1`` of each request, request after request.
    ``free_pages`` must hold at least ``page_layout(...).total_new_pages`` pages.
    O(bs + extend_num_tokens), vectorized."""
    pre = prefix_lens.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    last = last_loc.to(torch.int64)
    dev = pre.device
    bs = pre.numel()
    if extend_num_tokens == 0 or bs == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    ext = seq - pre
    layout = page_layout(pre, seq, page_size)
    pages_before = _cdiv(pre, page_size)
    out_start = torch.cumsum(ext, 0) - ext
    req = torch.repeat_interleave(
        torch.arange(bs, device=dev), ext, output_size=extend_num_tokens
    )
    j = torch.arange(extend_num_tokens, device=dev) - out_start[req]  # offset in request
    pos = pre[req] + j  # token position in its sequence
    in_old_page = pos < pages_before[req] * page_size
    page_in_seq = _floordiv(pos, page_size)
    if free_pages.numel():
        page_idx = layout.page_start[req] + page_in_seq - pages_before[req]
        page = free_pages[page_idx.clamp(0, free_pages.numel() - 1)].to(torch.int64)
    else:
        page = torch.zeros_like(pos)
    offset = pos - page_in_seq * page_size
    return torch.where(in_old_page, last[req] + 1 + j, page * page_size + offset)


def alloc_decode_torch(seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor,
                       page_size: int) -> torch.Tensor:
    """One slot (int64) per request for its token ``seq_lens[i] - 1`` (``seq_lens``
    include the new token): ``last_loc + 1`` inside the current page, else the first slot
    of its fresh page. O(bs), vectorized."""
    seq = seq_lens.to(torch.int64)
    last = last_loc.to(torch.int64)
    if seq.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=seq.device)
    layout = page_layout(seq - 1, seq, page_size)
    if free_pages.numel():
        page = free_pages[layout.page_start.clamp(0, free_pages.numel() - 1)].to(torch.int64)
    else:
        page = torch.zeros_like(seq)
    return torch.where(layout.new_pages > 0, page * page_size, last + 1)


# ---------------------------------------------------------------------------- triton
if HAS_TRITON:

    @triton.jit
    def _alloc_extend_kernel(pre_ptr, seq_ptr, last_ptr, page_start_ptr, out_start_ptr,
                             free_ptr, out_ptr, page_size, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        pre = tl.load(pre_ptr + pid).to(tl.int64)
        seq = tl.load(seq_ptr + pid).to(tl.int64)
        last = tl.load(last_ptr + pid).to(tl.int64)
        page_start = tl.load(page_start_ptr + pid)
        out_start = tl.load(out_start_ptr + pid)
        pages_before = (pre + page_size - 1) // page_size
        old_end = pages_before * page_size
        ext = seq - pre
        for off in range(0, ext, BLOCK):
            j = off + tl.arange(0, BLOCK).to(tl.int64)
            valid = j < ext
            pos = pre + j
            in_old = pos < old_end
            page_idx = page_start + pos // page_size - pages_before
            page = tl.load(free_ptr + page_idx, mask=valid & (pos >= old_end), other=0)
            slot = tl.where(in_old, last + 1 + j, page.to(tl.int64) * page_size + pos % page_size)
            tl.store(out_ptr + out_start + j, slot, mask=valid)

    @triton.jit
    def _alloc_decode_kernel(seq_ptr, last_ptr, page_start_ptr, free_ptr, out_ptr, bs,
                             page_size, BLOCK: tl.constexpr):
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = idx < bs
        seq = tl.load(seq_ptr + idx, mask=valid, other=1).to(tl.int64)
        last = tl.load(last_ptr + idx, mask=valid, other=0).to(tl.int64)
        start = tl.load(page_start_ptr + idx, mask=valid, other=0)
        new = (seq + page_size - 1) // page_size - (seq - 1 + page_size - 1) // page_size
        page = tl.load(free_ptr + start, mask=valid & (new > 0), other=0)
        slot = tl.where(new > 0, page.to(tl.int64) * page_size, last + 1)
        tl.store(out_ptr + idx, slot, mask=valid)


_EXTEND_BLOCK = 256
_DECODE_BLOCK = 256


def _contig(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64).contiguous()


def alloc_extend_triton(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                        free_pages: torch.Tensor, page_size: int, extend_num_tokens: int) -> torch.Tensor:
    """Triton version of ``alloc_extend_torch`` (same arguments, same result)."""
    pre, seq = _contig(prefix_lens), _contig(seq_lens)
    bs = pre.numel()
    out = torch.empty(extend_num_tokens, dtype=torch.int64, device=pre.device)
    if extend_num_tokens == 0 or bs == 0:
        return out
    ext = seq - pre
    layout = page_layout(pre, seq, page_size)
    out_start = torch.cumsum(ext, 0) - ext
    fp = free_pages.contiguous() if free_pages.numel() else pre.new_zeros(1)
    _alloc_extend_kernel[(bs,)](
        pre, seq, _contig(last_loc), _contig(layout.page_start), _contig(out_start), fp, out,
        page_size, BLOCK=_EXTEND_BLOCK,
    )
    return out


def alloc_decode_triton(seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor,
                        page_size: int) -> torch.Tensor:
    """Triton version of ``alloc_decode_torch`` (same arguments, same result)."""
    seq = _contig(seq_lens)
    bs = seq.numel()
    out = torch.empty(bs, dtype=torch.int64, device=seq.device)
    if bs == 0:
        return out
    layout = page_layout(seq - 1, seq, page_size)
    fp = free_pages.contiguous() if free_pages.numel() else seq.new_zeros(1)
    grid = (triton.cdiv(bs, _DECODE_BLOCK),)
    _alloc_decode_kernel[grid](
        seq, _contig(last_loc), _contig(layout.page_start), fp, out, bs, page_size,
        BLOCK=_DECODE_BLOCK,
    )
    return out


# ---------------------------------------------------------------------------- dispatch
def alloc_extend_indices(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                         free_pages: torch.Tensor, page_size: int, extend_num_tokens: int) -> torch.Tensor:
    """``alloc_extend_triton`` on CUDA (with Triton), else ``alloc_extend_torch``."""
    fn = alloc_extend_triton if use_triton(free_pages.device) else alloc_extend_torch
    return fn(prefix_lens, seq_lens, last_loc, free_pages, page_size, extend_num_tokens)


def alloc_decode_indices(seq_lens: torch.Tensor, last_loc: torch.Tensor, free_pages: torch.Tensor,
                         page_size: int) -> torch.Tensor:
    """``alloc_decode_triton`` on CUDA (with Triton), else ``alloc_decode_torch``."""
    fn = alloc_decode_triton if use_triton(free_pages.device) else alloc_decode_torch
    return fn(seq_lens, last_loc, free_pages, page_size)
