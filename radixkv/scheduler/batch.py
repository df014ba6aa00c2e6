"""``Batch``: the memory-facing part of SGLang's ``ScheduleBatch``.

A batch is a list of requests plus the pools and the tree cache they draw from. The flow
functions (:mod:`radixkv.scheduler.flow`) fill in the per-request tensors: after
``alloc_for_extend`` or ``alloc_for_decode`` the batch holds the rows (``req_pool_indices``),
lengths and the new KV slots (``out_cache_loc``) of the step, ready for a forward pass.

Lengths follow SGLang: ``prefix_lens[i]`` tokens of request ``i`` were already in KV slots
before the step (matched in the tree, or committed in an earlier chunk), ``extend_lens[i]``
tokens get new slots in the step, and ``seq_lens[i] = prefix_lens[i] + extend_lens[i]``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from radixkv.contracts import KVAllocator, KVPool, PrefixCache, ReqToTokenTable
from radixkv.errors import InvalidArgumentError, InvariantError, describe_ids
from radixkv.scheduler.req import Req

__all__ = ["Batch", "ForwardMode"]


class ForwardMode:
    """What the last flow call prepared the batch for."""

    IDLE = "idle"
    EXTEND = "extend"
    DECODE = "decode"


@dataclass(eq=False)
class Batch:
    """Requests of one scheduling step and the memory they use.

    Args:
        reqs: the requests (distinct objects).
        req_to_token_pool, allocator, tree_cache: the table, the KV slot allocator, the tree.
        fill_lens: for the next extend only, how many tokens of each request's ``fill_ids``
            should have KV slots afterwards (``None``: all of them).
        kv_pool: the KV buffers the slots index (optional; the flow never touches them).

    The flow fills (``None`` before) ``req_pool_indices``, ``seq_lens``, ``seq_lens_cpu``,
    ``prefix_lens``, ``extend_lens``, ``out_cache_loc``, ``forward_mode``, with a track
    buffer ``mamba_track_indices`` / ``mamba_track_seqlens``, with tiers ``tier_lens`` (docs/).
    """

    reqs: list[Req]
    req_to_token_pool: ReqToTokenTable
    allocator: KVAllocator
    tree_cache: PrefixCache
    fill_lens: Sequence[int] | None = None
    kv_pool: KVPool | None = None
    req_pool_indices: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    extend_lens: torch.Tensor | None = None
    out_cache_loc: torch.Tensor | None = None
    mamba_track_indices: torch.Tensor | None = None
    mamba_track_seqlens: torch.Tensor | None = None
    forward_mode: str = field(default=ForwardMode.IDLE)
    tier_lens: list[tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        self.reqs = list(self.reqs)
        if len({id(r) for r in self.reqs}) != len(self.reqs):
            raise InvalidArgumentError("a request appears twice in one batch")
        if self.fill_lens is not None and len(self.fill_lens) != len(self.reqs):
            raise InvalidArgumentError(
                f"fill_lens has {len(self.fill_lens)} entries for {len(self.reqs)} requests"
            )

    # -- derived ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device of the request-to-token table (where the batch tensors live)."""
        return self.req_to_token_pool.device

    @property
    def page_size(self) -> int:
        return int(getattr(self.allocator, "page_size", 1))

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def extend_num_tokens(self) -> int:
        """New slots of the last extend (0 before one)."""
        return 0 if self.extend_lens is None else int(self.extend_lens.sum())

    def is_empty(self) -> bool:
        return not self.reqs

    def target_len(self, i: int) -> int:
        """Tokens of request ``i`` that should have KV slots after the next extend."""
        if self.fill_lens is None:
            return self.reqs[i].seq_len
        return int(self.fill_lens[i])

    # -- membership ------------------------------------------------------------------------
    def filter(self, keep: Callable[[Req], bool]) -> Batch:
        """A new batch of the requests for which ``keep(req)`` is true (same pools; the
        per-step tensors are rebuilt by the next flow call). O(bs)."""
        return Batch([r for r in self.reqs if keep(r)], self.req_to_token_pool, self.allocator,
                     self.tree_cache, kv_pool=self.kv_pool)

    def merge(self, other: Batch) -> Batch:
        """The requests of both batches (which must share their pools and tree cache)."""
        if (other.req_to_token_pool is not self.req_to_token_pool or other.allocator is not self.allocator
                or other.tree_cache is not self.tree_cache):
            raise InvalidArgumentError("cannot merge batches that use different pools or caches")
        return Batch(self.reqs + other.reqs, self.req_to_token_pool, self.allocator,
                     self.tree_cache, kv_pool=self.kv_pool)

    # -- invariants ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """The batch's requests and the memory they reference agree.

        Checks: every request holds a distinct row; after a flow call the batch tensors
        match the requests (rows, ``seq_lens == kv_committed_len``); every KV slot in
        ``req_to_token[row, :kv_committed_len]`` is allocated (not free in the allocator);
        and no slot a request holds privately (columns ``cache_protected_len ..
        kv_committed_len``) appears in another request's row. Raises ``InvariantError``
        naming the requests and slots. O(total committed tokens).
        """
        rows = [r.req_pool_idx for r in self.reqs]
        missing = [r.rid for r in self.reqs if r.req_pool_idx is None]
        if missing and self.forward_mode != ForwardMode.IDLE:
            raise InvariantError(f"requests in a prepared batch hold no row: {missing}")
        held = [x for x in rows if x is not None]
        if len(set(held)) != len(held):
            dup = {x for x in held if held.count(x) > 1}
            raise InvariantError(f"requests share rows {describe_ids(dup)}")
        if self.forward_mode != ForwardMode.IDLE and self.req_pool_indices is not None:
            if self.req_pool_indices.tolist() != rows:
                raise InvariantError(f"req_pool_indices {self.req_pool_indices.tolist()} != rows {rows}")
            committed = [r.kv_committed_len for r in self.reqs]
            if self.seq_lens_cpu is not None and self.seq_lens_cpu.tolist() != committed:
                raise InvariantError(f"seq_lens {self.seq_lens_cpu.tolist()} != kv_committed_len {committed}")
        table = self.req_to_token_pool.req_to_token
        slots, private = [], []
        for r in self.reqs:
            if r.req_pool_idx is None or r.kv_committed_len == 0:
                continue
            if r.cache_protected_len > r.kv_committed_len:
                raise InvariantError(
                    f"request {r.rid!r}: cache_protected_len {r.cache_protected_len} > "
                    f"kv_committed_len {r.kv_committed_len}"
                )
            row = table[r.req_pool_idx, : r.kv_committed_len].to(torch.int64)
            slots.append(row)
            private.append(row[r.cache_protected_len:])
        if not slots:
            return
        all_slots = torch.cat(slots)
        free = torch.as_tensor(self.allocator.is_free(all_slots))
        if bool(free.any()):
            raise InvariantError(
                f"running requests reference free KV slots: {describe_ids(all_slots[free].tolist())}"
            )
        priv = torch.cat(private)
        if priv.numel() > 1:
            s = torch.sort(priv).values
            rep = s[1:] == s[:-1]
            if bool(rep.any()):
                raise InvariantError(
                    f"KV slots held privately by two requests (duplicated): "
                    f"{describe_ids(torch.unique(s[1:][rep]).tolist())}"
                )
