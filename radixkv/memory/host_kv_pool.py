"""``HostKVPool``: the host tier's (L2) KV buffer, laid out page-first.

One uint8 buffer of ``[num_pages + 1, page_bytes]`` (row 0 is padding, never handed out):
a row holds one page whole, every layer's K then V of the page's tokens (an MLA pool: every
layer's latent), i.e. the row viewed as the store dtype is ``[layers, 2, page_size, heads,
head_dim]`` (MLA: ``[layers, 1, page_size, 1, kv_lora_rank + qk_rope_head_dim]``). So a page
travels to the storage tier as ONE contiguous row. Pinned memory when the device is CUDA.

Copies go in batches: ``store`` gathers the device rows of every page of a batch into one
staging tensor (one indexed read per layer and buffer), moves it to the host once and scatters
it into the host rows with one indexed write; ``load`` is the reverse. On CUDA both run on a
side stream and return an event; the caller waits on it before the rows are read (loads) or
the device rows are reused (stores). Cost: O(bytes of the batch), 2 x layers + 2 kernels. On
the CPU, whole aligned pages go in one pass instead (``radixkv.memory.native``, when built).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from radixkv.errors import InvalidArgumentError, LengthMismatchError
from radixkv.memory import native
from radixkv.memory.kv_pool import MHATokenToKVPool, MLATokenToKVPool

__all__ = ["HostKVPool"]


class HostKVPool:
    """The host copy of KV pages of one :class:`MHATokenToKVPool` or :class:`MLATokenToKVPool`
    (same dtype and row shape).

    Args:
        kv_pool: the device pool whose pages this tier holds (its per-layer buffers, K and V
            or the one latent, are the page's chunks, in that order).
        num_pages: host pages (ids ``1..num_pages``; the ids come from a
            :class:`~radixkv.allocator.host_pages.HostPageAllocator`).
    Attributes: ``buffer`` (flat uint8), ``pages`` (``[num_pages + 1, page_bytes]``),
    ``page_bytes``, ``device`` (the device pool's), ``pinned``.
    """

    def __init__(self, kv_pool: MHATokenToKVPool | MLATokenToKVPool, num_pages: int) -> None:
        self._bufs: list[tuple[torch.Tensor, ...]]  # per layer: the buffers of a page's chunks, in order
        if isinstance(kv_pool, MHATokenToKVPool):
            self._bufs = [(k, v) for k, v in zip(kv_pool.k_buffer, kv_pool.v_buffer)]
            heads, dim = kv_pool.head_num, kv_pool.head_dim
        elif isinstance(kv_pool, MLATokenToKVPool):
            self._bufs = [(kv,) for kv in kv_pool.kv_buffer]
            heads, dim = 1, kv_pool.kv_cache_dim
        else:
            raise InvalidArgumentError(f"the host tier holds MHA or MLA KV pools, got {type(kv_pool).__name__}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise InvalidArgumentError(f"num_pages must be an int >= 1, got {num_pages!r}")
        self.kv_pool = kv_pool
        self.device = kv_pool.device
        self.num_pages = num_pages
        ps, n_layers, kinds = kv_pool.page_size, kv_pool.layer_num, len(self._bufs[0])
        self._shape = (n_layers, kinds, ps, heads, dim)
        dt = kv_pool.store_dtype
        self.page_bytes = kinds * n_layers * ps * heads * dim * dt.itemsize
        self.pinned = self.device.type == "cuda"
        self.buffer = torch.zeros((num_pages + 1) * self.page_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.pages = self.buffer.view(num_pages + 1, self.page_bytes)
        self._typed = self.buffer.view(dt).view(num_pages + 1, *self._shape)
        # Copies move whole per-layer chunks of a page as the widest integer words that divide
        # them (page-granular, word-wise: several times faster on the CPU than fp16 elements).
        chunk = ps * heads * dim * dt.itemsize
        self._word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if chunk % w.itemsize == 0)
        self._wide = self.buffer.view(self._word).view(num_pages + 1, n_layers, kinds, -1)
        self._staging: torch.Tensor | None = None  # CPU snapshots (reused: no fresh pages to fault in)
        self._stream = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())

    def _check(self, pages: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).cpu()
        r = torch.as_tensor(rows).to(self.device, torch.int64).reshape(-1)
        if r.numel() != p.numel() * self._shape[2]:
            raise LengthMismatchError(f"{p.numel()} pages need {p.numel() * self._shape[2]} rows, got {r.numel()}")
        if p.numel() and (int(p.min()) < 1 or int(p.max()) > self.num_pages):
            raise InvalidArgumentError(f"host pages must lie in [1, {self.num_pages}]")
        return p, r

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """The device rows (whole pages) as host page rows ``[pages, page_bytes]`` (uint8,
        CPU, a fresh tensor): one indexed read per layer and buffer, one transfer."""
        r = torch.as_tensor(rows).to(self.device, torch.int64).reshape(-1)
        _, _, ps, h, d = self._shape
        n = r.numel() // ps
        stage = torch.empty((n, *self._shape), dtype=self.kv_pool.store_dtype, device=self.device)
        for layer, bufs in enumerate(self._bufs):
            for kind, buf in enumerate(bufs):
                stage[:, layer, kind] = buf[r].view(n, ps, h, d)
        return stage.cpu().view(torch.uint8).view(n, self.page_bytes)

    def store(self, pages: torch.Tensor, rows: torch.Tensor) -> torch.cuda.Event | None:
        """Copy device ``rows`` (``page_size`` per page, in order) into host ``pages``.
        On CUDA the copy runs on the side stream; wait on the returned event before the
        device rows are reused. Raises (nothing copied) for mismatched lengths or bad ids."""
        p, r = self._check(pages, rows)
        if not p.numel():
            return None
        if self._stream is None:
            if not self._copy_compiled(p, r, to_device=False):
                self.pages.index_copy_(0, p, self.gather(r))
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self.pages.index_copy_(0, p, self.gather(r))
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self._stream)
        return ev

    def snapshot(self, pages: torch.Tensor) -> torch.Tensor:
        """A copy of host ``pages`` (one indexed read), for :meth:`load_from`: the pages may be
        freed and reused once it is taken. On CUDA a fresh pinned tensor; on the CPU a staging
        buffer the next snapshot reuses, so load it before taking another."""
        p = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).cpu()
        if p.numel() and (int(p.min()) < 1 or int(p.max()) > self.num_pages):
            raise InvalidArgumentError(f"host pages must lie in [1, {self.num_pages}]")
        n = p.numel()
        if self.pinned:
            out = torch.empty((n, *self._wide.shape[1:]), dtype=self._word, pin_memory=True)
        else:
            if self._staging is None or self._staging.shape[0] < n:
                self._staging = torch.empty((n, *self._wide.shape[1:]), dtype=self._word)
            out = self._staging[:n]
        torch.index_select(self._wide, 0, p, out=out)
        return out.view(self.kv_pool.store_dtype).view(n, *self._shape)

    def load_from(self, src: torch.Tensor, rows: torch.Tensor) -> torch.cuda.Event | None:
        """Copy a :meth:`snapshot` into device ``rows`` (``page_size`` per page): one
        transfer, one indexed write per layer and buffer. On CUDA on the side stream: a reader
        of the rows waits on the returned event first."""
        r = torch.as_tensor(rows).to(self.device, torch.int64).reshape(-1)
        if r.numel() != src.shape[0] * self._shape[2]:
            raise LengthMismatchError(f"{src.shape[0]} pages need {src.shape[0] * self._shape[2]} rows, "
                                      f"got {r.numel()}")
        if not r.numel():
            return None
        if self._stream is None:
            self._scatter(src, r)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._scatter(src.to(self.device, non_blocking=True), r)
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ev.record(self._stream)
        return ev

    def load(self, pages: torch.Tensor, rows: torch.Tensor) -> torch.cuda.Event | None:
        """Copy host ``pages`` into device ``rows``: :meth:`load_from` of a :meth:`snapshot`."""
        p, r = self._check(pages, rows)
        if self._stream is None and self._copy_compiled(p, r, to_device=True):
            return None
        return self.load_from(self.snapshot(p), r)

    def _copy_compiled(self, pages: torch.Tensor, rows: torch.Tensor, *, to_device: bool) -> bool:
        """Host ``pages`` <-> device ``rows`` in one pass (one memcpy per page and layer and
        buffer, :mod:`radixkv.memory.native`) when it is built, the pool is on the CPU and the
        rows are whole aligned pages; False (nothing copied) otherwise."""
        if native.copy_pages is None or self.device.type != "cpu" or not pages.numel():
            return False
        ids = self._page_ids(rows)
        if ids is None:
            return False
        bufs = [b for layer in self._bufs for b in layer]
        if not all(b.is_contiguous() for b in bufs):
            return False
        chunk = self.page_bytes // len(bufs)
        native.copy_pages(self.buffer.data_ptr(), self.num_pages + 1, self.page_bytes, chunk,
                   pages.contiguous().numpy(), tuple(b.data_ptr() for b in bufs),
                   min(b.numel() * b.element_size() for b in bufs) // chunk,
                   ids.to(torch.int64).contiguous().numpy(), to_device)
        return True

    def _scatter(self, src: torch.Tensor, rows: torch.Tensor) -> None:
        n_layers, _, ps, h, d = self._shape
        n = src.shape[0]
        ids = self._page_ids(rows)
        if ids is not None:  # whole pages: page-granular word copies, no row gather
            words = src.reshape(n, n_layers, len(self._bufs[0]), -1).view(self._word)
            for layer, bufs in enumerate(self._bufs):
                for kind, buf in enumerate(bufs):
                    buf.view(-1, ps * h * d).view(self._word).index_copy_(0, ids, words[:, layer, kind])
            return None
        for layer, bufs in enumerate(self._bufs):
            for kind, buf in enumerate(bufs):
                buf[rows] = src[:, layer, kind].reshape(n * ps, h, d)
        return None

    def _page_ids(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The device page ids of ``rows`` when they are whole, aligned pages and on the CPU
        (a vector check; on CUDA it would cost a sync), else ``None``."""
        ps = self._shape[2]
        if rows.device.type != "cpu":
            return None
        pages = rows.view(-1, ps)
        first = pages[:, 0]
        if ps > 1 and not (bool((first % ps == 0).all())
                           and torch.equal(pages - first[:, None], torch.arange(ps).expand_as(pages))):
            return None
        return first // ps

    def page_buffers(self, pages: Sequence[int]) -> list[list[memoryview]]:
        """Each page's destination for a storage read: its row, one contiguous range (the
        layout is page-first), as :data:`radixkv.contracts.PageBuffers` of byte memoryviews
        (~0.3 us a page). O(pages). Raises for ids outside ``1..num_pages``."""
        if pages and (min(pages) < 1 or max(pages) > self.num_pages):
            raise InvalidArgumentError(f"host pages must lie in [1, {self.num_pages}]")
        flat, pb = self.buffer.numpy().data, self.page_bytes
        return [[flat[int(p) * pb:(int(p) + 1) * pb]] for p in pages]

    def write_rows(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Put page rows read from storage (``[len(pages), page_bytes]`` uint8) into ``pages``."""
        p = torch.as_tensor(pages, dtype=torch.int64).reshape(-1).cpu()
        if tuple(data.shape) != (p.numel(), self.page_bytes):
            raise LengthMismatchError(f"expected rows {(p.numel(), self.page_bytes)}, got {tuple(data.shape)}")
        self.pages.index_copy_(0, p, data)
