"""``ReqToTokenPool``: the request-to-token table (SGLang's table 1).

``req_to_token[r, j]`` is the KV index of token ``j`` of the request that holds row ``r``.
Rows ``1..size`` are handed to requests; row 0 is padding (CUDA-graph padded batches use
``req_pool_idx = 0``, so dummy reads and writes land there). Free rows are kept by one
:class:`~radixkv.allocator.FreeSlots` on the host (row ids are host ints stored in
``Req.req_pool_idx``); the table itself lives on the pool's device, in one
:class:`~radixkv.memory.arena.Arena`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np
import torch

from radixkv.allocator import FreeSlots
from radixkv.contracts import PoolRequest, TableIndex
from radixkv.errors import (
    InvalidArgumentError,
    InvalidIndexError,
    InvariantError,
    LengthMismatchError,
    describe_ids,
)
from radixkv.memory.arena import DEFAULT_ALIGNMENT, Arena, plan_layout
from radixkv.validation import check_range, index_tensor


def _positive_int(name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
    return v


class ReqToTokenPool:
    """The ``[size + 1, max_context_len]`` int32 table and its free rows.

    Args:
        size: rows for requests (ids ``1..size``); max_context_len: columns (tokens per request).
        device: where the table lives.
        checks: validate index ranges in :meth:`write` (on CUDA, one device sync per index part).
        buffer: attach to an existing arena buffer (see ``Arena``) instead of allocating.
        enable_memory_saver: SGLang's signature; radixkv has no memory saver, it changes nothing.

    ``alloc`` / ``free`` are O(number of requests) host work; ``write`` is one scatter.
    """

    TABLE = "req_to_token"

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu", *,
                 checks: bool = True, buffer: torch.Tensor | None = None,
                 alignment: int = DEFAULT_ALIGNMENT, enable_memory_saver: bool = False):
        self.enable_memory_saver = bool(enable_memory_saver)
        self.size = _positive_int("size", size)
        self.max_context_len = _positive_int("max_context_len", max_context_len)
        self.device = torch.device(device)
        self.checks = checks
        entries = [(self.TABLE, (size + 1, max_context_len), torch.int32)] + self._extra_entries()
        self.arena = Arena(plan_layout(entries, alignment), self.device, buffer)
        self.req_to_token: torch.Tensor = self.arena[self.TABLE]
        self.free_slots = FreeSlots(size, device="cpu")

    def _extra_entries(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """More tensors a subclass wants in the same arena (none here)."""
        return []

    # -- rows -----------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free rows."""
        return int(self.free_slots.available())

    def _held_rows(self, reqs: Sequence[PoolRequest]) -> list[int]:
        """Validate ``reqs`` for ``alloc``: distinct objects, and every held row in range,
        allocated and held by one request only. Returns the held rows."""
        if len({id(r) for r in reqs}) != len(reqs):
            raise InvalidArgumentError("the same request appears twice in one alloc call")
        held = [self._host_row(r) for r in reqs if r.req_pool_idx is not None]
        if not held:
            return held
        if len(set(held)) != len(held):
            raise InvalidArgumentError(f"two requests hold the same row: {sorted(held)}")
        rows = torch.tensor(held, dtype=torch.int64)
        free = self.free_slots.is_free(rows)
        if bool(free.any()):
            raise InvalidArgumentError(
                f"requests hold rows that are free (stale req_pool_idx): {describe_ids(rows[free].tolist())}")
        return held

    def alloc(self, reqs: Iterable[PoolRequest]) -> list[int] | None:
        """Give each request without a ``req_pool_idx`` a free row; keep the row of one that has
        it (chunked prefill). All or nothing.

        Returns:
            The row of every request, in order, or ``None`` when too few rows are free (then
            nothing changes).
        Raises (nothing changes): ``InvalidArgumentError`` when a request appears twice, two
            requests claim one row, or a held row is free; ``InvalidIndexError`` when a held
            row is out of range.
        """
        reqs = list(reqs)
        self._held_rows(reqs)
        new = [r for r in reqs if r.req_pool_idx is None]
        if len(new) > self.available_size():
            return None
        if new:
            rows = self.free_slots.alloc(len(new))
            if rows is None:  # pragma: no cover - available_size() said there was room
                return None
            for r, row in zip(new, rows.tolist()):
                r.req_pool_idx = int(row)
        return cast(list[int], [r.req_pool_idx for r in reqs])  # every request holds a row now

    def _host_row(self, req: PoolRequest) -> int:
        """``req.req_pool_idx`` checked (on the host, no tensor op) to be an int in ``1..size``.

        Raises ``InvalidArgumentError`` (none, or not an int) / ``InvalidIndexError``."""
        row = getattr(req, "req_pool_idx", None)
        if row is None:
            raise InvalidArgumentError(f"request {getattr(req, 'rid', req)!r} holds no row")
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
            raise InvalidArgumentError(f"req_pool_idx must be an int, got {row!r}")
        if not 1 <= row <= self.size:
            raise InvalidIndexError(f"req_pool_idx {int(row)} out of range [1, {self.size}]")
        return int(row)

    def free(self, req: PoolRequest) -> None:
        """Return ``req``'s row and set ``req.req_pool_idx = None``. O(1) host work plus one
        ``FreeSlots.free`` (which validates before it mutates).

        Raises (nothing changes): ``InvalidArgumentError`` (no row), ``InvalidIndexError`` (row
        out of range), ``DoubleFreeError`` (row already free).
        """
        row = self._host_row(req)
        self.free_slots.free(torch.tensor([row], dtype=torch.int64))
        req.req_pool_idx = None

    def clear(self) -> None:
        """Every row free again (the table's contents are left as they are)."""
        self.free_slots.clear()

    # -- the table ------------------------------------------------------------------------
    def _check_index_part(self, part: object, bound: int, what: str) -> None:
        if part is None or part is Ellipsis or isinstance(part, slice):
            return
        if isinstance(part, bool):
            raise InvalidArgumentError(f"{what} index must be an integer, got {part!r}")
        if isinstance(part, int):
            if not 0 <= part < bound:
                raise InvalidIndexError(f"{what} index {part} out of range [0, {bound})")
            return
        if isinstance(part, torch.Tensor) and part.device != self.device:
            raise InvalidArgumentError(f"{what} index is on {part.device}, the table on {self.device}")
        check_range(index_tensor(part, self.device, f"{what} index"), 0, bound, f"{what} index")

    def write(self, indices: TableIndex, values: object) -> None:
        """``req_to_token[indices] = values`` (SGLang's ``write``), values cast to int32.

        ``indices`` is anything torch indexing takes, typically ``(row, slice)`` or
        ``(rows_tensor, cols_tensor)``. With ``checks`` on, integer / tensor parts are
        range-checked (rows ``[0, size]``, columns ``[0, max_context_len)``; negative indices
        are rejected).

        Raises (nothing written): ``InvalidIndexError``, ``InvalidArgumentError`` (non-integer
        values or index, other device), ``LengthMismatchError`` (values do not fit the target).
        """
        if isinstance(values, torch.Tensor) and values.device != self.device:
            raise InvalidArgumentError(f"values are on {values.device}, the table on {self.device}")
        try:
            vals = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidArgumentError(f"values must be integers: {e}") from None
        if vals.dtype == torch.bool or vals.dtype.is_floating_point or vals.dtype.is_complex:
            raise InvalidArgumentError(f"values must be integers, got dtype {vals.dtype}")
        vals = vals.to(device=self.device, dtype=torch.int32)
        if self.checks:
            parts = indices if isinstance(indices, tuple) else (indices,)
            if len(parts) > 2:
                raise InvalidArgumentError(f"req_to_token is 2-D, got {len(parts)} indices")
            self._check_index_part(parts[0], self.size + 1, "row")
            if len(parts) == 2:
                self._check_index_part(parts[1], self.max_context_len, "column")
        try:
            self.req_to_token[indices] = vals
        except IndexError as e:  # torch's own range check (checks off), before any write
            raise InvalidIndexError(f"req_to_token index out of range: {e}") from None
        except RuntimeError as e:  # shape checks run before anything is written
            raise LengthMismatchError(f"cannot write values of shape {tuple(vals.shape)} "
                                      f"at {indices!r}: {e}") from None

    # -- invariants -----------------------------------------------------------------------
    def check_invariants(self, reqs: Iterable[PoolRequest] | None = None) -> None:
        """The free-row structure is sound (no leaked / duplicated rows, row 0 never free), and
        the table still aliases its arena. Given ``reqs`` (every live request), also: the rows
        in use are exactly the rows they hold, each held once. O(size). Raises
        ``InvariantError`` naming the rows."""
        self.free_slots.check_invariants()
        if reqs is not None:
            self._check_held_rows(reqs)
        self.arena.check_invariants()
        if self.req_to_token is not self.arena.views.get(self.TABLE) \
                or tuple(self.req_to_token.shape) != (self.size + 1, self.max_context_len) \
                or self.req_to_token.dtype != torch.int32:
            raise InvariantError(f"req_to_token (shape {tuple(self.req_to_token.shape)}, dtype "
                                 f"{self.req_to_token.dtype}) is not the arena's int32 table")

    def _check_held_rows(self, reqs: Iterable[PoolRequest]) -> None:
        held = [int(r.req_pool_idx) for r in reqs if r.req_pool_idx is not None]
        counts = torch.bincount(torch.tensor(held, dtype=torch.int64).clamp(0, self.size + 1),
                                minlength=self.size + 2)
        dup = torch.nonzero(counts[:self.size + 1] > 1).flatten().tolist()
        oob = [h for h in held if not 1 <= h <= self.size]
        if dup or oob:
            raise InvariantError(f"rows held by two requests: {describe_ids(dup)}; "
                                 f"held rows out of range: {describe_ids(oob)}")
        in_use = ~self.free_slots.is_free(torch.arange(0, self.size + 1)).cpu()
        in_use[0] = False
        held_mask = counts[:self.size + 1] > 0
        leaked = torch.nonzero(in_use & ~held_mask).flatten().tolist()
        stale = torch.nonzero(held_mask & ~in_use).flatten().tolist()
        if leaked or stale:
            raise InvariantError(f"rows in use but held by no request (leaked): {describe_ids(leaked)}; "
                                 f"rows held by a request but free: {describe_ids(stale)}")
