"""``write_cache_indices``: fill the req_to_token rows of an extend batch.

For every request ``i`` of the batch::

    req_to_token[req_pool_indices[i], 0:prefix_lens[i]]           = prefix_tensors[i]
    req_to_token[req_pool_indices[i], prefix_lens[i]:seq_lens[i]] = out_cache_loc[pt:pt + extend_lens[i]]

where ``pt`` is the sum of the extend lengths of the requests before ``i``. Two
implementations compute the same table: :func:`write_cache_indices_torch` (the reference,
CPU: one scatter, O(sum(seq_lens)) vectorized) and :func:`write_cache_indices_triton` (CUDA:
one program per request). :func:`write_cache_indices` validates everything first (a bad
batch writes nothing) and dispatches with :func:`radixkv.kernels.triton_util.use_triton`.
How each path works: ``docs/internals.md``, "Filling request rows".
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from radixkv.contracts import IndexLike
from radixkv.errors import InvalidArgumentError, InvalidIndexError, LengthMismatchError, describe_ids
from radixkv.kernels.triton_util import HAS_TRITON, tl, triton, triton_runnable, use_triton

__all__ = [
    "WriteBatch",
    "write_cache_indices",
    "write_cache_indices_torch",
    "write_cache_indices_triton",
    "prepare_write_batch",
]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


class WriteBatch(NamedTuple):
    """A validated extend batch, on the table's device (int64 unless noted).

    ``flat_prefix`` is the concatenation of the prefix tensors; ``prefix_starts`` and
    ``extend_starts`` are exclusive prefix sums of ``prefix_lens`` and ``extend_lens``
    (where request ``i``'s prefix / new slots begin). The ``*_cpu`` fields are host copies.
    """

    req_pool_indices: torch.Tensor
    prefix_lens: torch.Tensor
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    prefix_starts: torch.Tensor
    extend_starts: torch.Tensor
    flat_prefix: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_cpu: torch.Tensor
    prefix_lens_cpu: torch.Tensor


def _as_cpu_int64(x: IndexLike, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.numel() == 0 and t.dim() == 1:
        return torch.zeros(0, dtype=torch.int64)
    if t.dtype not in _INT_DTYPES:
        raise InvalidArgumentError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() != 1:
        raise InvalidArgumentError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t.to(device="cpu", dtype=torch.int64)


def _exclusive_cumsum(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(lens)
    if lens.numel() > 1:
        torch.cumsum(lens[:-1], dim=0, out=out[1:])
    return out


def prepare_write_batch(
    req_to_token: torch.Tensor,
    req_pool_indices: IndexLike,
    prefix_lens: IndexLike,
    seq_lens: IndexLike,
    extend_lens: IndexLike,
    out_cache_loc: torch.Tensor,
    prefix_tensors: Sequence[torch.Tensor],
    *,
    allow_row_zero: bool = False,
) -> WriteBatch:
    """Validate an extend batch against ``req_to_token`` and move it to its device.

    Raises:
        LengthMismatchError: per-request arrays of different lengths; a prefix tensor whose
            length is not ``prefix_lens[i]``; ``seq_lens != prefix_lens + extend_lens``;
            ``len(out_cache_loc) != sum(extend_lens)``.
        InvalidIndexError: a row outside the table (or the padding row 0 unless
            ``allow_row_zero``), or a ``seq_len`` beyond the table's width.
        InvalidArgumentError: wrong dtypes or shapes, negative lengths, a row used twice.
    O(batch) host work plus one concatenation of the prefixes.
    """
    _check_table_and_slots(req_to_token, out_cache_loc)
    rows = _as_cpu_int64(req_pool_indices, "req_pool_indices")
    pre = _as_cpu_int64(prefix_lens, "prefix_lens")
    seq = _as_cpu_int64(seq_lens, "seq_lens")
    ext = _as_cpu_int64(extend_lens, "extend_lens")
    bs = rows.numel()
    _check_lengths(rows, pre, seq, ext, len(prefix_tensors))
    _check_rows(rows, seq, req_to_token.shape, allow_row_zero)
    plens = _check_prefixes(prefix_tensors, pre, ext, out_cache_loc)

    dev = req_to_token.device
    if bs and sum(plens):
        flat_prefix = torch.cat([t.reshape(-1).to(device=dev, dtype=torch.int64) for t in prefix_tensors if t.numel()])
    else:
        flat_prefix = torch.empty(0, dtype=torch.int64, device=dev)
    return WriteBatch(
        req_pool_indices=rows.to(dev),
        prefix_lens=pre.to(dev),
        seq_lens=seq.to(dev),
        extend_lens=ext.to(dev),
        prefix_starts=_exclusive_cumsum(pre).to(dev),
        extend_starts=_exclusive_cumsum(ext).to(dev),
        flat_prefix=flat_prefix,
        out_cache_loc=out_cache_loc.to(device=dev, dtype=torch.int64),
        seq_lens_cpu=seq,
        prefix_lens_cpu=pre,
    )


def _check_table_and_slots(req_to_token: torch.Tensor, out_cache_loc: torch.Tensor) -> None:
    """``req_to_token`` a 2-D and ``out_cache_loc`` a 1-D integer tensor."""
    if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2:
        raise InvalidArgumentError("req_to_token must be a 2-D tensor")
    if req_to_token.dtype not in _INT_DTYPES:
        raise InvalidArgumentError(f"req_to_token must be an integer tensor, got {req_to_token.dtype}")
    if not isinstance(out_cache_loc, torch.Tensor) or out_cache_loc.dim() != 1:
        raise InvalidArgumentError("out_cache_loc must be a 1-D tensor")
    if out_cache_loc.dtype not in _INT_DTYPES:
        raise InvalidArgumentError(f"out_cache_loc must be an integer tensor, got {out_cache_loc.dtype}")


def _check_lengths(rows: torch.Tensor, pre: torch.Tensor, seq: torch.Tensor, ext: torch.Tensor,
                   n_prefixes: int) -> None:
    """The per-request arrays (and ``n_prefixes`` prefix tensors) of one length, the lengths
    non-negative and ``seq == pre + ext``. O(batch)."""
    bs = rows.numel()
    sizes = {"req_pool_indices": bs, "prefix_lens": pre.numel(), "seq_lens": seq.numel(),
             "extend_lens": ext.numel(), "prefix_tensors": n_prefixes}
    if len(set(sizes.values())) != 1:
        raise LengthMismatchError(f"per-request arrays differ in length: {sizes}")
    if bs and (int(pre.min()) < 0 or int(ext.min()) < 0):
        raise InvalidArgumentError("prefix_lens and extend_lens must be non-negative")
    bad = torch.nonzero(seq != pre + ext).flatten()
    if bad.numel():
        raise LengthMismatchError(
            f"seq_lens != prefix_lens + extend_lens for batch entries {describe_ids(bad.tolist())}"
        )


def _check_rows(rows: torch.Tensor, seq: torch.Tensor, shape: tuple[int, ...], allow_row_zero: bool) -> None:
    """Each row inside the table of ``shape`` (row 0 only with ``allow_row_zero``), none twice,
    and each ``seq_len`` within its width. O(batch log batch)."""
    n_rows, width = shape
    lo = 0 if allow_row_zero else 1
    bad = torch.nonzero((rows < lo) | (rows >= n_rows)).flatten()
    if bad.numel():
        raise InvalidIndexError(
            f"req_pool_indices {describe_ids(rows[bad].tolist())} outside rows [{lo}, {n_rows})"
        )
    if torch.unique(rows).numel() != rows.numel():
        vals, counts = torch.unique(rows, return_counts=True)
        raise InvalidArgumentError(f"rows written twice in one batch: {describe_ids(vals[counts > 1].tolist())}")
    bad = torch.nonzero(seq > width).flatten()
    if bad.numel():
        raise InvalidIndexError(
            f"seq_lens of batch entries {describe_ids(bad.tolist())} exceed the table width {width}"
        )


def _check_prefixes(prefix_tensors: Sequence[torch.Tensor], pre: torch.Tensor, ext: torch.Tensor,
                    out_cache_loc: torch.Tensor) -> list[int]:
    """Prefix tensor ``i`` of ``pre[i]`` integer slots, ``out_cache_loc`` of ``sum(ext)``;
    returns the prefix lengths. O(batch)."""
    plens = [int(t.numel()) for t in prefix_tensors]
    mism = [i for i, (a, b) in enumerate(zip(plens, pre.tolist())) if a != b]
    if mism:
        raise LengthMismatchError(f"prefix tensors whose length is not prefix_lens[i]: entries {describe_ids(mism)}")
    n_ext = int(ext.sum()) if ext.numel() else 0
    if out_cache_loc.numel() != n_ext:
        raise LengthMismatchError(f"out_cache_loc has {out_cache_loc.numel()} slots, extend_lens sum to {n_ext}")
    for i, t in enumerate(prefix_tensors):
        if t.numel() and t.dtype not in _INT_DTYPES:
            raise InvalidArgumentError(f"prefix_tensors[{i}] must be integer, got {t.dtype}")
    return plens


def write_cache_indices_torch(req_to_token: torch.Tensor, b: WriteBatch) -> None:
    """Reference path: one flat value vector and one flat destination index, one scatter.

    The values, request after request, are its prefix slots then its new slots: one
    ``cat`` of views (``split`` of the flat prefix and of ``out_cache_loc``). The
    destination of flat position ``k`` of request ``i`` is ``row_i * width + (k -
    seq_start_i)``: one ``repeat_interleave`` and one add. Complexity: O(sum(seq_lens))
    vectorized work; the only Python loop is over requests (building the list of views).
    """
    seq_cpu = b.seq_lens_cpu
    total = int(seq_cpu.sum()) if seq_cpu.numel() else 0
    if total == 0:
        return
    dev = req_to_token.device
    pre_cpu = b.prefix_lens_cpu
    ext_cpu = (seq_cpu - pre_cpu).tolist()
    prefix_parts = torch.split(b.flat_prefix, pre_cpu.tolist())
    new_parts = torch.split(b.out_cache_loc, ext_cpu)
    values = torch.cat([t for pair in zip(prefix_parts, new_parts) for t in pair])
    width = req_to_token.shape[1]
    base = b.req_pool_indices * width - _exclusive_cumsum(b.seq_lens)
    dest = torch.arange(total, device=dev) + torch.repeat_interleave(base, b.seq_lens, output_size=total)
    values = values.to(req_to_token.dtype)
    if req_to_token.is_contiguous():
        req_to_token.view(-1).index_copy_(0, dest, values)
    else:
        req_to_token.index_put_((torch.div(dest, width, rounding_mode="floor"), dest % width), values)


if HAS_TRITON:

    @triton.jit
    def _write_cache_indices_kernel(
        req_to_token,
        stride,
        req_pool_indices,
        prefix_lens,
        seq_lens,
        prefix_starts,
        extend_starts,
        flat_prefix,
        out_cache_loc,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row = tl.load(req_pool_indices + pid).to(tl.int64)
        pre_len = tl.load(prefix_lens + pid)
        seq_len = tl.load(seq_lens + pid)
        pre_start = tl.load(prefix_starts + pid)
        ext_start = tl.load(extend_starts + pid)
        base = req_to_token + row * stride
        for off in range(0, pre_len, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < pre_len
            v = tl.load(flat_prefix + pre_start + cols, mask=mask, other=0)
            tl.store(base + cols, v.to(req_to_token.dtype.element_ty), mask=mask)
        ext_len = seq_len - pre_len
        for off in range(0, ext_len, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < ext_len
            v = tl.load(out_cache_loc + ext_start + cols, mask=mask, other=0)
            tl.store(base + pre_len + cols, v.to(req_to_token.dtype.element_ty), mask=mask)


def write_cache_indices_triton(req_to_token: torch.Tensor, b: WriteBatch, block: int = 512) -> None:
    """Triton path: one program per request, ``block`` columns per loop step."""
    if not triton_runnable(req_to_token.device):
        raise InvalidArgumentError(
            f"the Triton path cannot run on {req_to_token.device} (needs CUDA or TRITON_INTERPRET=1)"
        )
    if req_to_token.stride(1) != 1:
        raise InvalidArgumentError("req_to_token rows must be contiguous")
    bs = b.req_pool_indices.numel()
    if bs == 0:
        return
    dev = req_to_token.device
    flat_prefix = b.flat_prefix if b.flat_prefix.numel() else torch.zeros(1, dtype=torch.int64, device=dev)
    out = b.out_cache_loc if b.out_cache_loc.numel() else torch.zeros(1, dtype=torch.int64, device=dev)
    _write_cache_indices_kernel[(bs,)](
        req_to_token,
        req_to_token.stride(0),
        b.req_pool_indices,
        b.prefix_lens,
        b.seq_lens,
        b.prefix_starts,
        b.extend_starts,
        flat_prefix,
        out,
        BLOCK=block,
    )


def write_cache_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: IndexLike,
    prefix_lens: IndexLike,
    seq_lens: IndexLike,
    extend_lens: IndexLike,
    out_cache_loc: torch.Tensor,
    prefix_tensors: Sequence[torch.Tensor],
    *,
    impl: str | None = None,
    allow_row_zero: bool = False,
) -> None:
    """Write the prefix rows then the new rows of every request into ``req_to_token``.

    ``req_to_token``: the ``(rows, max_context_len)`` integer table, written in place;
    ``req_pool_indices``, ``prefix_lens``, ``seq_lens``, ``extend_lens``: one entry per
    request; ``out_cache_loc``: the new KV slots of the batch, request after request;
    ``prefix_tensors``: per request, the KV slots of its cached prefix; ``impl``:
    ``"torch"``, ``"triton"``, or ``None`` (:func:`~radixkv.kernels.triton_util.use_triton`
    of the table's device); ``allow_row_zero``: let the padding row 0 be written.
    Raises the errors of :func:`prepare_write_batch`, before any write.
    """
    b = prepare_write_batch(
        req_to_token, req_pool_indices, prefix_lens, seq_lens, extend_lens, out_cache_loc,
        prefix_tensors, allow_row_zero=allow_row_zero,
    )
    if impl is None:
        impl = "triton" if use_triton(req_to_token.device) else "torch"
    if impl == "triton":
        write_cache_indices_triton(req_to_token, b)
    elif impl == "torch":
        write_cache_indices_torch(req_to_token, b)
    else:
        raise InvalidArgumentError(f"impl must be 'torch', 'triton' or None, got {impl!r}")
