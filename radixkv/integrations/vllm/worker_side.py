"""The worker half of the connector: copies between the manager's KV pool and vLLM's cache.

The manager's pools are mapped zero-copy once per manager epoch (a session is opened just to
read the layout). A step's loads run before the forward, its saves after it, each one gather
and one scatter per layer and K/V over all the step's tokens: no per-token Python loop. An
op of an epoch this worker cannot map is reported failed (vLLM recomputes the load, the
scheduler releases the save); a load from a mapped epoch is done even if that manager died
(the memory stays mapped and the rows were locked). See ``docs/vllm.md``, "The worker side".
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from radixkv.errors import InvalidArgumentError
from radixkv.integrations.vllm.layout import (
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

__all__ = ["WorkerSide"]

logger = logging.getLogger("radixkv.integrations.vllm")

_KEEP_EPOCHS = 2  # mapped epochs kept (the current one and the one before a restart)


class WorkerSide:
    """See the module doc. ``link``: the worker's :class:`ManagerLink` (no keep-alive, no background reconnect);
    ``shape``: vLLM's KV shape (checked against every manager mapped)."""

    def __init__(self, link: ManagerLink, shape: KVShape):
        self.link = link
        self.shape = shape
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
        self._views = [paged_kv_views(t, s.page_size, s.kv_heads, s.head_dim, name) for name, t in layers]
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
                if self._geometry is not None:
                    self._copy_rows(wb, rows, blk, off, to_vllm)
                else:
                    for layer, (k, v) in enumerate(self._views):
                        mk, mv = wb.get_kv_buffer(layer)
                        if to_vllm:
                            k[blk, off] = mk.index_select(0, rows)
                            v[blk, off] = mv.index_select(0, rows)
                        else:
                            mk.index_copy_(0, rows, k[blk, off])
                            mv.index_copy_(0, rows, v[blk, off])
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
        ``index_select`` and one ``index_copy_``, row indices computed once for all layers."""
        assert self._geometry is not None
        h, d = self.shape.kv_heads, self.shape.head_dim
        k_rows, v_rows = self._geometry.rows(blk, off, h)
        for layer, flat in enumerate(self._rows):
            mk, mv = wb.get_kv_buffer(layer)
            if to_vllm:
                flat.index_copy_(0, k_rows, mk.index_select(0, rows).reshape(-1, d))
                flat.index_copy_(0, v_rows, mv.index_select(0, rows).reshape(-1, d))
            else:
                mk.index_copy_(0, rows, flat.index_select(0, k_rows).view(-1, h, d))
                mv.index_copy_(0, rows, flat.index_select(0, v_rows).view(-1, h, d))

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
