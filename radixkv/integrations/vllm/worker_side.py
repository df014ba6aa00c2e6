"""The worker half of the connector: copies between the manager's KV pool and vLLM's cache.

The manager's pools are mapped zero-copy (``client.worker_buffers``: a shared-memory file on
CPU, CUDA IPC on GPU), once per manager epoch; only the session's layout travels over gRPC.
The worker opens a session just to read that layout, maps the pools, and detaches.

A step's loads run before the forward (``load``), its saves after it (``save``), each as one
gather and one scatter per layer and K/V over all the step's tokens (``index_select`` /
``index_copy_`` on the manager side, advanced indexing on vLLM's ``[blocks, block, heads,
head_dim]`` views): no per-token Python loop.

Tensor parallel: the manager's rows hold every KV head; a rank's worker copies only its
:class:`~radixkv.integrations.vllm.layout.HeadShard` of them (a rank holding replicated heads
that another rank writes loads them and reports its saves done without copying).

An op of a manager epoch this worker cannot map (the manager restarted again) is not done:
its load is reported as failed (vLLM recomputes those blocks) and its save as failed (the
scheduler releases the request). A load from an epoch already mapped is done even if that
manager has died meanwhile: its memory stays mapped, and the rows were locked for this
request when matched, so nobody rewrote them.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixkv.errors import InvalidArgumentError
from radixkv.integrations.vllm.layout import (
    HeadShard,
    KVShape,
    LayoutMismatchError,
    RowGeometry,
    check_same_shape,
    manager_kv_shape,
    paged_kv_views,
    row_geometry,
)
from radixkv.integrations.vllm.link import ManagerLink
from radixkv.integrations.vllm.scheduler_side import CopyOp

if TYPE_CHECKING:  # pragma: no cover
    from radixkv.engine.buffers import WorkerBuffers

__all__ = ["WorkerSide", "SaveReport"]

logger = logging.getLogger("radixkv.integrations.vllm")

_KEEP_EPOCHS = 2  # mapped epochs kept (the current one and the one before a restart)


@dataclass
class SaveReport:
    """Workers -> scheduler, one step: ``saved[req_id]``: saved up to this token; ``failed``:
    requests whose save failed; ``ranks[req_id]``: how many workers reported it saved. Each
    tensor-parallel rank copies its own heads, so a save is done only when every rank's is."""

    saved: dict[str, int] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    ranks: dict[str, int] = field(default_factory=dict)

    def add(self, saved: dict[str, int], failed: set[str]) -> None:
        """One worker's own ``WorkerSide.save`` result (several calls of a step merge)."""
        self.saved.update(saved)
        self.failed |= failed
        self.ranks.update(dict.fromkeys(saved, 1))

    def merged(self, other: SaveReport) -> tuple[dict[str, int], set[str], dict[str, int]]:
        """``(saved, failed, ranks)`` of this and another worker's report: a request is saved as
        far as both saved it; the ranks add up."""
        saved, ranks = dict(self.saved), dict(self.ranks)
        for k, v in other.saved.items():
            saved[k] = min(saved[k], v) if k in saved else v
            ranks[k] = ranks.get(k, 0) + other.ranks.get(k, 0)
        return saved, self.failed | other.failed, ranks

    def complete(self, world_size: int) -> tuple[dict[str, int], set[str]]:
        """``(saved, failed)`` for the scheduler: a request fewer than ``world_size`` workers
        reported saved counts as failed (released, never committed)."""
        short = {k for k in self.saved if self.ranks.get(k, 0) < world_size}
        return {k: v for k, v in self.saved.items() if k not in short}, self.failed | short


class WorkerSide:
    """See the module doc. ``link``: the worker's :class:`ManagerLink` (no keep-alive, no background reconnect);
    ``shape``: the model's KV shape, all heads (checked against every manager mapped); ``shard``:
    this rank's heads (default: all)."""

    def __init__(self, link: ManagerLink, shape: KVShape, shard: HeadShard | None = None):
        self.link = link
        self.shape = shape
        self.shard = shard if shard is not None else HeadShard(0, shape.kv_heads)
        if not (0 <= self.shard.first and self.shard.num >= 1
                and self.shard.first + self.shard.num <= shape.kv_heads):
            raise LayoutMismatchError(f"head shard {tuple(self.shard)} outside the model's {shape.kv_heads} KV heads")
        self._heads = slice(self.shard.first, self.shard.first + self.shard.num)
        self._whole = self.shard.num == shape.kv_heads  # the manager's rows copied whole
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rows: list[torch.Tensor] = []  # each layer as rows of head_dim (with _geometry)
        self._geometry: RowGeometry | None = None  # the same in every layer, or None: index the views
        self._buffers: dict[int, WorkerBuffers] = {}  # epoch -> the manager's pools, mapped
        self.counters: dict[str, int] = {"loaded_tokens": 0, "saved_tokens": 0, "failed_load_tokens": 0,
                                         "failed_save_tokens": 0, "mapped_epochs": 0}

    # ------------------------------------------------------------------ set-up
    def register(self, layers: Sequence[tuple[str, torch.Tensor]]) -> None:
        """vLLM's per-layer KV tensors in layer order. Raises ``LayoutMismatchError`` when
        the tensors are not a layout this connector reads, or when the manager is up and its
        pool has another shape (names both)."""
        if len(layers) != self.shape.layers:
            raise LayoutMismatchError(f"vLLM registered {len(layers)} KV cache layers, its model config "
                                      f"has {self.shape.layers}")
        s = self.shape
        self._views = [paged_kv_views(t, s.page_size, self.shard.num, s.head_dim, name) for name, t in layers]
        geos = {row_geometry(t, k, v, s.head_dim) for (_, t), (k, v) in zip(layers, self._views, strict=True)}
        self._geometry = geos.pop() if len(geos) == 1 else None
        self._rows = [t.view(-1, s.head_dim) for _, t in layers] if self._geometry is not None else []
        for name, t in layers:
            if str(t.dtype).removeprefix("torch.") != s.dtype:
                raise LayoutMismatchError(f"vLLM KV cache of {name} is {t.dtype}, expected {s.dtype}")
        self._map_current(strict=True)

    def _map_current(self, strict: bool = False) -> int | None:
        """Attach, map the manager's pools, detach. Returns the epoch mapped (None: the
        manager is down or refused). ``strict``: raise a layout mismatch."""
        got = self.link.get(force=True)
        if got is None:
            return None
        client, info = got
        epoch = int(info.session.epoch)
        try:
            check_same_shape(self.shape, manager_kv_shape(info.layout["config"]))
            wb = client.worker_buffers(info)
            dev = self._views[0][0].device if self._views else wb.device
            if torch.device(wb.device).type != dev.type:
                raise LayoutMismatchError(f"the radixkv manager's KV pool is on {wb.device}, vLLM's KV "
                                          f"cache on {dev}: start the manager on the engine's device")
        except LayoutMismatchError:
            self.link.close()
            if strict:
                raise
            logger.error("radixkv: manager %s refused", self.link.cfg.address, exc_info=True)
            return None
        except Exception as e:
            self.link.fail(e)
            return None
        self.link.close()  # the layout is all the worker needs from a session
        self._buffers[epoch] = wb
        self.counters["mapped_epochs"] += 1
        for old in sorted(self._buffers)[:-_KEEP_EPOCHS]:
            del self._buffers[old]
        return epoch

    def _buffers_of(self, epoch: int) -> WorkerBuffers | None:
        wb = self._buffers.get(epoch)
        if wb is None:  # a new manager: map it (an op of a manager gone before we mapped it fails)
            self._map_current()
            wb = self._buffers.get(epoch)
        return wb

    # ------------------------------------------------------------------ copies
    def _indices(self, wb: WorkerBuffers, ops: Sequence[CopyOp]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(manager slots, vLLM blocks, offsets) of ``ops``, on the KV device. Raises
        ``InvalidArgumentError`` for slots outside the pool (a stale row)."""
        table = wb.req_to_token
        rows = torch.cat([table[op.row, op.start:op.end] for op in ops]).to(torch.int64)
        cap = self._views_capacity(wb)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= cap):
            raise InvalidArgumentError(f"manager rows out of range [0, {cap})")
        dev = self._views[0][0].device
        slots = torch.from_numpy(np.concatenate([op.slots for op in ops])).to(dev)
        return rows.to(dev), slots // self.shape.page_size, slots % self.shape.page_size

    @staticmethod
    def _views_capacity(wb: WorkerBuffers) -> int:
        return int(wb.get_kv_buffer(0)[0].shape[0])

    def _copy(self, ops: Sequence[CopyOp], to_vllm: bool) -> tuple[list[CopyOp], list[CopyOp]]:
        """Run ``ops`` (one batch per manager epoch): manager -> vLLM (``to_vllm``) or back,
        one gather and one scatter per layer and K/V. Returns (done ops, failed ops)."""
        by: dict[int, list[CopyOp]] = {}
        for op in ops:
            by.setdefault(op.epoch, []).append(op)
        done: list[CopyOp] = []
        failed: list[CopyOp] = []
        for epoch, group in by.items():
            wb = self._buffers_of(epoch)
            try:
                if wb is None:
                    raise InvalidArgumentError(f"manager epoch {epoch} is not mapped")
                rows, blk, off = self._indices(wb, group)
                if self._geometry is not None and (to_vllm or self.shard.writes):
                    self._copy_rows(wb, rows, blk, off, to_vllm)
                elif to_vllm or self.shard.writes:
                    hs = self._heads
                    for layer, (k, v) in enumerate(self._views):
                        mk, mv = wb.get_kv_buffer(layer)
                        if to_vllm:
                            k[blk, off] = mk.index_select(0, rows)[:, hs]
                            v[blk, off] = mv.index_select(0, rows)[:, hs]
                        else:
                            mk[:, hs].index_copy_(0, rows, k[blk, off])
                            mv[:, hs].index_copy_(0, rows, v[blk, off])
                if rows.is_cuda:
                    torch.cuda.current_stream(rows.device).synchronize()
                done.extend(group)
            except Exception as e:  # never fail the engine's step: report, recompute / not cache
                logger.warning("radixkv: %s of %d tokens failed (%s: %s)", "load" if to_vllm else "save",
                               sum(op.end - op.start for op in group), type(e).__name__, e)
                failed.extend(group)
        return done, failed

    def _copy_rows(self, wb: WorkerBuffers, rows: torch.Tensor, blk: torch.Tensor, off: torch.Tensor,
                   to_vllm: bool) -> None:
        """The copies by row index (see ``row_geometry``): per layer and K/V one
        ``index_select`` and one ``index_copy_``, row indices computed once for all layers.
        The manager's buffer is seen as rows of all heads (whole shard) or of one head."""
        assert self._geometry is not None
        h, d, n_all = self.shard.num, self.shape.head_dim, self.shape.kv_heads
        k_rows, v_rows = self._geometry.rows(blk, off, h)
        if self._whole:
            m_rows, width = rows, n_all * d
        else:  # this rank's heads of each slot: row slot * heads + head
            m_rows = (rows[:, None] * n_all + torch.arange(self.shard.first, self.shard.first + h,
                                                           device=rows.device)[None, :]).reshape(-1)
            width = d
        for layer, flat in enumerate(self._rows):
            mk, mv = (t.view(-1, width) for t in wb.get_kv_buffer(layer))
            if to_vllm:
                flat.index_copy_(0, k_rows, mk.index_select(0, m_rows).view(-1, d))
                flat.index_copy_(0, v_rows, mv.index_select(0, m_rows).view(-1, d))
            else:
                mk.index_copy_(0, m_rows, flat.index_select(0, k_rows).view(-1, width))
                mv.index_copy_(0, m_rows, flat.index_select(0, v_rows).view(-1, width))

    def load(self, ops: Sequence[CopyOp]) -> set[int]:
        """Copy the ops' manager rows into vLLM's blocks. Returns the vLLM block ids that
        could not be loaded (vLLM recomputes them)."""
        done, failed = self._copy(ops, to_vllm=True)
        self.counters["loaded_tokens"] += sum(op.end - op.start for op in done)
        self.counters["failed_load_tokens"] += sum(op.end - op.start for op in failed)
        if not failed:
            return set()
        slots = np.concatenate([op.slots for op in failed])
        return set(np.unique(slots // self.shape.page_size).tolist())

    def save(self, ops: Sequence[CopyOp]) -> tuple[dict[str, int], set[str]]:
        """Copy vLLM's blocks of the ops into the manager rows. Returns (saved: req id ->
        end token, failed req ids)."""
        done, failed = self._copy(ops, to_vllm=False)
        self.counters["saved_tokens"] += sum(op.end - op.start for op in done)
        self.counters["failed_save_tokens"] += sum(op.end - op.start for op in failed)
        saved: dict[str, int] = {}
        for op in done:
            saved[op.req_id] = max(saved.get(op.req_id, 0), op.end)
        return saved, {op.req_id for op in failed}
