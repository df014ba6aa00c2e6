"""The worker half of the connector: copies between the manager's KV pool and vLLM's cache.

The manager's pools are mapped zero-copy (``client.worker_buffers``: a shared-memory file on
CPU, CUDA IPC on GPU), once per manager epoch; only the session's layout travels over gRPC.
The worker opens a session just to read that layout, maps the pools, and detaches.

A step's loads run before the forward (``load``), its saves after it (``save``), each as one
gather and one scatter per layer and K/V over all the step's tokens (``index_select`` /
``index_copy_`` on the manager side, advanced indexing on vLLM's ``[blocks, block, heads,
head_dim]`` views): no per-token Python loop.

Index misses (see :mod:`~radixkv.integrations.vllm.scheduler_side`): each of the step's
:class:`AllocOp` s is sent as an ``alloc_extend`` when the step starts (``start_allocs``), on a
client of the worker's own, and its reply is read in ``save``, after the forward: the round
trip overlaps the forward. No Python thread makes the call (one would wait for the GIL the
forward holds at every hand-off). The ops with ``row == -1`` go to the allocated row, past the
prefix the manager held. A request it could not allocate (capacity, manager away) is reported
``unallocated`` and not saved.

An op of a manager epoch this worker cannot map (the manager restarted again) is not done:
its load is reported as failed (vLLM recomputes those blocks) and its save as failed (the
scheduler releases the request). A load from an epoch already mapped is done even if that
manager has died meanwhile: its memory stays mapped, and the rows were locked for this
request when matched, so nobody rewrote them.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from radixkv.engine.protocol import ExtendItem
from radixkv.errors import CapacityError, InvalidArgumentError
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
from radixkv.integrations.vllm.scheduler_side import AllocOp, CopyOp

__all__ = ["WorkerSide"]

logger = logging.getLogger("radixkv.integrations.vllm")

_KEEP_EPOCHS = 2  # mapped epochs kept (the current one and the one before a restart)
_MAX_ROWS = 4096  # allocated rows remembered (a request aborted mid-prefill leaves its entry)


class WorkerSide:
    """See the module doc. ``link``: the worker's :class:`ManagerLink` (no keep-alive, no background reconnect);
    ``shape``: vLLM's KV shape (checked against every manager mapped)."""

    def __init__(self, link: ManagerLink, shape: KVShape):
        self.link = link
        self.shape = shape
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rows: list[torch.Tensor] = []  # each layer as rows of head_dim (with _geometry)
        self._geometry: RowGeometry | None = None  # the same in every layer, or None: index the views
        self._buffers: dict[int, Any] = {}  # epoch -> WorkerBuffers
        self.counters: dict[str, int] = {"loaded_tokens": 0, "saved_tokens": 0, "failed_load_tokens": 0,
                                         "failed_save_tokens": 0, "mapped_epochs": 0, "allocs": 0,
                                         "alloc_failures": 0}
        self._alloc_client: Any = None  # its own client (connected in the background)
        self._connecting: threading.Thread | None = None
        self._pending: dict[str, tuple[AllocOp, Callable[[], Any] | None]] = {}  # sent, reply not read
        self._rows_of: dict[str, tuple[int, int, int, int]] = {}  # req_id -> (epoch, row, prefix, n_full)
        self._allocated: dict[str, tuple[int, int]] = {}  # to report: req_id -> (row, prefix)
        self._unallocated: set[str] = set()  # to report

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
        self._client_now()  # the alloc client connects in the background, ready for the first miss

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

    def _buffers_of(self, epoch: int) -> Any | None:
        wb = self._buffers.get(epoch)
        if wb is None:  # a new manager: map it (an op of a manager gone before we mapped it fails)
            self._map_current()
            wb = self._buffers.get(epoch)
        return wb

    # ------------------------------------------------------------------ copies
    def _indices(self, wb: Any, ops: Sequence[CopyOp]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    def _views_capacity(wb: Any) -> int:
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

    def _copy_rows(self, wb: Any, rows: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, to_vllm: bool) -> None:
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
        """Copy vLLM's blocks of the ops into the manager rows (ops with ``row == -1``: the
        row this worker allocated, past the manager's prefix). Returns (saved: req id -> end
        token, failed req ids); what was allocated is reported by ``take_alloc_report``."""
        saved: dict[str, int] = {}
        todo, failed_ids = self._resolve(ops, saved)
        done, failed = self._copy(todo, to_vllm=False) if todo else ([], [])
        self.counters["saved_tokens"] += sum(op.end - op.start for op in done)
        self.counters["failed_save_tokens"] += sum(op.end - op.start for op in failed)
        for op in done:
            saved[op.req_id] = max(saved.get(op.req_id, 0), op.end)
        return saved, failed_ids | {op.req_id for op in failed}

    # ------------------------------------------------------------------ allocs (index misses)
    def start_allocs(self, ops: Sequence[AllocOp]) -> None:
        """Send one ``alloc_extend`` per op now, without waiting for the replies (a unary
        call each, no thread: a Python thread would wait for the GIL the forward holds).
        Without a client yet (one connects in the background) the ops are not allocated."""
        client = self._client_now() if ops else None
        for op in ops:
            reply: Callable[[], Any] | None = None
            if client is not None:
                try:
                    reply = client.alloc_extend_async(op.session, [ExtendItem(op.mrid, op.tokens, op.extra_key)])
                except Exception as e:  # refused before sending (stale session, bad input)
                    logger.debug("radixkv: alloc of %s not sent (%s: %s)", op.req_id, type(e).__name__, e)
            self._pending[op.req_id] = (op, reply)

    @property
    def alloc_ready(self) -> bool:
        """The alloc client is connected (until then index misses are not cached)."""
        return self._alloc_client is not None

    def _client_now(self) -> Any | None:
        """The alloc client, or None while one connects in a background thread."""
        if self._alloc_client is None and (self._connecting is None or not self._connecting.is_alive()):
            self._connecting = threading.Thread(target=self._connect_alloc_client, name="radixkv-alloc-connect",
                                                daemon=True)
            self._connecting.start()
        return self._alloc_client

    def _connect_alloc_client(self) -> None:
        try:
            self._alloc_client = self.link.new_client()
        except Exception as e:  # the manager is away: misses are not cached until it is back
            logger.debug("radixkv: worker alloc client not connected (%s: %s)", type(e).__name__, e)

    def _take_alloc(self, req_id: str) -> tuple[int, int, int, int] | None:
        """Wait for the reply of ``req_id``'s alloc: (epoch, row, prefix, n_full) or None."""
        op, reply = self._pending.pop(req_id)
        if reply is None:
            return None
        try:
            res = reply()[0]
        except (CapacityError, InvalidArgumentError) as e:  # longer than the pool / context
            logger.debug("radixkv: %s not cached: %s", req_id, e)
            return None
        except Exception as e:  # the manager went away: a new client next time
            logger.warning("radixkv: alloc of %s failed (%s: %s)", req_id, type(e).__name__, e)
            client, self._alloc_client = self._alloc_client, None
            if client is not None:
                _close_quietly(client)
            return None
        return int(op.session.epoch), int(res.req_pool_idx), int(res.prefix_len), op.n_full

    def _resolve(self, ops: Sequence[CopyOp], saved: dict[str, int]) -> tuple[list[CopyOp], set[str]]:
        """Ops with ``row == -1`` -> the allocated row, from the manager's prefix on (an op
        inside the prefix is reported saved, nothing to copy). Returns (ops to copy, failed)."""
        todo: list[CopyOp] = []
        failed: set[str] = set()
        for op in ops:
            if op.row >= 0:
                todo.append(op)
                continue
            if op.req_id in self._pending:
                got = self._take_alloc(op.req_id)
                self.counters["allocs" if got is not None else "alloc_failures"] += 1
                if got is None:
                    self._unallocated.add(op.req_id)
                else:
                    self._rows_of[op.req_id] = got
                    self._allocated[op.req_id] = (got[1], got[2])
                    while len(self._rows_of) > _MAX_ROWS:
                        del self._rows_of[next(iter(self._rows_of))]
            entry = self._rows_of.get(op.req_id)
            if entry is None:
                if op.req_id not in self._unallocated:
                    failed.add(op.req_id)  # a row forgotten (aborted long ago): release
                continue
            epoch, row, prefix, n_full = entry
            if op.end >= n_full:
                del self._rows_of[op.req_id]
            if op.end <= prefix:
                saved[op.req_id] = max(saved.get(op.req_id, 0), op.end)
                continue
            start = max(op.start, prefix)
            todo.append(op._replace(epoch=epoch, row=row, start=start, slots=op.slots[start - op.start:]))
        return todo, failed

    def take_alloc_report(self) -> tuple[dict[str, tuple[int, int]], set[str]]:
        """(allocated: req id -> (row, prefix), unallocated req ids) since the last take."""
        out = (self._allocated, self._unallocated)
        self._allocated, self._unallocated = {}, set()
        return out

    def close(self) -> None:
        """Close the alloc client and the link."""
        if self._alloc_client is not None:
            _close_quietly(self._alloc_client)
            self._alloc_client = None
        self.link.close()


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # a broken channel: nothing left to close
        pass
