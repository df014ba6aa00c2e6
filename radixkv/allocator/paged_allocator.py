"""``PagedTokenToKVPoolAllocator``: hands out whole pages of KV slots, SGLang style.

Pages are ``1..num_pages`` (``num_pages = size // page_size``); page 0 is reserved. Page
``p`` holds slots ``p * page_size .. p * page_size + page_size - 1``. The free list is of
page ids (``radixkv.allocator.page_free_list``); the per-token index math of
``alloc_extend`` / ``alloc_decode`` is in ``radixkv.kernels.paged_alloc`` (Triton on CUDA,
torch elsewhere).
"""
from __future__ import annotations

from typing import cast

import numpy as np
import torch

from radixkv.allocator.base import BaseKVAllocator
from radixkv.allocator.page_free_list import id_runs
from radixkv.contracts import IndexLike, KVPool
from radixkv.errors import (
    AlignmentError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidIndexError,
    LengthMismatchError,
    describe_ids,
)
from radixkv.kernels.paged_alloc import alloc_decode_indices, alloc_extend_indices, page_layout
from radixkv.validation import (
    check_count,
    check_range,
    index_tensor,
    repeated,
    sort_ids,
)

# Frees of up to this many slots sort them outright (fewest ops); larger ones sort one
# entry per run of same-page slots instead.
_SMALL_FREE = 1024
# count_nonzero / argmin / argmax are single typed loops; ufunc reductions (np.any, .min,
# .max) go through far more code (see radixkv.cache.rows.row_max)
_count = np.count_nonzero


class PagedTokenToKVPoolAllocator(BaseKVAllocator):
    """KV slot allocator that hands out whole pages.

    Args:
        size: usable slots; ``num_pages = size // page_size`` pages are managed.
        page_size: slots per page (>= 1).
        device: where indices live; results are int64 tensors on it.
        need_sort, kvcache, checks: as for ``TokenToKVPoolAllocator``.

    Cost: ``alloc`` O(need_size); ``alloc_extend`` / ``alloc_decode`` O(bs + tokens) device
    work and a few host syncs (validation, the number of fresh pages); ``free`` of k slots
    on p pages O(k + p log p) when each page's slots come as one ascending run, O(k log k)
    otherwise. Nothing is O(pool size) except ``clear`` and ``check_invariants``.
    """

    def __init__(self, size: int, page_size: int, device: torch.device | str = "cpu",
                 need_sort: bool = False, kvcache: KVPool | None = None, checks: bool = True, *,
                 dtype: torch.dtype | None = None, enable_memory_saver: bool = False):
        super().__init__(size, page_size, device, need_sort, kvcache, checks, kind="page", dtype=dtype,
                         enable_memory_saver=enable_memory_saver)
        self._offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        self._offsets_host = np.arange(self.page_size, dtype=np.int64)
        ps = self.page_size
        self._shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else None
        self._small_free = _SMALL_FREE  # tests lower it to drive the run-based path

    # ------------------------------------------------------------------ alloc
    def _slots_of(self, pages: torch.Tensor) -> torch.Tensor:
        if pages.device.type == "cpu":  # numpy: one broadcast, no torch dispatch
            host = pages.numpy()
            return torch.from_numpy((host[:, None] * self.page_size + self._offsets_host).reshape(-1))
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """The slots (int64, page after page) of ``need_size // page_size`` fresh pages, or
        None (unchanged) when too few pages are available. O(need_size).

        Raises AlignmentError when ``need_size`` is not a multiple of ``page_size``,
        InvalidArgumentError when it is not a non-negative int."""
        need_size = check_count(need_size, "need_size")
        if need_size % self.page_size:
            raise AlignmentError(
                f"alloc({need_size}): not a multiple of page_size {self.page_size}"
            )
        pages = self._fl.alloc(need_size // self.page_size)
        return None if pages is None else self._slots_of(pages)

    def _lens(self, t: IndexLike, what: str) -> torch.Tensor:
        return index_tensor(t, self.device, what, sequences=False)

    def _check_last_loc(self, prefix: torch.Tensor, last: torch.Tensor, what: str) -> None:
        """Rows with a prefix: ``last_loc`` inside a page in use, at the prefix's offset."""
        has = prefix > 0
        ps = self.page_size
        lo, hi = ps, (self.num_pages + 1) * ps - 1
        oob = has & ((last < lo) | (last > hi))
        misaligned = has & ~oob & ((last + 1) % ps != prefix % ps)
        page = self._page_of(last).clamp(0, self.num_pages)
        on_free = has & ~oob & self._fl.is_free(page)
        bad = torch.stack([oob.any(), misaligned.any(), on_free.any()]).tolist()
        if bad[0]:
            raise InvalidIndexError(
                f"{what}: last_loc out of slot range [{lo}, {hi}] for requests "
                f"{describe_ids(torch.nonzero(oob).reshape(-1).tolist())}"
            )
        if bad[1]:
            raise AlignmentError(
                f"{what}: (last_loc + 1) % page_size != prefix_len % page_size for requests "
                f"{describe_ids(torch.nonzero(misaligned).reshape(-1).tolist())}"
            )
        if bad[2]:
            raise InvalidIndexError(
                f"{what}: last_loc lies in a free page for requests "
                f"{describe_ids(torch.nonzero(on_free).reshape(-1).tolist())}"
            )

    def alloc_extend(self, prefix_lens: IndexLike, seq_lens: IndexLike, last_loc: IndexLike,
                     extend_num_tokens: int) -> torch.Tensor | None:
        """Slots for the new tokens of a batch of requests.

        Request ``i`` extends from ``prefix_lens[i]`` to ``seq_lens[i]`` tokens, filling the rest of
        the page of its last prefix slot ``last_loc[i]`` first, then fresh pages. Returns the int64
        ``out_cache_loc`` (``extend_num_tokens`` long, request after request), or None (unchanged)
        when too few pages are free. O(bs + extend_num_tokens).

        Raises (unchanged): InvalidArgumentError (dtypes, negative lengths, seq < prefix),
        LengthMismatchError (array lengths, ``extend_num_tokens``), AlignmentError /
        InvalidIndexError (a ``last_loc`` inconsistent with its prefix, out of range, or free).
        """
        extend_num_tokens = check_count(extend_num_tokens, "extend_num_tokens")
        pre = self._lens(prefix_lens, "prefix_lens")
        seq = self._lens(seq_lens, "seq_lens")
        last = self._lens(last_loc, "last_loc")
        if self.checks:
            if not pre.numel() == seq.numel() == last.numel():
                raise LengthMismatchError(
                    f"alloc_extend: prefix_lens ({pre.numel()}), seq_lens ({seq.numel()}) and "
                    f"last_loc ({last.numel()}) differ in length"
                )
            neg = (pre < 0) | (seq < pre)
            bad_neg, total = torch.stack([neg.any().long(), (seq - pre).sum()]).tolist()
            if bad_neg:
                raise InvalidArgumentError(
                    "alloc_extend: need 0 <= prefix_len <= seq_len; violated for requests "
                    f"{describe_ids(torch.nonzero(neg).reshape(-1).tolist())}"
                )
            if total != extend_num_tokens:
                raise LengthMismatchError(
                    f"alloc_extend: extend_num_tokens={extend_num_tokens} but "
                    f"sum(seq_lens - prefix_lens)={total}"
                )
            self._check_last_loc(pre, last, "alloc_extend")
        layout = page_layout(pre, seq, self.page_size)
        num_new = int(layout.total_new_pages)
        if not self._fl.ensure(num_new):
            return None
        out = alloc_extend_indices(
            pre, seq, last, self._fl.peek(num_new), self.page_size, extend_num_tokens
        )
        self._fl.commit(num_new)
        return out

    def alloc_decode(self, seq_lens: IndexLike, last_loc: IndexLike) -> torch.Tensor | None:
        """One slot per request for its next token: ``seq_lens`` include the new token and
        ``last_loc`` is the slot of the token before it (ignored when ``seq_lens == 1``).
        A fresh page is taken only when a request crosses a page boundary. Returns int64
        slots (one per request) or None (unchanged) when pages run out. O(bs).

        Raises (unchanged): InvalidArgumentError (dtype, ``seq_lens < 1``),
        LengthMismatchError, AlignmentError / InvalidIndexError (bad ``last_loc``)."""
        seq = self._lens(seq_lens, "seq_lens")
        last = self._lens(last_loc, "last_loc")
        if self.checks:
            if seq.numel() != last.numel():
                raise LengthMismatchError(
                    f"alloc_decode: seq_lens ({seq.numel()}) and last_loc ({last.numel()}) "
                    "differ in length"
                )
            bad = seq < 1
            if seq.numel() and bool(bad.any()):
                raise InvalidArgumentError(
                    "alloc_decode: seq_lens must be >= 1 (they include the new token); "
                    f"violated for requests {describe_ids(torch.nonzero(bad).reshape(-1).tolist())}"
                )
            self._check_last_loc(seq - 1, last, "alloc_decode")
        layout = page_layout(seq - 1, seq, self.page_size)
        num_new = int(layout.total_new_pages)
        if not self._fl.ensure(num_new):
            return None
        out = alloc_decode_indices(seq, last, self._fl.peek(num_new), self.page_size)
        self._fl.commit(num_new)
        return out

    # ------------------------------------------------------------------ free
    def _page_of(self, slots: torch.Tensor) -> torch.Tensor:
        if self._shift is not None:
            return slots >> self._shift  # floor division, also for negative slots
        return torch.div(slots, self.page_size, rounding_mode="floor")

    def free(self, free_index: IndexLike) -> None:
        """Free the pages the slots ``free_index`` (int32/int64 tensor or numpy array)
        belong to. Inside a free group they are released at ``free_group_end()``.

        Cost: O(k + p log p) for k slots on p pages when each page's slots come as one
        ascending run (how a request's slots are laid out); O(k log k) otherwise.

        Raises (state unchanged): InvalidArgumentError (dtype), InvalidIndexError (a slot
        of page 0 or beyond the last page), DoubleFreeError (a page already free, pending
        release or in the open group, or a slot repeated in the call)."""
        slots = index_tensor(free_index, self.device, "free_index", sequences=False)
        k = slots.numel()
        if k == 0:
            return
        if self.checks and self._shift is not None and self.device.type == "cpu":
            if self._free_runs_host(slots):  # the common case, through numpy views
                return
        if k <= self._small_free:
            self._free_sorted(sort_ids(slots))
        else:
            self._free_runs(slots)

    def _free_sorted(self, s: torch.Tensor) -> None:
        """Free the pages of the sorted slots ``s`` (few of them: fewest vector ops)."""
        pages = torch.unique_consecutive(self._page_of(s))
        if not self.checks:
            self._fl.free(pages, known_unique=True)
            return
        lo, hi = self.page_size, (self.num_pages + 1) * self.page_size - 1
        parts = [s[0], s[-1], self._fl.is_free(pages.clamp(0, self.num_pages)).any()]
        if s.numel() > 1:
            parts.append((s[1:] == s[:-1]).any())
        flags = torch.stack(parts).tolist()
        self._raise_if_bad(s, pages, flags[0] < lo or flags[1] > hi, flags[2],
                           len(flags) > 3 and flags[3], lo, hi)
        self._fl.free(pages, known_unique=True, validated=True)

    def _free_runs(self, slots: torch.Tensor) -> None:
        """Free the pages of ``slots`` sorting one entry per run of same-page slots."""
        k = slots.numel()
        pages = self._page_of(slots)
        same = pages[1:] == pages[:-1]
        run_start = torch.ones(k, dtype=torch.bool, device=self.device)
        run_start[1:] = ~same
        sorted_runs = sort_ids(pages[run_start])
        if not self.checks:
            self._fl.free(torch.unique_consecutive(sorted_runs), known_unique=True)
            return
        lo, hi = self.page_size, (self.num_pages + 1) * self.page_size - 1
        mn, mx = torch.aminmax(slots)
        flags = torch.stack([
            mn, mx, self._fl.is_free(sorted_runs.clamp(0, self.num_pages)).any(),
            (same & (slots[1:] <= slots[:-1])).any(),  # unordered within a run
            (sorted_runs[1:] == sorted_runs[:-1]).any(),  # a page in two runs
        ]).tolist()
        repeats = False
        if flags[3] or flags[4]:  # slots may repeat: the exact (sorting) check
            repeats = repeated(slots).numel() > 0
            sorted_runs = torch.unique_consecutive(sorted_runs)
        self._raise_if_bad(slots, sorted_runs, flags[0] < lo or flags[1] > hi, flags[2],
                           repeats, lo, hi)
        self._fl.free(sorted_runs, known_unique=True, validated=True)

    def _free_runs_host(self, slots: torch.Tensor) -> bool:
        """The common case of :meth:`_free_runs` on CPU through numpy views: valid slots,
        each page's slots one ascending run. Frees and returns True; returns False (nothing
        changed) when any check fails, so the torch path finds and names the bad slots."""
        a = slots.numpy()
        shift = cast(int, self._shift)  # the caller checked: a power-of-two page size
        if self._fl.free_host(a, shift, ascending=True):  # compiled, when built: one pass
            return True
        host_mask = cast(np.ndarray, self._fl.host_mask())  # on CPU the view exists
        lo, hi = self.page_size, (self.num_pages + 1) * self.page_size - 1
        if a.size <= self.page_size:  # a few slots, maybe of one page (a request's tail)
            first, last = int(a[0]), int(a[-1])
            page = first >> shift
            if (last >> shift == page and lo <= first and last <= hi
                    and (a.size == 1 or not _count(a[1:] <= a[:-1]))):
                if host_mask[page]:
                    return False
                self._fl.free_one(page)
                return True
        slot_runs = id_runs(a)
        if slot_runs is not None:  # a few runs of consecutive slots (a leaf's, a request's)
            # run [s, e) of slots covers pages [s >> shift, ((e - 1) >> shift) + 1);
            # free_runs range-checks those pages (page 0 or beyond the last: a slot outside
            # [lo, hi]) and finds a page in two runs as an overlap (then the exact path)
            starts, ends = slot_runs
            return self._fl.free_runs(starts >> shift, ((ends - 1) >> shift) + 1)
        if a[a.argmin()] < lo or a[a.argmax()] > hi:
            return False
        pages = a >> shift
        if a.size == 1:
            runs = pages
        else:
            same = pages[1:] == pages[:-1]
            if _count(same & (a[1:] <= a[:-1])):  # unordered within a run: maybe repeats
                return False
            starts = np.empty(a.size, dtype=bool)
            starts[0] = True
            np.logical_not(same, out=starts[1:])
            runs = pages[starts]
            if runs.size > 1:
                runs.sort()
                if _count(runs[1:] == runs[:-1]):
                    return False
        if _count(host_mask[runs]):
            return False
        self._fl.free(torch.from_numpy(runs), known_unique=True, validated=True)
        return True

    def _raise_if_bad(self, slots: torch.Tensor, pages: torch.Tensor, out_of_range: bool, already_free: bool,
                      repeats: bool, lo: int, hi: int) -> None:
        if out_of_range:
            check_range(slots, lo, hi + 1, "slots")
        if repeats:
            raise DoubleFreeError(
                f"slots repeated in one free call: {describe_ids(repeated(slots).tolist())}"
            )
        if already_free:
            bad = pages[self._fl.is_free(pages)]
            raise DoubleFreeError(f"pages already free: {describe_ids(bad.tolist())}")

    def is_free(self, indices: IndexLike) -> torch.Tensor:
        """Bool tensor: whether the page of each slot is not in use. Raises
        InvalidIndexError for slots beyond the last page. O(k)."""
        slots = index_tensor(indices, self.device, "indices", sequences=False)
        check_range(slots, 0, (self.num_pages + 1) * self.page_size, "slots")
        return self._fl.is_free(self._page_of(slots))
